"""Placement: which node hosts which trainer rank and which rollout engine, and what each gets.

From the recipe (``parallel.trainer_world_size``, ``rollout.num_engines``,
``rollout.tensor_parallel_size``, ``cluster.*``) and the device ``run.device`` resolves to:

* a CPU run: every rank and engine is a process on the machine(s), no GPU;
* a CUDA run on a cluster (``cluster.gpus_per_node > 0``), disaggregated (`config.derived.
  PlacementMode`): one GPU per trainer rank on the trainer nodes, ``rollout.tensor_parallel_size``
  GPUs per engine on the rollout nodes;
* a CUDA run on a cluster, colocated (``cluster.rollout_nodes = 0``): each GPU of the trainer nodes
  hosts one trainer rank and its share of one engine, whose tensor parallelism spans GPUs of one
  node. Each GPU is one Ray bundle that reserves it whole; the rank and the engine declare a share
  of it (`COLOCATED_TRAINER_GPU`, `COLOCATED_ENGINE_GPU`), and an engine sees the GPUs of its span
  (`moe_rl.orchestration.seats`);
* a CUDA run on one machine (``gpus_per_node = 0``): trainer and engine share its GPU (one rank,
  one engine).

Ray places the trainer ranks as one placement group (one bundle per rank, packed; colocated on GPUs,
one group per node of one bundle per GPU) and each disaggregated engine as a placement group of its
own (a colocated one sits in the bundle of its first GPU). Under Slurm each node is started with a custom resource naming its
role (`TRAINER_NODE` / `ROLLOUT_NODE`, see ``slurm/ray_job.sbatch``); bundles ask for a sliver of
it, which pins them to nodes of that role.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_rl.config.derived import PlacementMode, placement_mode
from moe_rl.config.modes import ReleaseMemory, RunMode
from moe_rl.config.schema import RecipeConfig
from moe_rl.config.sync_plan import sync_rules
from moe_rl.device import COPY_TUNABLES, DeviceKind, Machine, RunDevice, resolve_device
from moe_rl.rules import Rule

TRAINER_NODE = "moe_rl_trainer_node"
ROLLOUT_NODE = "moe_rl_rollout_node"
NODE_SHARE = 0.001
"""How much of a node-role resource one bundle takes (any number of bundles fit on a node)."""
PLACEMENT_TIMEOUT_S = 600.0
"""How long Ray may take to find room for a placement group."""
SHARED_GPU = 0.5
"""GPU share of the trainer and of the engine when both run on one machine's GPU."""
COLOCATED_TRAINER_GPU = 0.5
COLOCATED_ENGINE_GPU = 0.5
"""The shares of its GPU a colocated trainer rank and engine declare to Ray (the GPU's bundle reserves
all of it; an engine of tensor parallelism t also uses the other t - 1 GPUs of its span)."""

PROCESS_ENV = {"RAY_free_objects_period_milliseconds": "50", "GLIBC_TUNABLES": COPY_TUNABLES}
"""The environment every process of a run starts with (a local run sets what the user has not set
before it starts Ray; the sbatch script exports it on every node):

* Ray frees released objects in batches (every second by default); weight-sync buckets are released
  as soon as every engine has loaded them, so the store holds about two, not a whole model's worth;
* large weight copies write around the caches (`moe_rl.device.NON_TEMPORAL_COPY_BYTES`)."""


@dataclass(frozen=True)
class Placement:
    """Resources of every trainer rank and engine replica."""

    device: DeviceKind
    trainer_ranks: int
    trainer_gpus: float
    """GPUs per trainer rank."""
    engines: int
    engine_gpus: float
    """GPUs per engine replica."""
    node_roles: bool
    """Pin bundles to nodes by role (a multi-node Ray cluster started by the sbatch script)."""
    mode: PlacementMode
    gpus_per_node: int = 0
    engine_tp: int = 1
    """GPUs of one engine (``rollout.tensor_parallel_size``)."""

    @property
    def shares_gpus(self) -> bool:
        """Colocated on a GPU cluster: each GPU hosts a trainer rank and a share of an engine."""
        return self.mode == PlacementMode.COLOCATED and self.device == "cuda" and self.gpus_per_node > 0

    def trainer_bundle(self) -> dict[str, float]:
        bundle = {"CPU": 1.0, "GPU": 1.0 if self.shares_gpus else self.trainer_gpus}
        if self.node_roles:
            bundle[TRAINER_NODE] = NODE_SHARE
        return {k: v for k, v in bundle.items() if v}

    def engine_bundle(self, colocated: bool) -> dict[str, float]:
        bundle = {"CPU": 1.0, "GPU": self.engine_gpus}
        if self.node_roles:
            bundle[TRAINER_NODE if colocated else ROLLOUT_NODE] = NODE_SHARE
        return {k: v for k, v in bundle.items() if v}

    def threads(self, role: str, cpus: int) -> int:
        """torch threads of a process: the machine's cores shared by the processes that run at
        the same time (all trainer ranks together, all engines together)."""
        share = self.trainer_ranks if role == "trainer" else self.engines
        return max(1, cpus // max(1, share))


def plan_placement(config: RecipeConfig, machine: Machine, node_roles: bool = False) -> Placement:
    """The `Placement` of a recipe on ``machine`` (see the module docstring)."""
    device = resolve_device(config.run.device, machine)
    world, engines = config.parallel.trainer_world_size, config.rollout.num_engines
    mode, per_node, tp = (
        placement_mode(config),
        config.cluster.gpus_per_node,
        config.rollout.tensor_parallel_size,
    )
    if device == "cpu":
        return Placement(device, world, 0.0, engines, 0.0, node_roles, mode, per_node, tp)
    if per_node == 0:
        return Placement(device, world, SHARED_GPU, engines, SHARED_GPU, node_roles, mode, 0, tp)
    if mode == PlacementMode.COLOCATED:
        return Placement(
            device,
            world,
            COLOCATED_TRAINER_GPU,
            engines,
            COLOCATED_ENGINE_GPU,
            node_roles,
            mode,
            per_node,
            tp,
        )
    return Placement(device, world, 1.0, engines, float(tp), node_roles, mode, per_node, tp)


def placement_rules(config: RecipeConfig, machine: Machine | None = None) -> list[Rule]:
    """Ranks and engines against GPUs and nodes, and the weight-sync route they allow
    (`moe_rl.config.sync_plan.sync_rules`). ``machine``: where it will run (None: the cluster the
    recipe describes)."""
    on_cuda = machine.cuda if machine is not None else config.cluster.gpus_per_node > 0
    device = "cuda" if on_cuda and config.run.device != RunDevice.CPU else "cpu"
    return _layout_rules(config, machine) + sync_rules(config, device)


def _layout_rules(config: RecipeConfig, machine: Machine | None) -> list[Rule]:
    c, r, p = config.cluster, config.rollout, config.parallel
    nodes = c.trainer_nodes + c.rollout_nodes
    release = c.release_memory
    rules = [
        Rule("nodes = trainer + rollout", c.nodes == nodes,
             f"cluster.nodes={c.nodes}, cluster.trainer_nodes + cluster.rollout_nodes = {nodes}"),
        Rule("memory released where shared", release != ReleaseMemory.ON or not c.rollout_nodes,
             f"cluster.release_memory={release}, cluster.rollout_nodes={c.rollout_nodes}",
             advice="only engines on the trainer's nodes (cluster.rollout_nodes=0) share its memory; engines on "
             "nodes of their own have none to give back (cluster.release_memory=off)"),
        Rule("memory released in a synchronous run", release != ReleaseMemory.ON or config.run.mode == RunMode.SYNC,
             f"cluster.release_memory={release} with run.mode={config.run.mode}",
             advice="memory is given back only in a synchronous run (asynchronous, the next batch generates "
             "while the trainer trains); use run.mode=sync or cluster.release_memory=off"),
        Rule("engine sleep level", c.engine_sleep_level in (1, 2),
             f"cluster.engine_sleep_level={c.engine_sleep_level}",
             advice="1 (a sleeping engine keeps its weights in host memory) or 2 (it drops them; the next "
             "weight sync restores them)"),
    ]  # fmt: skip
    if c.gpus_per_node == 0:
        on_gpu = machine is not None and resolve_device(config.run.device, machine) == "cuda"
        alone = p.trainer_world_size == 1 and r.num_engines == 1
        rules.append(Rule("GPUs per node given", not on_gpu or alone,
                          f"cluster.gpus_per_node=0 with run.device={config.run.device} on GPUs",
                          advice="without a GPU count the run gets one GPU, for one trainer rank and one engine, but "
                          f"the recipe has parallel.trainer_world_size={p.trainer_world_size} and "
                          f"rollout.num_engines={r.num_engines}; set cluster.gpus_per_node to each node's GPUs (0 is "
                          "for CPU nodes)"))  # fmt: skip
        return rules
    trainer_gpus = c.trainer_nodes * c.gpus_per_node
    tp, node = r.tensor_parallel_size, c.gpus_per_node
    engine_gpus = (c.rollout_nodes or c.trainer_nodes) * node
    where = "cluster.rollout_nodes" if c.rollout_nodes else "the trainer nodes (colocated)"
    wanted = r.num_engines * tp
    if placement_mode(config) == PlacementMode.COLOCATED:
        rules += [
            Rule("colocated engine within a node", node % tp == 0,
                 f"rollout.tensor_parallel_size={tp}, cluster.gpus_per_node={node}: a colocated engine spans "
                 "GPUs of one node (its tensor parallelism must divide the node's GPUs)"),
            Rule("colocated GPUs all generate", wanted >= trainer_gpus,
                 f"rollout.num_engines x tensor_parallel_size = {r.num_engines} x {tp} = {wanted} of the "
                 f"{trainer_gpus} trainer GPUs: the others sit idle while the engines generate", fatal=False),
        ]  # fmt: skip
    return [
        *rules,
        Rule("trainer GPUs = world", p.trainer_world_size == trainer_gpus,
             f"parallel.trainer_world_size={p.trainer_world_size}, cluster.trainer_nodes x gpus_per_node = "
             f"{c.trainer_nodes} x {node} = {trainer_gpus} GPUs (one rank per GPU)"),
        Rule("engine within nodes", node % tp == 0 or tp % node == 0,
             f"rollout.tensor_parallel_size={tp}, cluster.gpus_per_node={node}: an engine takes a share of a node "
             "or whole nodes"),
        Rule("engine GPUs", wanted <= engine_gpus,
             f"rollout.num_engines x tensor_parallel_size = {r.num_engines} x {tp} = {wanted} GPUs, "
             f"{engine_gpus} on {where}"),
    ]  # fmt: skip


def placement_lines(config: RecipeConfig) -> list[str]:
    """Human-readable placement for ``submit --dry-run``: ranks and engines per node, GPUs each."""
    c, r, p = config.cluster, config.rollout, config.parallel
    lines = []
    per_node = -(-p.trainer_world_size // max(1, c.trainer_nodes))
    gpu = c.gpus_per_node > 0
    each = "1 GPU each" if gpu else "1 process each"
    lines.append(
        f"trainer: {p.trainer_world_size} ranks on {c.trainer_nodes} node(s) "
        f"(nodes 0..{c.trainer_nodes - 1}), {per_node} per node, {each}"
    )
    engine_nodes = c.rollout_nodes or c.trainer_nodes
    first = c.trainer_nodes if c.rollout_nodes else 0
    where = f"nodes {first}..{first + engine_nodes - 1}" + (
        "" if c.rollout_nodes else ", colocated with the trainer"
    )
    tp = r.tensor_parallel_size
    if gpu and tp > c.gpus_per_node:
        each = f"{tp} GPUs each, spanning {tp // c.gpus_per_node} nodes"
    elif gpu:
        each = f"up to {c.gpus_per_node // tp} per node, {tp} GPU(s) each"
    else:
        each = f"up to {-(-r.num_engines // max(1, engine_nodes))} per node, 1 process each"
    lines.append(f"rollout: {r.num_engines} engine(s) on {engine_nodes} node(s) ({where}), {each}")
    return lines
