"""The Megatron engine: generation with the trainer's own Megatron-core model.

It is the CPU path for R3 and keep-sampling-mask, and the zero-mismatch reference: with the
`bf16` recipe its weights are the trainer's, bit for bit. Quantized recipes run through ModelOpt
fake quantization at each weight sync (`moe_rl.quant.recipes`), so the engine computes with the
values a quantized engine would hold.

Decoding is incremental (`Decoding.KV_CACHE`): the prompts are prefilled once, then each step
feeds one token per unfinished sequence through Megatron-core's static inference context, the KV
cache ``GPTModel.forward`` accepts (`moe_rl.megatron.decoding.KVCacheDecoder`); finished sequences
leave the batch. The cache holds every sequence of a `generate` call, longest prompt +
``max_new_tokens`` slots, and may take at most ``rollout.megatron_kv_cache_gib``; a call that needs
more is refused with the numbers. `Decoding.RECOMPUTE` re-runs every prefix at each step as one
packed sequence (Megatron ``thd`` layout): the reference the cached path is tested against, and
the path taken where the core attention ignores explicit masks (transformer-engine's). Every
forward runs under RouterReplay RECORD and a step keeps the routing of the positions it computes
for the first time, which is exactly the routing each next token was sampled with. As in vLLM,
the last sampled token is never forwarded, so a trace has ``prompt_len + response_len − 1`` rows.
Sampling follows vLLM's semantics (`moe_rl.rollout.sampler`).

Device: the engine owns the process's device (`moe_rl.device`). Prompts are packed there, the
sampler's generator lives there (seeded from the recipe, so a seed gives the same draws on the
same device), and each decoding step reads its sampled tokens, log-probs, kept sets and routing
rows back to the CPU once: the trajectories it returns are CPU tensors.

How the rollout recipe takes the weights a sync brings (as they arrive, ModelOpt's fake
quantization, or `int4_awq` calibrated on the engine's own rollouts) is `moe_rl.rollout.arrival`'s;
syncs and decoding take turns at token boundaries through `moe_rl.rollout.sync_gate.SyncGate`.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from moe_rl.config.schema import RecipeConfig
from moe_rl.config.sync_plan import sends_adapters
from moe_rl.data.trajectory import Sample, TrajectoryBatch
from moe_rl.device import check_process_device
from moe_rl.megatron.decoding import (
    Decoder,
    KVCacheDecoder,
    RecomputeDecoder,
    StepOutput,
    kv_cache_unsupported,
)
from moe_rl.megatron.lora import trains
from moe_rl.offload import DriverMemory, Offload, resident_bytes
from moe_rl.quant.recipes import (
    QuantReport,
    check_quant_supported,
)
from moe_rl.rollout.arrival import arrival_of
from moe_rl.rollout.capabilities import engine_capabilities
from moe_rl.rollout.engine import (
    WHOLE_MODEL,
    EngineCapabilities,
    SamplingSpec,
    check_prompts,
    expand_group_ids,
)
from moe_rl.rollout.sampler import SampleOutput, sample
from moe_rl.rollout.sync_gate import SyncGate
from moe_rl.weight_sync import ipc
from moe_rl.weight_sync.buckets import Bucket
from moe_rl.weight_sync.receiver import ModelReceiver, decoded
from moe_rl.weight_sync.sender import sync_in_process

log = logging.getLogger(__name__)


class Decoding(enum.Enum):
    """How the engine computes each step's logits (see module docstring)."""

    KV_CACHE = "kv_cache"
    """Prefill once, then one token per sequence per step on Megatron's static inference context."""
    RECOMPUTE = "recompute"
    """Every step re-runs every prefix (the reference for the cached path)."""


@dataclass
class _Rollout:
    """One sequence being decoded."""

    prompt: list[int]
    group_id: int
    response: list[int]
    logp: list[float]
    kept: list[torch.Tensor]
    routing: list[torch.Tensor]
    finish: str = ""
    spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    """``(first response token, policy version)``: the weights each part of the response was sampled
    with (more than one span when a sync landed while it was decoded, `SyncGate`)."""


class MegatronEngine:
    """Rollout engine over a Megatron GPT model built from the recipe (see module docstring)."""

    name = "megatron"

    def __init__(self, config: RecipeConfig, seed: int | None = None, decoding: Decoding | None = None):
        """``decoding``: `Decoding.KV_CACHE` or `Decoding.RECOMPUTE`; None takes the KV cache where the
        model's core attention supports it (`moe_rl.megatron.decoding.kv_cache_unsupported`)."""
        from moe_rl.megatron.model import build_gpt_model
        from moe_rl.megatron.parallel import init_parallel
        from moe_rl.megatron.replay import RoutingReplay

        init_parallel(WHOLE_MODEL)
        self.device = check_process_device(config.run.device)
        self.driver = DriverMemory(self.device)  # before anything is allocated: its context
        check_quant_supported(config.quant, self.device.type == "cuda")
        self.config = config
        adapters = sends_adapters(config)  # it applies LoRA's adapters itself, as the trainer does
        self.model = build_gpt_model(
            config.model, WHOLE_MODEL, config.trainer, seed=config.run.seed, lora=config.lora if adapters else None
        )  # fmt: skip
        self.model.eval()
        self.replay = RoutingReplay(self.model) if config.model.num_experts else None
        self.decoding = self._check_decoding(decoding)
        self._receiver = ModelReceiver(self.model, trains(self.model, config.lora) if adapters else None)
        self._arrival = arrival_of(config)  # the recipe's handling of arriving weights
        self._incoming: int | None = None
        self.version = 0
        self.generator = torch.Generator(device=self.device).manual_seed(
            config.run.seed if seed is None else seed
        )
        self.last_quant_report: QuantReport | None = None
        self._asleep: Offload | None = None  # the weights' storages while asleep (`sleep`)
        self.gate = SyncGate()  # syncs and decoding take turns at token boundaries
        self._dropped = False  # asleep at level 2 and not synced since

    def _check_decoding(self, decoding: Decoding | None) -> Decoding:
        """The decoding to use: ``decoding`` if this model supports it, the KV cache if None and it can."""
        if decoding is not None and not isinstance(decoding, Decoding):
            raise ValueError(f"decoding={decoding!r}; expected one of {', '.join(str(d) for d in Decoding)}")
        if decoding is Decoding.RECOMPUTE:
            return decoding
        reason = kv_cache_unsupported(self.model)
        if reason is None:
            return Decoding.KV_CACHE
        if decoding is Decoding.KV_CACHE:
            raise ValueError(f"decoding={Decoding.KV_CACHE}: {reason}; use {Decoding.RECOMPUTE}")
        log.warning("Megatron engine: %s; decoding recomputes every prefix at each step", reason)
        return Decoding.RECOMPUTE

    @property
    def capabilities(self) -> EngineCapabilities:
        """The Megatron engine's row on the device it runs on (routing only for an MoE model)."""
        caps = engine_capabilities(self.name, self.device.type)
        return dataclasses.replace(caps, routing=self.replay is not None)

    @property
    def policy_version(self) -> int:
        return self.version

    def is_alive(self) -> bool:
        return True

    def shutdown(self) -> None:
        self.model = None

    # ------------------------------------------------------------------------ memory between phases
    def sleep(self, level: int = 1) -> dict[str, float]:
        """Give the weights' memory back while the trainer works (`moe_rl.offload`): level 1 keeps
        them in host memory, level 2 drops them (the next weight sync writes every one). The KV cache
        lives only during a generate call. Returns the most it held since it woke (its generation
        footprint: weights and KV cache) and what stays resident."""
        if self._asleep is not None:
            raise RuntimeError("the Megatron engine is asleep already")
        peak, awake = self.peak_bytes(), self.driver.readings("engine", "generate")
        self._asleep = Offload("engine")
        self._asleep.add(self.model.parameters())
        self._asleep.release(keep=level == 1)
        self._dropped = level == 2
        if self._dropped:
            self._receiver.forget()
        return {
            "peak_bytes": float(peak),
            "resident_bytes": float(self.resident_bytes()),
            **awake,
            **self.driver.readings("engine", "asleep"),
        }

    def wake_up(self) -> dict[str, float]:
        """Take the weights' memory again (level 1: with the weights; level 2: a sync must follow)."""
        if self._asleep is not None:
            self._asleep.restore()
            self._asleep = None
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)  # the generation's footprint from here
        return {"resident_bytes": float(self.resident_bytes()), **self.driver.readings("engine", "awake")}

    def peak_bytes(self) -> int:
        """The most it held since it last woke (CUDA); on CPU what it holds now."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return self.resident_bytes()

    def resident_bytes(self) -> int:
        """Memory the engine holds on its device: on CUDA what torch has allocated; on CPU the bytes of
        its parameters and buffers as they are now."""
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return resident_bytes([*self.model.parameters(), *self.model.buffers()])

    # ------------------------------------------------------------------------ weights
    def begin_weight_update(self, version: int) -> None:
        """Start a sync of policy ``version``: buckets follow (`receive_bucket`), then `finish`. An
        engine asleep takes its memory again first."""
        if int(version) < self.version:
            raise ValueError(
                f"weight version {version} is older than the engine's policy version {self.version}"
            )
        self.gate.begin()  # a generation decoding now parks at its next token first
        try:
            self.wake_up()
            self._dropped = False  # every weight arrives, or the sync fails
            self._incoming = int(version)
            self._receiver.begin()
            self._arrival.begin()
        except BaseException:
            self.gate.end()
            raise

    @torch.no_grad()
    def receive_bucket(self, bucket: Bucket) -> dict[str, float]:
        """Decode one bucket (`moe_rl.weight_sync.wire`) and load it, as the recipe takes it
        (`moe_rl.rollout.arrival.Arrival`); returns its byte count."""
        if self._incoming is None:
            raise RuntimeError("receive_bucket before begin_weight_update")
        receiver = self._receiver
        named = decoded(
            bucket, self.device, into=receiver.place, dtypes=receiver.dtypes, rejoin=receiver.rejoin
        )
        receiver.load(self._arrival.take(named))
        return {"bytes": float(bucket.nbytes)}

    @torch.no_grad()
    def finish_weight_update(self, version: int) -> dict:
        """The last bucket has landed: check every tensor arrived, then take ``version``."""
        if self._incoming != int(version):
            raise ValueError(f"finish_weight_update({version}) but the sync in progress is {self._incoming}")
        try:
            return self._finish(int(version))
        finally:
            self.gate.end()  # a parked generation goes on, with the new weights

    def _finish(self, version: int) -> dict:
        self._receiver.finish()  # every tensor arrived, whatever the recipe
        ipc.close_opened()  # the senders' buffers: they may free them until the next sync
        self._incoming = None
        self.version = int(version)
        return self._arrival.finish(self, version)

    @property
    def loaded_bytes(self) -> int:
        """Bytes the receiver loaded in the current (or last) sync."""
        return self._receiver.bytes

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> dict:
        """A whole sync in this process, through what a trainer rank's sync uses
        (`moe_rl.weight_sync.sender.sync_in_process`: the recipe applied as a sender would, buckets,
        this engine's receiver protocol)."""
        start = time.perf_counter()
        report = sync_in_process(
            self, named_tensors, self.config.quant, self.config.model.num_layers, version
        )
        stats = dict(report.received)
        if report.quant is not None:
            self.last_quant_report = report.quant
            stats.update(report.quant.summary())
        bytes_sent = self.last_quant_report.bytes_sent if self.last_quant_report else 0
        return {**stats, "seconds": time.perf_counter() - start, "bytes": bytes_sent}

    # ------------------------------------------------------------------------ generation
    def _decoder(self) -> Decoder:
        if self.decoding is Decoding.KV_CACHE:
            return KVCacheDecoder(
                self.model, self.replay, self.device, self.config.rollout.megatron_kv_cache_gib
            )
        return RecomputeDecoder(self.model, self.replay, self.device)

    @torch.no_grad()
    def _decode(self, rollouts: list[_Rollout], spec: SamplingSpec) -> None:
        """Prefill every prompt, then one token per unfinished rollout per step until all finish."""
        decoder = self._decoder()
        out = decoder.prefill([r.prompt for r in rollouts], spec.max_new_tokens)
        active = list(rollouts)
        while True:
            self._take(active, out, spec)
            alive = [i for i, r in enumerate(active) if not r.finish]
            if not alive:
                return
            if len(alive) < len(active):
                decoder.keep(alive)
                active = [active[i] for i in alive]
            if self.gate.boundary():  # a sync landed: the next tokens are the new version's
                for r in active:
                    if r.spans[-1][1] != self.version:
                        r.spans.append((len(r.response), self.version))
            out = decoder.step([r.response[-1] for r in active])

    def _take(self, rollouts: list[_Rollout], out: StepOutput, spec: SamplingSpec) -> None:
        """Sample each rollout's next token from the step's logits and record it with its log-prob,
        kept set and the routing rows the step computed (read back to the CPU once per step)."""
        sampled = self._sample(out.logits, spec)
        tokens, logprobs = sampled.tokens.tolist(), sampled.logprobs.tolist()
        kept_ids, kept_offsets = sampled.kept_ids.cpu(), sampled.kept_offsets.tolist()
        trace = None if out.topk_idx_TLK is None else out.topk_idx_TLK.cpu()
        start = 0
        for i, r in enumerate(rollouts):
            if trace is not None:
                r.routing.append(trace[start : start + out.num_new[i]])
                start += out.num_new[i]
            token = tokens[i]
            r.response.append(token)
            r.logp.append(logprobs[i])
            r.kept.append(kept_ids[kept_offsets[i] : kept_offsets[i + 1]])
            if token in spec.stop_token_ids:
                r.finish = "stop"
            elif len(r.response) >= spec.max_new_tokens:
                r.finish = "length"

    def _sample(self, logits: torch.Tensor, spec: SamplingSpec):
        if spec.greedy:  # argmax; log-probs of the unprocessed distribution, nothing filtered
            rows, vocab = logits.shape
            tokens = logits.argmax(-1)
            device = logits.device
            return SampleOutput(
                tokens=tokens,
                logprobs=logits.float().log_softmax(-1).gather(1, tokens[:, None]).squeeze(1),
                kept_ids=torch.arange(vocab, dtype=torch.int32, device=device).repeat(rows),
                kept_offsets=torch.arange(rows + 1, dtype=torch.int64, device=device) * vocab,
            )
        return sample(logits, spec.temperature, spec.top_k, spec.top_p, self.generator)

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingSpec, group_ids: Sequence[int] | None = None
    ) -> TrajectoryBatch:
        """``sampling.n`` responses per prompt, prompt by prompt (see `RolloutEngine.generate`)."""
        model = self.config.model
        checked = check_prompts(
            prompts,
            max_new_tokens=sampling.max_new_tokens,
            max_model_len=model.max_position_embeddings,
            vocab_size=model.vocab_size,
        )
        groups = expand_group_ids(group_ids, len(checked), sampling.n)
        with self.gate.decoding():  # after a sync in progress
            return self._generate(checked, sampling, groups)

    def _generate(self, checked: list, sampling: SamplingSpec, groups: list[int]) -> TrajectoryBatch:
        if self._asleep is not None or self._dropped:
            raise RuntimeError(
                "the Megatron engine is asleep" if self._asleep is not None
                else "the Megatron engine dropped its weights (sleep level 2): a weight sync must come first"
            )  # fmt: skip
        self._arrival.before_generate(self, [list(p) for p in checked])
        if sampling.seed is not None:
            self.generator.manual_seed(sampling.seed)
        rollouts = [
            _Rollout(list(p), g, [], [], [], [], spans=[(0, self.version)])
            for p, g in zip((p for p in checked for _ in range(sampling.n)), groups)
        ]
        self._decode(rollouts, sampling)
        self._arrival.after_generate([r.prompt + r.response for r in rollouts])
        return self._to_batch(rollouts)

    def _to_batch(self, rollouts: list[_Rollout]) -> TrajectoryBatch:
        """The finished rollouts as a trajectory: CPU tensors (what crosses processes)."""
        samples = []
        cpu = torch.device("cpu")
        for r in rollouts:
            kept_offsets = torch.zeros(len(r.kept) + 1, dtype=torch.int64, device=cpu)
            kept_offsets[1:] = torch.tensor([len(k) for k in r.kept], device=cpu).cumsum(0)
            samples.append(
                Sample(
                    prompt_ids=torch.tensor(r.prompt, dtype=torch.int32, device=cpu),
                    response_ids=torch.tensor(r.response, dtype=torch.int32, device=cpu),
                    rollout_logp=torch.tensor(r.logp, dtype=torch.float32, device=cpu),
                    reward=0.0,
                    group_id=r.group_id,
                    finish_reason=r.finish,
                    version_spans=list(r.spans),
                    sampling_mask_ids=torch.cat(r.kept).to(torch.int32),
                    sampling_mask_offsets=kept_offsets,
                    routed_experts=torch.cat(r.routing) if r.routing else None,
                )
            )
        return TrajectoryBatch.from_samples(
            samples,
            engine=self.name,
            quant_recipe=self.config.quant.name,
            policy_version=self.version,
            num_experts=self.config.model.num_experts or None,
        )
