"""vLLM output -> TrajectoryBatch, with stand-ins that mirror vLLM 0.32's output types.

The stand-ins copy the attribute names of ``vllm.outputs.CompletionOutput`` / ``RequestOutput`` /
``SamplingMask`` / ``WeightVersionSpan`` and ``vllm.logprobs.Logprob`` / ``FlatLogprobs``; vLLM
itself is not installed here.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

from moe_rl.data import TrajectoryError
from moe_rl.data.vllm_convert import from_vllm_outputs


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class FlatLogprobs:
    start_indices: list[int] = field(default_factory=list)
    end_indices: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.start_indices)

    def __getitem__(self, i: int) -> dict[int, Logprob]:
        return {
            self.token_ids[j]: Logprob(self.logprobs[j])
            for j in range(self.start_indices[i], self.end_indices[i])
        }


@dataclass
class SamplingMask:
    token_ids: list[list[int]]


@dataclass
class CsrSamplingMask:
    token_ids: list[int]
    offsets: list[int]


@dataclass
class WeightVersionSpan:
    version: str
    start: int
    end: int


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: Any
    routed_experts: np.ndarray | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: Any = None
    sampling_mask: Any = None
    spec_decode_metrics: Any = None
    weight_versions: list[WeightVersionSpan] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: Any
    outputs: list[CompletionOutput]
    finished: bool = True


def _logprobs(tokens: list[int], values: list[float]) -> list[dict[int, Logprob]]:
    """Sampled token plus one other top token, as vLLM returns with logprobs=1."""
    return [{t: Logprob(v, rank=1), (t + 1) % 32: Logprob(v - 1.0, rank=2)} for t, v in zip(tokens, values)]


def _completion(
    index: int,
    tokens: list[int],
    prompt_len: int,
    *,
    versions: list[WeightVersionSpan] | None = None,
    **overrides: Any,
) -> CompletionOutput:
    values = [-0.25 * (i + 1) for i in range(len(tokens))]
    rng = np.random.default_rng(index)
    routing = np.stack([rng.permutation(8)[:2] for _ in range((prompt_len + len(tokens) - 1) * 3)])
    fields: dict[str, Any] = {
        "logprobs": _logprobs(tokens, values),
        "routed_experts": routing.reshape(-1, 3, 2).astype(np.int32),
        "finish_reason": "stop",
        "sampling_mask": SamplingMask([[t, (t + 5) % 32] for t in tokens]),
        "weight_versions": versions if versions is not None else [WeightVersionSpan("7", 0, len(tokens))],
    }
    fields.update(overrides)
    return CompletionOutput(index=index, text="", token_ids=tokens, cumulative_logprob=sum(values), **fields)


def _requests(**overrides: Any) -> list[RequestOutput]:
    spans = [WeightVersionSpan("6", 0, 2), WeightVersionSpan("7", 2, 3)]
    return [
        RequestOutput(
            "r0",
            None,
            [1, 2, 3],
            None,
            [_completion(0, [4, 5, 6], 3, versions=spans, **overrides), _completion(1, [7], 3)],
        ),
        RequestOutput("r1", None, [9, 9], None, [_completion(2, [10, 11], 2, finish_reason="length")]),
    ]


def test_conversion_carries_every_field() -> None:
    batch = from_vllm_outputs(
        _requests(),
        policy_version=7,
        quant_recipe="fp8",
        num_experts=8,
        vocab_size=32,
        rewards=[1.0, 0.0, 0.5],
    )
    assert batch.num_samples == 3
    assert batch.group_ids.tolist() == [0, 0, 1] and batch.rewards.tolist() == [1.0, 0.0, 0.5]
    assert batch.finish_reasons == ["stop", "stop", "length"]
    assert batch.sample(0).prompt_ids.tolist() == [1, 2, 3] and batch.sample(2).prompt_ids.tolist() == [9, 9]
    assert batch.response_ids.tolist() == [4, 5, 6, 7, 10, 11]
    assert batch.rollout_logp.tolist() == [-0.25, -0.5, -0.75, -0.25, -0.25, -0.5]
    assert batch.sample(0).version_spans == [(0, 6), (2, 7)] and batch.sample(1).version_spans == [(0, 7)]
    assert batch.routed_experts is not None and batch.routed_experts.dtype == torch.uint8
    assert (batch.num_moe_layers, batch.topk, batch.num_experts) == (3, 2, 8)
    assert (batch.routing_lengths() == batch.sequence_lengths() - 1).all()  # the last token not forwarded
    assert batch.sample(0).routed_experts.long().tolist() == _requests()[0].outputs[0].routed_experts.tolist()
    s0 = batch.sample(0)
    assert s0.sampling_mask_ids is not None and s0.sampling_mask_ids.tolist() == [4, 9, 5, 10, 6, 11]
    assert (batch.engine, batch.quant_recipe, batch.policy_version) == ("vllm", "fp8", 7)


def test_flat_logprobs_and_csr_mask_give_the_same_batch() -> None:
    tokens = [4, 5, 6]
    flat = FlatLogprobs([0, 2, 3], [2, 3, 5], [30, 4, 5, 1, 6], [-3.0, -0.5, -0.125, -2.0, -0.75])
    nested = [
        {30: Logprob(-3.0), 4: Logprob(-0.5)},
        {5: Logprob(-0.125)},
        {1: Logprob(-2.0), 6: Logprob(-0.75)},
    ]
    csr = CsrSamplingMask([4, 5, 9, 6], [0, 1, 3, 4])
    lists = SamplingMask([[4], [5, 9], [6]])
    a = from_vllm_outputs(
        [RequestOutput("r", None, [1], None, [_completion(0, tokens, 1, logprobs=flat, sampling_mask=csr)])],
        policy_version=7,
        quant_recipe="bf16",
        num_experts=8,
    )
    b = from_vllm_outputs(
        [
            RequestOutput(
                "r", None, [1], None, [_completion(0, tokens, 1, logprobs=nested, sampling_mask=lists)]
            )
        ],
        policy_version=7,
        quant_recipe="bf16",
        num_experts=8,
    )
    assert a.rollout_logp.tolist() == [-0.5, -0.125, -0.75] == b.rollout_logp.tolist()
    assert torch.equal(a.sampling_mask_ids, b.sampling_mask_ids)
    assert torch.equal(a.sampling_mask_offsets, b.sampling_mask_offsets)


def test_optional_outputs_absent_and_versions_default() -> None:
    req = RequestOutput(
        "r",
        None,
        [1, 2],
        None,
        [_completion(0, [3, 4], 2, routed_experts=None, sampling_mask=None, weight_versions=None)],
    )
    batch = from_vllm_outputs([req], policy_version=4, quant_recipe="bf16", group_ids=[17])
    assert batch.routed_experts is None and batch.sampling_mask_ids is None
    assert batch.sample(0).version_spans == [(0, 4)] and batch.group_ids.tolist() == [17]


def test_full_length_routing_is_accepted() -> None:
    routing = np.tile(np.array([[0, 1], [2, 3], [4, 5]]), (4, 1, 1))
    req = RequestOutput("r", None, [1, 2], None, [_completion(0, [3, 4], 2, routed_experts=routing)])
    batch = from_vllm_outputs([req], policy_version=7, quant_recipe="bf16", num_experts=300)
    assert batch.routing_lengths().tolist() == batch.sequence_lengths().tolist() == [4]
    assert batch.routed_experts is not None and batch.routed_experts.dtype == torch.uint16


BAD_OUTPUTS = [
    ("no-logprobs", {"logprobs": None}, "logprobs"),
    (
        "sampled-token-missing-from-logprobs",
        {"logprobs": [{4: Logprob(-0.1)}, {99: Logprob(-0.1)}, {6: Logprob(-1)}]},
        "logprobs",
    ),
    ("logprobs-too-short", {"logprobs": [{4: Logprob(-0.1)}]}, "logprobs"),
    (
        "positive-logprob",
        {"logprobs": [{4: Logprob(0.5)}, {5: Logprob(-0.1)}, {6: Logprob(-1)}]},
        "rollout_logp",
    ),
    ("unfinished", {"finish_reason": None}, "finish_reason"),
    ("engine-error", {"finish_reason": "error"}, "finish_reason"),
    ("default-version-label", {"weight_versions": [WeightVersionSpan("default", 0, 3)]}, "weight_versions"),
    (
        "spans-with-gap",
        {"weight_versions": [WeightVersionSpan("6", 0, 1), WeightVersionSpan("7", 2, 3)]},
        "weight_versions",
    ),
    ("spans-short", {"weight_versions": [WeightVersionSpan("6", 0, 2)]}, "weight_versions"),
    (
        "version-newer-than-policy",
        {"weight_versions": [WeightVersionSpan("8", 0, 3)]},
        "version_span_versions",
    ),
    (
        "routing-prompt-start-skipped",
        {"routed_experts": np.zeros((2, 3, 2), dtype=np.int32)},
        "routed_experts",
    ),
    (
        "routing-expert-out-of-range",
        {"routed_experts": np.full((5, 3, 2), 9, dtype=np.int32)},
        "routed_experts",
    ),
    ("routing-duplicate-expert", {"routed_experts": np.zeros((5, 3, 2), dtype=np.int32)}, "routed_experts"),
    ("mask-missing-sampled-token", {"sampling_mask": SamplingMask([[4], [1], [6]])}, "sampling_mask_ids"),
    ("mask-row-count", {"sampling_mask": SamplingMask([[4], [5]])}, "sampling_mask"),
]


@pytest.mark.parametrize(("overrides", "field"), [pytest.param(o, f, id=i) for i, o, f in BAD_OUTPUTS])
def test_bad_engine_output_is_rejected_naming_field(overrides: dict[str, Any], field: str) -> None:
    good = RequestOutput("ok", None, [8], None, [_completion(5, [2], 1)])
    bad = RequestOutput("bad", None, [1, 2, 3], None, [_completion(0, [4, 5, 6], 3, **overrides)])
    with pytest.raises(TrajectoryError) as err:
        from_vllm_outputs([good, bad], policy_version=7, quant_recipe="bf16", num_experts=8)
    assert err.value.field == field
    assert err.value.sample == 1


def test_routing_needs_num_experts_and_prompt_ids_are_required() -> None:
    with pytest.raises(TrajectoryError, match="num_experts"):
        from_vllm_outputs(_requests(), policy_version=7, quant_recipe="bf16")
    with pytest.raises(TrajectoryError, match="prompt_token_ids"):
        from_vllm_outputs([RequestOutput("r", None, None, None, [])], policy_version=7, quant_recipe="bf16")
    with pytest.raises(TrajectoryError, match="rewards"):
        from_vllm_outputs(_requests(), policy_version=7, quant_recipe="bf16", num_experts=8, rewards=[1.0])


def test_converter_does_not_import_vllm() -> None:
    code = "import sys, moe_rl.data.vllm_convert; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
