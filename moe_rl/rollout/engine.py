"""The rollout engine protocol: what the driver asks of any engine (vLLM, Megatron).

An engine turns token-id prompts into a ``TrajectoryBatch`` (``moe_rl.data``) carrying the
processed rollout log-probs, the weight version of every token and, where the engine can, the
routed experts and sampling masks; it takes new weights through the weight-sync receiver protocol
(`moe_rl.weight_sync.receiver.WeightReceiver`: a sync begins with an integer policy version, its
buckets arrive, it finishes, and later tokens carry the version); it says up front what it can return
(``EngineCapabilities``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from moe_rl.config.derived import sampling_truncates
from moe_rl.weight_sync.receiver import WeightReceiver

if TYPE_CHECKING:
    from moe_rl.config.schema import RolloutConfig
    from moe_rl.data.trajectory import TrajectoryBatch


@dataclass(frozen=True)
class SamplingSpec:
    """How to sample: vLLM's semantics (temperature, then top-k, then top-p)."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_k: int = -1
    """Keep the k most likely tokens (-1: off)."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches p (1.0: off)."""
    max_new_tokens: int = 16
    """Longest response, in tokens."""
    n: int = 1
    """Responses per prompt (the GRPO group size)."""
    seed: int | None = None
    """Base seed: prompt i is sampled with seed + i (reproducible batches); None: the engine's
    own random stream."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a response (kept in it, finish reason ``stop``)."""

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"SamplingSpec.temperature={self.temperature} must be >= 0 (0: greedy)")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"SamplingSpec.top_k={self.top_k} must be -1 (off) or >= 1")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingSpec.top_p={self.top_p} must be in (0, 1]")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingSpec.max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.n < 1:
            raise ValueError(f"SamplingSpec.n={self.n} must be >= 1")
        if self.seed is not None and self.seed < 0:
            raise ValueError(f"SamplingSpec.seed={self.seed} must be >= 0 or None")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"SamplingSpec.stop_token_ids={self.stop_token_ids} must be token ids >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def filters(self) -> bool:
        """Whether top-k or top-p removes tokens (a sampling mask then carries information)."""
        return sampling_truncates(self.top_k, self.top_p)

    @classmethod
    def from_rollout(cls, rollout: RolloutConfig, seed: int | None = None) -> SamplingSpec:
        """The spec of a recipe's ``rollout`` section (n = ``group_size``)."""
        return cls(
            temperature=rollout.temperature,
            top_k=rollout.top_k,
            top_p=rollout.top_p,
            max_new_tokens=rollout.max_new_tokens,
            n=rollout.group_size,
            seed=seed,
        )


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine can return and run, on the device it runs on."""

    engine: str
    """``vllm`` or ``megatron``."""
    device: str
    """``cpu`` or ``cuda``."""
    routing: bool
    """Returns the routed experts of every token (R3)."""
    sampling_mask: bool
    """Returns the kept token set of every sampled token (KSM)."""
    quant_methods: tuple[str, ...]
    """``quant.method`` values it can roll out with (``none`` always)."""
    fake_quant: bool
    """Quantization is simulated (quantize-dequantize) rather than run in low-precision kernels."""
    weight_transfer: str
    """How weights reach it: ``reload`` (vLLM in-place reload through a worker extension),
    ``ipc`` / ``nccl`` (vLLM's weight-transfer API), ``shared`` (the trainer's own model)."""
    sleeps: bool = True
    """Gives its memory back while the trainer works, and takes it again (``sleep`` / ``wake_up``)."""

    @property
    def fp8(self) -> bool:
        return "fp8" in self.quant_methods

    @property
    def nvfp4(self) -> bool:
        return "nvfp4" in self.quant_methods


@runtime_checkable
class RolloutEngine(WeightReceiver, Protocol):
    """A rollout engine. Engines are created ready to generate at ``policy_version``, and receive
    weights as every `WeightReceiver` does."""

    @property
    def capabilities(self) -> EngineCapabilities: ...

    @property
    def policy_version(self) -> int:
        """Version of the weights the engine holds now."""
        ...

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingSpec,
        group_ids: Sequence[int] | None = None,
    ) -> TrajectoryBatch:
        """``sampling.n`` responses per prompt, samples ordered prompt by prompt.

        ``group_ids`` (one per prompt, default ``0..len(prompts)-1``) is copied to each of the
        prompt's responses. Rewards are 0; the driver attaches them.
        """
        ...

    def shutdown(self) -> None:
        """Release the engine's processes and memory (idempotent)."""
        ...

    def is_alive(self) -> bool: ...


def check_prompts(
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    max_model_len: int,
    vocab_size: int | None = None,
) -> list[list[int]]:
    """Prompts as lists of ints; ``ValueError`` naming the prompt for an empty one, an id outside
    the vocabulary, or a prompt too long for ``max_new_tokens`` more tokens."""
    if len(prompts) == 0:
        raise ValueError("prompts: empty batch; expected at least one prompt")
    out: list[list[int]] = []
    for i, prompt in enumerate(prompts):
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError(f"prompts[{i}]: empty prompt; expected at least one token id")
        low, high = min(ids), max(ids)
        if low < 0 or (vocab_size is not None and high >= vocab_size):
            bad = low if low < 0 else high
            raise ValueError(f"prompts[{i}]: token id {bad} outside the vocabulary [0, {vocab_size})")
        if len(ids) + max_new_tokens > max_model_len:
            raise ValueError(
                f"prompts[{i}]: {len(ids)} tokens + max_new_tokens={max_new_tokens} exceeds the "
                f"engine's max_model_len={max_model_len}"
            )
        out.append(ids)
    return out


def expand_group_ids(group_ids: Sequence[int] | None, num_prompts: int, n: int) -> list[int]:
    """Per-response group ids from per-prompt ones (default: the prompt index)."""
    if group_ids is None:
        group_ids = range(num_prompts)
    elif len(group_ids) != num_prompts:
        raise ValueError(
            f"group_ids: {len(group_ids)} given for {num_prompts} prompts; expected one per prompt"
        )
    return [int(g) for g in group_ids for _ in range(n)]
