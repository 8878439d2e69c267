"""vLLM's own output types -> TrajectoryBatch, and the engine's vLLM-facing pieces, without an engine.

The CUDA-only fields (``routed_experts``, ``sampling_mask``, ``weight_versions`` across a weight
update) are built here with vLLM's own classes: directly, and through vLLM's ``OutputProcessor``
(the code that assembles them from engine-core steps in a real run).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

vllm = pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.logprobs import FlatLogprobs, Logprob  # noqa: E402
from vllm.outputs import CompletionOutput, RequestOutput, SamplingMask, WeightVersionSpan  # noqa: E402
from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest, FinishReason  # noqa: E402
from vllm.v1.engine.output_processor import OutputProcessor  # noqa: E402
from vllm.v1.outputs import LogprobsLists, SamplingMaskLists  # noqa: E402

from moe_rl.data import TrajectoryError  # noqa: E402
from moe_rl.data.vllm_convert import from_vllm_outputs  # noqa: E402
from moe_rl.rollout.engine import SamplingSpec  # noqa: E402
from moe_rl.rollout.vllm_engine import sampling_params  # noqa: E402
from moe_rl.rollout.vllm_receiver import _LLMSyncClient  # noqa: E402

LAYERS, TOPK, EXPERTS = 2, 2, 8


def routing(rows: int, rng: np.random.Generator, dtype=np.int32) -> np.ndarray:
    """[rows, LAYERS, TOPK] distinct expert ids per token and layer."""
    return np.argsort(rng.random((rows, LAYERS, EXPERTS)), axis=-1)[..., :TOPK].astype(dtype)


def completion(index, tokens, logps, *, prompt_len, versions=(("0", 0, None),), seed=0, mask=True):
    rng = np.random.default_rng(seed)
    spans = [WeightVersionSpan(v, s, len(tokens) if e is None else e) for v, s, e in versions]
    return CompletionOutput(
        index=index,
        text="",
        token_ids=list(tokens),
        cumulative_logprob=float(sum(logps)),
        logprobs=[{t: Logprob(logprob=lp, rank=1)} for t, lp in zip(tokens, logps, strict=True)],
        routed_experts=routing(prompt_len + len(tokens) - 1, rng),
        finish_reason="length",
        sampling_mask=SamplingMask([[t, (t + 1) % 64] for t in tokens]) if mask else None,
        weight_versions=spans,
    )


def request(request_id, prompt, completions):
    return RequestOutput(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=prompt,
        prompt_logprobs=None,
        outputs=completions,
        finished=True,
    )


def two_requests():
    first = request(
        "a",
        [1, 2, 3],
        [
            completion(0, [10, 11], [-0.5, -1.0], prompt_len=3, seed=1),
            completion(
                1,
                [12, 13, 14],
                [-0.1, -0.2, -0.3],
                prompt_len=3,
                seed=2,
                versions=(("4", 0, 1), ("5", 1, None)),
            ),
        ],
    )
    second = request("b", [7, 8], [completion(0, [20], [-2.0], prompt_len=2, seed=3)])
    return [first, second]


def test_vllm_request_outputs_convert_with_routing_masks_and_versions():
    outputs = two_requests()
    batch = from_vllm_outputs(
        outputs, policy_version=5, quant_recipe="fp8_block128", num_experts=EXPERTS, vocab_size=64
    )
    assert (batch.engine, batch.quant_recipe, batch.policy_version) == ("vllm", "fp8_block128", 5)
    assert batch.group_ids.tolist() == [0, 0, 1]
    assert batch.response_ids.tolist() == [10, 11, 12, 13, 14, 20]
    assert batch.prompt_ids.tolist() == [1, 2, 3, 1, 2, 3, 7, 8]
    torch.testing.assert_close(batch.rollout_logp, torch.tensor([-0.5, -1.0, -0.1, -0.2, -0.3, -2.0]))
    assert batch.token_versions().tolist() == [0, 0, 4, 5, 5, 0]
    assert batch.sampling_mask_offsets.tolist() == [0, 2, 4, 6, 8, 10, 12]
    assert batch.sampling_mask_ids[:2].tolist() == [10, 11]
    assert batch.routed_experts.dtype == torch.uint8
    assert (batch.num_moe_layers, batch.topk, batch.num_experts) == (LAYERS, TOPK, EXPERTS)


def test_routing_splits_into_prompt_and_generated_rows():
    """vLLM returns prompt_len + response_len - 1 rows: the prompt's, then one per generated token
    except the last (never forwarded)."""
    outputs = two_requests()
    batch = from_vllm_outputs(outputs, policy_version=5, quant_recipe="bf16", num_experts=EXPERTS)
    assert batch.routing_lengths().tolist() == [4, 5, 2]
    assert (batch.routing_lengths() == batch.sequence_lengths() - 1).all()
    for i, (req, comp) in enumerate([(0, 0), (0, 1), (1, 0)]):
        source = outputs[req].outputs[comp].routed_experts
        prompt_len = len(outputs[req].prompt_token_ids)
        trace = batch.sample(i).routed_experts
        assert torch.equal(trace[:prompt_len].long(), torch.from_numpy(source[:prompt_len]).long())
        assert torch.equal(trace[prompt_len:].long(), torch.from_numpy(source[prompt_len:]).long())


def test_routing_cut_by_routed_experts_prompt_start_is_refused():
    out = two_requests()
    out[1].outputs[0].routed_experts = out[1].outputs[0].routed_experts[1:]  # prompt start 1: a row short
    with pytest.raises(TrajectoryError, match=r"routed_experts \(sample 2\).*routed_experts_prompt_start"):
        from_vllm_outputs(out, policy_version=5, quant_recipe="bf16", num_experts=EXPERTS)


def test_default_weight_version_label_is_refused():
    """vLLM labels tokens 'default' until set_weight_version is called: the engine sets it at start."""
    out = two_requests()
    out[1].outputs[0].weight_versions = [WeightVersionSpan("default", 0, 1)]
    with pytest.raises(TrajectoryError, match="weight version label is not an integer"):
        from_vllm_outputs(out, policy_version=0, quant_recipe="bf16", num_experts=EXPERTS)


def test_flat_logprobs_convert_like_dict_logprobs():
    out = two_requests()
    for req in out:
        for comp in req.outputs:
            flat = FlatLogprobs()
            flat.extend(comp.logprobs)
            comp.logprobs = flat
    flat_batch = from_vllm_outputs(out, policy_version=5, quant_recipe="bf16", num_experts=EXPERTS)
    dict_batch = from_vllm_outputs(two_requests(), policy_version=5, quant_recipe="bf16", num_experts=EXPERTS)
    assert torch.equal(flat_batch.rollout_logp, dict_batch.rollout_logp)


def _engine_core_request(prompt: list[int]) -> EngineCoreRequest:
    params = SamplingParams(max_tokens=3, logprobs=0, detokenize=False, top_k=2)
    return EngineCoreRequest(
        request_id="r0",
        prompt_token_ids=prompt,
        mm_features=None,
        sampling_params=params,
        pooling_params=None,
        arrival_time=0.0,
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
        external_req_id="r0",
    )


def test_outputs_assembled_by_vllms_output_processor_convert():
    """Three engine-core steps, the weights updated (version 0 -> 1) before the last: vLLM's own
    OutputProcessor concatenates the routing chunks, the mask rows and the version spans."""
    prompt = [5, 6, 7]
    processor = OutputProcessor(None, log_stats=False)
    processor.add_request(_engine_core_request(prompt), None)
    rng = np.random.default_rng(0)
    chunks, finals = [], []
    for step, (token, version) in enumerate([(11, "0"), (12, "0"), (13, "1")]):
        chunk = routing(len(prompt) if step == 0 else 1, rng, np.int16)
        chunks.append(chunk)
        core_out = EngineCoreOutput(
            request_id="r0",
            new_token_ids=[token],
            new_logprobs=LogprobsLists(
                np.array([[token]]), np.array([[-0.25 * (step + 1)]], np.float32), np.array([1])
            ),
            routed_experts=chunk,
            new_sampling_mask=SamplingMaskLists(np.array([token, 1], dtype=np.int64)),
            finish_reason=FinishReason.LENGTH if step == 2 else None,
        )
        finals += processor.process_outputs([core_out], weight_version=version).request_outputs
    batch = from_vllm_outputs(
        finals[-1:], policy_version=1, quant_recipe="bf16", num_experts=EXPERTS, vocab_size=64
    )
    assert batch.response_ids.tolist() == [11, 12, 13]
    torch.testing.assert_close(batch.rollout_logp, torch.tensor([-0.25, -0.5, -0.75]))
    assert batch.token_versions().tolist() == [0, 0, 1]
    assert batch.sampling_mask_ids.tolist() == [11, 1, 12, 1, 13, 1]
    assert batch.routing_lengths().tolist() == [len(prompt) + 3 - 1]
    assert torch.equal(batch.routed_experts.long(), torch.from_numpy(np.concatenate(chunks)).long())
    assert batch.finish_reasons == ["length"]


def test_sampling_params_from_spec():
    spec = SamplingSpec(
        temperature=0.5, top_k=-1, top_p=0.9, max_new_tokens=7, n=4, seed=10, stop_token_ids=(3,)
    )
    params = sampling_params(spec, prompt_index=2)
    assert (params.n, params.temperature, params.top_k, params.top_p) == (4, 0.5, 0, 0.9)
    assert (params.max_tokens, params.logprobs, params.detokenize) == (7, 0, False)
    assert params.seed == (10 << 16) + 2 * 4  # prompt_seed(10, 2, n=4): the batch's block, prompt 2
    assert params.stop_token_ids == [3]
    assert sampling_params(SamplingSpec(top_k=5), 0).top_k == 5
    assert sampling_params(SamplingSpec(), 3).seed is None


class _FakeLLM:
    def __init__(self):
        self.calls = []
        self.llm_engine = self

    def collective_rpc(self, method, args=(), kwargs=None):
        self.calls.append((method, kwargs))
        return [None]

    def set_weight_version(self, version):
        self.calls.append(("set_weight_version", version))


def test_weight_sync_client_drives_vllms_weight_transfer_calls_in_order():
    llm = _FakeLLM()
    client = _LLMSyncClient(llm)
    client.init_weight_transfer_engine({"packed": False})
    client.pending_version = "7"
    client.start_weight_update()
    client.update_weights({"names": ["w"]})
    client.finish_weight_update()
    assert [c[0] for c in llm.calls] == [
        "init_weight_transfer_engine",
        "start_weight_update",
        "update_weights",
        "finish_weight_update",
        "set_weight_version",
    ]
    assert llm.calls[0][1] == {"init_info": {"packed": False}}
    assert llm.calls[2][1] == {"update_info": {"names": ["w"]}}
    assert llm.calls[-1] == ("set_weight_version", "7")


def test_engine_refuses_what_vllm_cpu_cannot_do_before_starting(tmp_path):
    from moe_rl.config.schema import QuantConfig, RecipeConfig
    from moe_rl.rollout.capabilities import Machine
    from moe_rl.rollout.vllm_engine import VLLMEngine
    from moe_rl.rollout.vllm_settings import VllmSettings

    with pytest.raises(ValueError, match=r"vllm on cpu \(the vllm-cpu build\) cannot return routed experts"):
        VLLMEngine(tmp_path, VllmSettings(device="cpu", return_routing=True))
    with pytest.raises(ValueError, match="cannot return sampling masks"):
        VLLMEngine(tmp_path, VllmSettings(device="cpu", return_sampling_mask=True))
    with pytest.raises(ValueError, match=r"cannot run rollout.quant=fp8_block128 \(fp8\)"):
        VLLMEngine(tmp_path, VllmSettings(device="cpu", quant=QuantConfig(name="fp8_block128", method="fp8")))
    with pytest.raises(ValueError, match="no config.json"):
        VLLMEngine(tmp_path, VllmSettings(device="cpu"))
    config = RecipeConfig()
    config.rollout.engine, config.algo.routing_replay, config.model.head_dim = "vllm", "r3", 32
    with pytest.raises(ValueError, match="needed by algo.routing_replay=r3"):
        VLLMEngine.from_recipe(config, tmp_path, machine=Machine(cuda=False))


def test_in_process_engine_refuses_a_process_with_a_distributed_group(tmp_path):
    from moe_rl.rollout.vllm_engine import VLLMEngine
    from moe_rl.rollout.vllm_settings import VllmSettings

    own_group = not torch.distributed.is_initialized()  # earlier tests may hold one already
    if own_group:
        torch.distributed.init_process_group(
            "gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1
        )
    try:
        with pytest.raises(ValueError, match="already has a torch.distributed group"):
            VLLMEngine(tmp_path, VllmSettings(device="cpu"), in_process=True)
    finally:
        if own_group:
            torch.distributed.destroy_process_group()


def test_an_int16_routed_experts_payload_reaches_the_rows_the_trainer_replays():
    """vLLM returns ``routed_experts`` as int16 ``[prompt + response - 1, layers, top_k]`` (it never
    runs the last sampled token). Packed for the trainer, packed position ``p`` of a sample replays
    payload row ``p``: the forward that predicts response token ``r`` from position ``r - 1`` runs
    with the engine's experts at every position before it; the last position repeats the row before
    it and is marked invalid (its output feeds no loss)."""
    from moe_rl.data.packing import pack_samples

    rng = np.random.default_rng(7)
    prompts, responses = [[1, 2, 3], [7, 8]], [[10, 11, 12], [20, 21]]
    outputs = []
    for i, (prompt, tokens) in enumerate(zip(prompts, responses, strict=True)):
        out = completion(0, tokens, [-0.5] * len(tokens), prompt_len=len(prompt), seed=i)
        out.routed_experts = routing(len(prompt) + len(tokens) - 1, rng, np.int16)
        outputs.append(request(str(i), prompt, [out]))
    batch = from_vllm_outputs(
        outputs, policy_version=0, quant_recipe="bf16", num_experts=EXPERTS, vocab_size=64
    )
    micro = pack_samples(batch, torch.arange(batch.num_samples))
    start = 0
    for out, prompt, tokens in zip(outputs, prompts, responses, strict=True):
        payload = torch.from_numpy(out.outputs[0].routed_experts.astype(np.int64))
        length = len(prompt) + len(tokens)
        rows = micro.routed_experts[start : start + length].long()
        assert torch.equal(rows[: length - 1], payload)  # position p: the engine's experts at p
        assert torch.equal(rows[length - 1], payload[-1])  # the last sampled token: never run by vLLM
        valid = micro.routing_valid[start : start + length]
        assert valid[: length - 1].all() and not valid[length - 1]
        start += length
