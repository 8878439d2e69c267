"""`moe-rl plan`: what a recipe costs and whether Megatron-core and vLLM will accept its layout,
computed from the recipe alone (no torch, no GPU), rendered.

What it costs is the planner's (`moe_rl.planner`): parameter counts (`moe_rl.planner.flops.
count_params`, the one home of the projection sizes and what they add up to), memory per trainer,
engine and colocated GPU (`moe_rl.planner.memory`, where its model is told), a step's time by phase
(`moe_rl.planner.step_time`). Whether it runs is every component's rules, through the preflight.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from moe_rl.config import ConfigError, RecipeConfig, load_recipe
from moe_rl.config.derived import BF16, GIB, PlacementMode, longest_sequence, placement_mode
from moe_rl.config.schema import ModelConfig
from moe_rl.config.sync_plan import SyncPlan
from moe_rl.orchestration.preflight import preflight
from moe_rl.planner.estimate import estimate
from moe_rl.planner.flops import ParamCounts, count_params
from moe_rl.planner.memory import (
    RolloutMemory,
    TrainerMemory,
    colocated_memory,
    layout,
    memory_checks,
    rollout_weight_bytes,
    routing_trace_bytes_per_token,
    trainer_memory,
)
from moe_rl.planner.step_time import StepTime, adapter_sync_bytes
from moe_rl.rules import Rule


def constraint_checks(config: RecipeConfig, paths: bool = True) -> list[Rule]:
    """The rules of every component that runs the recipe (`moe_rl.orchestration.preflight`),
    against the machine the recipe describes: the recipe's own consistency and the engine's
    capabilities as one row each (with the engine's warnings), the rewards', the trainer's and
    placement's rules one by one with their numbers."""
    sections = {section.component: section for section in preflight(config, paths=paths).sections}
    recipe = sections["recipe"]
    if recipe.broken is not None:
        return [Rule("recipe", False, recipe.error() or "")]
    rows = [Rule("recipe", True, "consistent (moe_rl.config.validate)")]
    rows += [*sections["inputs"].rules, *sections["reward"].rules, *sections["trainer"].rules]
    engine = sections["engine"]
    rows.append(
        Rule(
            "engine capabilities",
            engine.broken is None,
            engine.broken.detail if engine.broken else "the engine can run it",
        )
    )
    rows += engine.warnings
    return rows + list(sections["placement"].rules)


@dataclass(frozen=True)
class Plan:
    """Everything `moe-rl plan` reports about one recipe."""

    config: RecipeConfig
    counts: ParamCounts
    trainer: TrainerMemory
    rollout: RolloutMemory
    checks: list[Rule]
    sync: SyncPlan | None = None
    """How every sync moves the weights (None: the recipe's sync route is refused, see `checks`)."""
    step: StepTime | None = None
    """The step's time by phase (`moe_rl.planner.step_time`); None where it cannot be told."""
    step_unknown: str = ""
    """Why there is no step time: a phase that cannot run, a chip `auto` cannot tell (one line)."""
    teacher: ModelConfig | None = None
    """The distillation teacher's architecture, where it could be read (`teacher_model`)."""

    @property
    def failures(self) -> list[Rule]:
        return [c for c in self.checks if c.broken]

    @property
    def ok(self) -> bool:
        return not self.failures


def teacher_model(config: RecipeConfig, paths: bool) -> ModelConfig | None:
    """The distillation teacher's architecture where it can be read: from ``teacher.path`` (with
    ``paths``) or ``teacher.model_recipe``; None without a teacher or where neither can be read
    (the preflight's rows say why)."""
    from moe_rl.errors import UserError
    from moe_rl.trainer.teacher import teacher_source

    t = config.teacher
    if t.path is None:
        return None
    try:
        if paths:
            return teacher_source(config).model
        return load_recipe(t.model_recipe).model if t.model_recipe else None
    except (UserError, ConfigError, OSError):
        return None


def _teacher_rows(plan: Plan) -> list[tuple[str, str]]:
    t = plan.config.teacher
    if t.path is None:
        return []
    if plan.teacher is None:
        return [("  teacher weights", "not known (its architecture is not read here)")]
    where = "host memory between passes (teacher.offload)" if t.offload else _gib(plan.trainer.teacher)
    return [("  teacher weights", f"{where}; {_billions(count_params(plan.teacher).total)} parameters")]


def make_plan(config: RecipeConfig, paths: bool = True) -> Plan:
    """The recipe's cost (`moe_rl.planner.estimate`) and every component's rules on it; its memory
    held against ``cluster.gpu_memory_gib`` on GPUs."""
    teacher = teacher_model(config, paths)
    cost = estimate(config, teacher)
    checks = constraint_checks(config, paths)
    if config.cluster.gpus_per_node > 0:
        checks += memory_checks(config, cost.trainer, cost.rollout)
    return Plan(config, cost.counts, cost.trainer, cost.rollout, checks, cost.sync, cost.step, cost.step_unknown,
                teacher)  # fmt: skip


@dataclass(frozen=True)
class FewerNodes:
    """The fewest trainer nodes a LoRA run needs (`lora_layout`)."""

    config: RecipeConfig
    """The recipe moved onto them."""
    memory: TrainerMemory


def lora_layout(config: RecipeConfig, counts: ParamCounts) -> FewerNodes | None:
    """The fewest trainer nodes that hold a LoRA run's trainer: ``cluster.trainer_nodes`` halved
    while the halved layout keeps TP, PP and CP, its expert parallelism still divides the experts
    and the trainer world, the trainer's rules hold (`moe_rl.trainer.rules`; those the recipe breaks
    already are its own, shown in the checks) and the busiest GPU's
    states and activation estimate fit `cluster.gpu_memory_gib`. Without the base's gradients and
    Adam state, the frozen weights are what must fit. None: not a LoRA run on GPUs with trainer
    nodes of its own, or no fewer nodes hold it."""
    from moe_rl.config import ConfigError
    from moe_rl.trainer.rules import trainer_rules

    c, p = config.cluster, config.parallel
    if config.lora.rank == 0 or not c.gpus_per_node or not c.rollout_nodes:
        return None
    cap, found, nodes = c.gpu_memory_gib * GIB, None, c.trainer_nodes
    already = {rule.name for rule in trainer_rules(config) if rule.broken}  # the recipe's own, shown above
    while nodes % 2 == 0:
        nodes //= 2
        world = nodes * c.gpus_per_node
        dense = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
        ep = p.expert_model_parallel_size
        while ep > 1 and (world % (ep * p.expert_tensor_parallel_size * p.pipeline_model_parallel_size)):
            ep //= 2
        if world % dense or (config.model.num_experts and config.model.num_experts % ep):
            break
        moved = dataclasses.replace(
            config,
            cluster=dataclasses.replace(c, nodes=nodes + c.rollout_nodes, trainer_nodes=nodes),
            parallel=dataclasses.replace(p, trainer_world_size=world, expert_model_parallel_size=ep),
        )
        try:
            broken = [rule for rule in trainer_rules(moved) if rule.broken and rule.name not in already]
        except (ConfigError, ValueError):
            break
        memory = trainer_memory(moved, counts)
        if broken or memory.total > cap:
            break
        found = FewerNodes(moved, memory)
    return found


def _lora_layout_rows(plan: Plan) -> list[tuple[str, str]]:
    fewer = lora_layout(plan.config, plan.counts)
    if fewer is None:
        return []
    c, lay = fewer.config.cluster, layout(fewer.config)
    cap = plan.config.cluster.gpu_memory_gib
    overrides = (
        f"cluster.nodes={c.nodes} cluster.trainer_nodes={c.trainer_nodes} parallel.trainer_world_size={lay.world} "
        f"parallel.expert_model_parallel_size={lay.ep}"
    )
    return [
        (
            "LoRA: fewest trainer nodes",
            f"{c.trainer_nodes} of {plan.config.cluster.trainer_nodes}: {_gib(fewer.memory.total)} of {cap:g} GiB "
            f"per GPU at TP {lay.tp} PP {lay.pp} EP {lay.ep} DP {lay.dp} ({overrides})",
        )
    ]


def node_overrides(config: RecipeConfig, nodes: int | None, gpus_per_node: int | None) -> list[str]:
    """Overrides that move a recipe onto `nodes` nodes of `gpus_per_node` GPUs: the rollout keeps
    its nodes, the trainer takes the rest, and on GPUs the trainer world size follows."""
    c = config.cluster
    gpus = c.gpus_per_node if gpus_per_node is None else gpus_per_node
    trainer_nodes = c.trainer_nodes if nodes is None else nodes - c.rollout_nodes
    if trainer_nodes < 1:
        raise ConfigError(f"--nodes {nodes} leaves no trainer node (cluster.rollout_nodes={c.rollout_nodes})")
    if gpus < 0:
        raise ConfigError(f"--gpus-per-node {gpus} must be >= 0")
    out = [] if gpus_per_node is None else [f"cluster.gpus_per_node={gpus}"]
    if nodes is not None:
        out += [f"cluster.nodes={nodes}", f"cluster.trainer_nodes={trainer_nodes}"]
    if gpus and (nodes is not None or gpus_per_node is not None):
        out.append(f"parallel.trainer_world_size={trainer_nodes * gpus}")
    return out


def _billions(n: float) -> str:
    return f"{n / 1e9:,.2f} B" if n >= 1e8 else f"{n / 1e6:,.3f} M"


def _gib(n: float) -> str:
    return f"{n / GIB:,.2f} GiB" if n >= GIB / 100 else f"{n / 1024**2:,.2f} MiB"


def _params_table(plan: Plan):
    from rich.table import Table

    table = Table(title=f"Parameters ({plan.config.model.family}, {plan.config.model.attention})")
    table.add_column("component")
    table.add_column("total", justify="right")
    table.add_column("active / token", justify="right")
    for name, total, active in plan.counts.components():
        table.add_row(name, _billions(total), _billions(active))
    table.add_row(
        "[bold]all", f"[bold]{_billions(plan.counts.total)}", f"[bold]{_billions(plan.counts.active)}"
    )
    table.add_row("without input embedding", "", _billions(plan.counts.active_without_embedding))
    return table


def _layout_rows(plan: Plan) -> list[tuple[str, str]]:
    c, r, lay = plan.config.cluster, plan.config.rollout, layout(plan.config)
    vpp = f" VPP {lay.vpp}" if lay.vpp else ""
    return [
        ("trainer", f"{c.trainer_nodes} node(s) x {c.gpus_per_node} GPU, world {lay.world}"),
        (
            "parallel",
            f"TP {lay.tp} PP {lay.pp}{vpp} CP {lay.cp} EP {lay.ep} ETP {lay.etp} "
            f"DP {lay.dp} expert-DP {lay.expert_dp}",
        ),
        (
            "rollout",
            f"{r.engine}: {r.num_engines} engine(s) x TP {r.tensor_parallel_size} on "
            f"{c.rollout_nodes or 'the trainer'} node(s), weights {plan.config.quant.name}",
        ),
    ]


def _memory_rows(plan: Plan) -> list[tuple[str, str]]:
    t, r, m = plan.trainer, plan.rollout, plan.config.model
    seqs = r.kv_tokens // longest_sequence(plan.config)
    return [
        ("trainer params / GPU", _billions(t.params)),
        ("  weights", _gib(t.weights)),
        *([(f"  LoRA adapters (rank {plan.config.lora.rank})", _billions(t.adapters))] if t.adapters else []),
        ("  gradients (fp32)" + (", adapters only" if t.adapters else ""), _gib(t.grads)),
        ("  optimizer (Adam)" + (", adapters only" if t.adapters else ""), _gib(t.optimizer)),
        *([("  critic (weights, grads, Adam)", _gib(t.critic))] if t.critic else []),
        *_teacher_rows(plan),
        ("  activations (estimate)", _gib(t.activations)),
        ("  total", f"{_gib(t.total)} of {plan.config.cluster.gpu_memory_gib:g} GiB"),
        *_lora_layout_rows(plan),
        ("rollout weights / GPU", _gib(r.weights_per_gpu)),
        ("  KV cache budget / GPU", _gib(r.kv_per_gpu)),
        ("  KV bytes / token / GPU", f"{r.kv_per_token:,.0f} B ({m.attention})"),
        ("  KV tokens / engine", f"{r.kv_tokens:,} ({seqs:,} full-length sequences)"),
        *_colocated_rows(plan),
    ]


def _colocated_rows(plan: Plan) -> list[tuple[str, str]]:
    """Colocated on GPUs: what one GPU holds in each phase."""
    cfg = plan.config
    if placement_mode(cfg) != PlacementMode.COLOCATED or cfg.cluster.gpus_per_node == 0:
        return []
    c = colocated_memory(cfg, plan.trainer, plan.rollout)
    cap = f"{cfg.cluster.gpu_memory_gib:g} GiB"
    released = "memory released between phases" if c.releases else "nothing released between phases"
    return [
        (f"colocated GPU ({released})", f"peak {_gib(c.peak)} of {cap}"),
        (
            "  generation: trainer + engine",
            f"{_gib(c.trainer_generating)} + {_gib(c.engine_generating)} = {_gib(c.generate)}",
        ),
        (
            "  training: trainer + engine",
            f"{_gib(c.trainer_training)} + {_gib(c.engine_training)} = {_gib(c.train)}",
        ),
    ]


def _traffic_rows(plan: Plan) -> list[tuple[str, str]]:
    cfg, counts = plan.config, plan.counts
    trace = routing_trace_bytes_per_token(cfg.model)
    tokens = cfg.rollout.batch_size * longest_sequence(cfg)
    width = "uint8" if cfg.model.num_experts <= 256 else "uint16"
    synced = rollout_weight_bytes(cfg, counts)
    return [
        (
            "routing trace / token",
            f"{trace:,} B ({width}, {counts.num_moe_layers} layers x top-{counts.topk})",
        ),
        ("routing traces / step", f"{_gib(trace * tokens)} (<= {tokens:,} tokens)"),
        ("weight sync / step, bf16", _gib(counts.total * BF16)),
        (
            f"weight sync / step, {cfg.quant.name}",
            f"{_gib(synced)} per engine, {_gib(synced * cfg.rollout.num_engines)} in all",
        ),
        *_adapter_sync_rows(cfg),
    ]


def _adapter_sync_rows(cfg: RecipeConfig) -> list[tuple[str, str]]:
    """What a LoRA run's adapter-only sync carries (``lora.sync=adapters``): what trains, in the
    trainer's precision; the base goes to an engine once."""
    if cfg.lora.rank == 0:
        return []
    how = "(lora.sync=adapters: Megatron engines)"
    return [("weight sync / step, LoRA adapters only", f"{_gib(adapter_sync_bytes(cfg))} per engine {how}")]


def _sync_rows(plan: Plan) -> list[tuple[str, str]]:
    """The weight-sync plan (`moe_rl.config.sync_plan`): route, why, what travels, who sends."""
    from moe_rl.config.sync_plan import ROUTE_WORDS

    sync = plan.sync
    unit = "vLLM's packed buffers" if sync.vllm_transfer else "buckets"
    rows = [
        ("route", f"{sync.route}: {ROUTE_WORDS[sync.route]}"),
        ("chosen by", sync.chosen_by),
        ("what travels", f"{sync.wire}, in {unit} of {_gib(sync.bucket_bytes)}"),
        ("senders", sync.senders),
    ]
    if plan.config.logging.diagnose_every:
        rows.append(("probe's reference model", f"{sync.route_for(reference=True)}, full precision"))
    return rows


def _rows_table(title: str, rows: list[tuple[str, str]]):
    from rich.table import Table

    table = Table(title=title, show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    for row in rows:
        table.add_row(*row)
    return table


def _checks_table(plan: Plan):
    from rich.table import Table

    table = Table(title="Constraints")
    for name in ("check", "", "detail"):
        table.add_column(name)
    for c in plan.checks:
        mark = "[green]ok" if c.ok else ("[red]FAIL" if c.fatal else "[yellow]warn")
        table.add_row(c.name, mark, shown_detail(c))
    return table


def _seconds(s: float) -> str:
    if s >= 10:
        return f"{s:,.1f} s"
    return f"{s:.2f} s" if s >= 1 else (f"{s * 1e3:.1f} ms" if s >= 1e-3 else f"{s * 1e3:.3f} ms")


def _step_table(plan: Plan):
    """The step's phases: seconds, share of the step, the bound, the numbers behind it."""
    from rich.table import Table

    t = plan.step
    e = t.efficiency
    title = (
        f"Step time ({t.machine.name}; efficiency: generation {e.generation:.3g}, training MFU "
        f"{e.train_mfu:.3g}, sync {e.sync:.3g})"
    )
    table = Table(title=title)
    for name, justify in (
        ("phase", "left"),
        ("time", "right"),
        ("share", "right"),
        ("bound", "left"),
        ("what", "left"),
    ):
        table.add_column(name, justify=justify)
    for p in t.phases:
        share = "beside" if p.overlapped else f"{p.seconds / t.seconds:.0%}"
        table.add_row(p.name, _seconds(p.seconds), share, str(p.bound), p.detail)
    table.add_row("[bold]step", f"[bold]{_seconds(t.seconds)}", "", "", t.how)
    return table


def shown_detail(rule: Rule) -> str:
    """What a row says: a rule that holds shows its values, one that does not (refused, or a
    warning) its values and the advice that helps (`Rule.advice`)."""
    return rule.values if rule.ok else rule.detail


def render(plan: Plan, console) -> None:
    """Print the plan's tables and the PASS / FAIL verdict."""
    console.print(_params_table(plan))
    console.print(_rows_table("Layout", _layout_rows(plan)))
    if plan.config.cluster.gpus_per_node > 0:
        console.print(_rows_table("Memory per GPU", _memory_rows(plan)))
    console.print(_rows_table("Per RL step", _traffic_rows(plan)))
    if plan.sync is not None:
        console.print(_rows_table("Weight sync", _sync_rows(plan)))
    if plan.step is not None:
        console.print(_step_table(plan))
    else:
        console.print(f"[bold]Step time:[/bold] {plan.step_unknown}")
    console.print(_checks_table(plan))
    if plan.ok:
        console.print("[bold green]PASS")
    else:
        console.print("[bold red]FAIL: " + "; ".join(f"{c.name} ({c.detail})" for c in plan.failures))


def sweep_overrides(config: RecipeConfig, key: str, value: str) -> list[str]:
    """Overrides that set ``key`` to ``value`` and what follows from it: the rollout's nodes carry
    as many engines of the recipe's TP as they hold (on the trainer's GPUs when 0) and the trainer's
    nodes its world size, the node count both; any other key is set alone."""
    c, r = config.cluster, config.rollout
    out = [f"{key}={value}"]
    if key not in ("cluster.rollout_nodes", "cluster.trainer_nodes") or c.gpus_per_node == 0:
        return out
    try:
        n = int(value)
    except ValueError:
        return out
    if key == "cluster.rollout_nodes":
        gpus = (n or c.trainer_nodes) * c.gpus_per_node
        return [
            *out,
            f"cluster.nodes={c.trainer_nodes + n}",
            f"rollout.num_engines={max(1, gpus // r.tensor_parallel_size)}",
        ]
    return [
        *out,
        f"cluster.nodes={n + c.rollout_nodes}",
        f"parallel.trainer_world_size={n * c.gpus_per_node}",
    ]


SWEEP_PHASES = (("generation", ("prefill", "decode")), ("π_old + ref", ("π_old", "reference")),
                ("training", ("training",)), ("sync", ("weight sync",)), ("offload", ("offload",)))  # fmt: skip


def sweep_row(plan: Plan) -> list[str]:
    """One row of `--sweep`: each phase group's seconds, the step, its slowest phase, the verdict."""
    verdict = "PASS" if plan.ok else f"FAIL: {plan.failures[0].name}"
    t = plan.step
    if t is None:
        return ["–"] * (len(SWEEP_PHASES) + 2) + [plan.step_unknown, verdict]
    cells = [
        _seconds(sum(p.seconds for p in t.phases if p.name in names))
        if any(p.name in names for p in t.phases)
        else "–"
        for _, names in SWEEP_PHASES
    ]
    return [*cells, _seconds(t.seconds), t.slowest.name, verdict]


def sweep_command(
    recipe: str, overrides: Sequence[str], key: str, values: Sequence[str], paths: bool = True
) -> int:
    """`moe-rl plan --sweep KEY=V1,V2,...`: one row per value (its phases, step and verdict); exit
    code 1 when a value's recipe fails a constraint."""
    from rich.console import Console
    from rich.table import Table

    base = load_recipe(recipe, overrides)
    plans = [
        (v, make_plan(load_recipe(recipe, [*overrides, *sweep_overrides(base, key, v)]), paths))
        for v in values
    ]
    table = Table(title=f"Step time by {key}")
    for name in (key, *(n for n, _ in SWEEP_PHASES), "step", "slowest", "plan"):
        table.add_column(name, justify="left" if name in (key, "slowest", "plan") else "right")
    for value, plan in plans:
        table.add_row(value, *sweep_row(plan))
    Console(highlight=False, width=160).print(table)
    return 0 if all(plan.ok for _, plan in plans) else 1


def plan_command(
    recipe: str,
    overrides: Sequence[str] = (),
    nodes: int | None = None,
    paths: bool = True,
    sweep: tuple[str, list[str]] | None = None,
) -> int:
    """`moe-rl plan`: print the plan of `recipe` (with ``sweep``, a row per value of its key);
    exit code 1 when a constraint fails."""
    from rich.console import Console

    config = load_recipe(recipe, overrides)
    if nodes is not None:
        overrides = [*overrides, *node_overrides(config, nodes, None)]
        config = load_recipe(recipe, overrides)
    if sweep is not None:
        return sweep_command(recipe, overrides, sweep[0], sweep[1], paths)
    plan = make_plan(config, paths)
    render(plan, Console(highlight=False, width=140))
    return 0 if plan.ok else 1
