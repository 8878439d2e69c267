"""Hugging Face <-> Megatron-core weight conversion with explicit name-mapping tables.

HF names are the canonical on-disk ones (what ``save_pretrained`` writes and vLLM loads):
per-expert ``mlp.experts.{e}.gate_proj.weight`` etc., not transformers' in-memory fused
``experts.gate_up_proj``. Megatron names are those of the local (non-TE) spec; the TE spec's
renamed tensors (layer norms fused into the following linear, grouped experts) are translated
through `TE_ALIASES` (GPU only; not exercised on CPU).

Fusions:

* ``qkv``: Megatron's ``linear_qkv.weight`` is ``[groups, (heads/groups + 2), head_dim, hidden]``:
  for each key/value group, its query heads, then its key head, then its value head. HF keeps
  ``q_proj`` ``[heads*head_dim, hidden]``, ``k_proj`` and ``v_proj`` ``[groups*head_dim, hidden]``;
  query head ``i`` uses group ``i // (heads/groups)`` in both.
* ``glu``: Megatron's SwiGLU ``linear_fc1.weight`` is ``cat([gate_proj, up_proj], 0)`` (Megatron
  applies the activation to the first half).

Tables map Megatron suffixes under ``decoder.layers.{layer}.`` (and under
``mlp.experts.local_experts.{expert}.``) to HF suffixes under ``model.layers.{layer}.`` (and
``mlp.experts.{expert}.``). Layer and expert indices are global: a pipeline stage converts its
own layers (``TransformerLayer.layer_number`` carries the offset) and an expert-parallel rank its
own experts (``MoELayer.local_expert_indices``).

LoRA: a linear with an adapter exports (and syncs) its merged weight ``W + s·B·A``; the adapter's
own tensors have no HF name and are not loaded from an HF folder (`moe_rl.megatron.lora`).

Tensor parallelism: a tensor Megatron splits (its ``tensor_model_parallel`` / ``partition_dim``
attributes) is all-gathered over the tensor-parallel group (the expert-tensor-parallel group for
routed experts) on export and cut to this rank's shard on load, so every TP rank must call
`iter_hf_weights` / `load_hf_weights` together. Splits are contiguous along ``partition_dim``,
except for the SwiGLU ``linear_fc1``, where each rank holds ``cat([gate_r, up_r])``: the gate and
up halves are split (and gathered) separately.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from moe_rl.device import copy_into
from moe_rl.quant.recipes import ADAPTER_HF

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HfMapping:
    """One Megatron tensor and the HF tensor(s) it is made of."""

    hf: tuple[str, ...]
    kind: str = "copy"
    """``copy`` (one HF tensor), ``qkv`` (q, k, v fused) or ``glu`` (gate, up fused)."""


def _r(*hf: str, kind: str = "copy") -> HfMapping:
    return HfMapping(tuple(hf), kind)


GLOBAL_RULES: dict[str, HfMapping] = {
    "embedding.word_embeddings.weight": _r("model.embed_tokens.weight"),
    "decoder.final_layernorm.weight": _r("model.norm.weight"),
    "output_layer.weight": _r("lm_head.weight"),
}

_NORM_RULES = {
    "input_layernorm.weight": _r("input_layernorm.weight"),
    "pre_mlp_layernorm.weight": _r("post_attention_layernorm.weight"),
    "self_attention.linear_proj.weight": _r("self_attn.o_proj.weight"),
}

_MLP_RULES = {
    # dense layers (DeepSeek-V3 first_k_dense_replace)
    "mlp.linear_fc1.weight": _r("mlp.gate_proj.weight", "mlp.up_proj.weight", kind="glu"),
    "mlp.linear_fc2.weight": _r("mlp.down_proj.weight"),
    # MoE layers
    "mlp.router.weight": _r("mlp.gate.weight"),
    "mlp.router.expert_bias": _r("mlp.gate.e_score_correction_bias"),
    "mlp.shared_experts.linear_fc1.weight": _r(
        "mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight", kind="glu"
    ),
    "mlp.shared_experts.linear_fc2.weight": _r("mlp.shared_experts.down_proj.weight"),
}

EXPERT_RULES: dict[str, HfMapping] = {
    "linear_fc1.weight": _r("gate_proj.weight", "up_proj.weight", kind="glu"),
    "linear_fc2.weight": _r("down_proj.weight"),
}

GQA_RULES: dict[str, HfMapping] = {
    "self_attention.linear_qkv.weight": _r(
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", kind="qkv"
    ),
    "self_attention.q_layernorm.weight": _r("self_attn.q_norm.weight"),
    "self_attention.k_layernorm.weight": _r("self_attn.k_norm.weight"),
}

MLA_RULES: dict[str, HfMapping] = {
    "self_attention.linear_q_proj.weight": _r("self_attn.q_proj.weight"),
    "self_attention.linear_q_down_proj.weight": _r("self_attn.q_a_proj.weight"),
    "self_attention.q_layernorm.weight": _r("self_attn.q_a_layernorm.weight"),
    "self_attention.linear_q_up_proj.weight": _r("self_attn.q_b_proj.weight"),
    "self_attention.linear_kv_down_proj.weight": _r("self_attn.kv_a_proj_with_mqa.weight"),
    "self_attention.kv_layernorm.weight": _r("self_attn.kv_a_layernorm.weight"),
    "self_attention.linear_kv_up_proj.weight": _r("self_attn.kv_b_proj.weight"),
}

LAYER_RULES: dict[str, dict[str, HfMapping]] = {
    "gqa": {**_NORM_RULES, **GQA_RULES, **_MLP_RULES},
    "mla": {**_NORM_RULES, **MLA_RULES, **_MLP_RULES},
}
"""Per attention kind: Megatron layer suffix -> rule over HF layer suffixes."""

TE_ALIASES: dict[str, str] = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attention.q_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attention.kv_layernorm.weight",
}
"""TE spec layer suffix -> local spec suffix (transformer-engine fuses norms into linears)."""

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
_TE_EXPERT_RE = re.compile(r"^mlp\.experts\.(linear_fc[12])\.weight(\d+)$")


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module"):
        model = model.module
    return model


@dataclass(frozen=True)
class _Split:
    """How one tensor is split over its tensor-parallel group."""

    group: object
    size: int
    rank: int
    dim: int


def _split_of(name: str, tensor: Tensor) -> _Split | None:
    """The tensor-parallel split of Megatron tensor ``name``, or None when this rank holds all of it."""
    if not getattr(tensor, "tensor_model_parallel", False):
        return None
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    expert = ".mlp.experts." in name
    group = ps.get_expert_tensor_parallel_group() if expert else ps.get_tensor_model_parallel_group()
    size = dist.get_world_size(group) if group is not None else 1
    if size == 1:
        return None
    return _Split(group, size, dist.get_rank(group), int(tensor.partition_dim))


def gather_shards(tensor: Tensor, kind: str, split: _Split) -> Tensor:
    """All ranks' shards of ``tensor`` -> the whole Megatron tensor (collective over the group)."""
    import torch.distributed as dist

    shards = [torch.empty_like(tensor) for _ in range(split.size)]
    dist.all_gather(shards, tensor.contiguous(), group=split.group)
    if kind == "glu" and split.dim == 0:
        halves = [shard.chunk(2, dim=0) for shard in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=split.dim)


def shard_of(tensor: Tensor, kind: str, split: _Split) -> Tensor:
    """This rank's shard of the whole Megatron tensor (inverse of `gather_shards`)."""
    if tensor.shape[split.dim] % split.size:
        raise ValueError(
            f"dimension {split.dim} of shape {tuple(tensor.shape)} does not split over {split.size} "
            "tensor-parallel ranks"
        )
    if kind == "glu" and split.dim == 0:
        gate, up = tensor.chunk(2, dim=0)
        return torch.cat([gate.chunk(split.size)[split.rank], up.chunk(split.size)[split.rank]], dim=0)
    return tensor.chunk(split.size, dim=split.dim)[split.rank]


def _attention_kind(config) -> str:
    return "mla" if getattr(config, "multi_latent_attention", False) else "gqa"


def _local_tensors(model: torch.nn.Module, adapters: bool = False) -> Iterator[tuple[str, Tensor]]:
    """Parameters and persistent buffers of a (possibly DDP-wrapped) GPTModel, in order. A LoRA
    adapter's tensors are among them only with ``adapters`` (the view of an engine that applies
    them); else an HF model has none: `merged_tensor` merges them."""
    from moe_rl.megatron.lora import is_adapter

    for name, tensor in _unwrap(model).state_dict(keep_vars=True).items():
        if (
            name.endswith("_extra_state")
            or not isinstance(tensor, Tensor)
            or (is_adapter(name) and not adapters)
        ):
            continue
        yield name, tensor


def merged_tensor(gpt: torch.nn.Module, name: str, tensor: Tensor, merge: bool = True) -> Tensor:
    """``tensor`` (Megatron tensor ``name``, detached), or (``merge``) the weight merged with its
    linear's LoRA adapter (`moe_rl.megatron.lora`): what the linear computes as one matrix."""
    from moe_rl.megatron.lora import has_adapter

    if not merge or not name.endswith(".weight"):
        return tensor
    module = gpt.get_submodule(name[: -len(".weight")])
    return module.merged_weight() if has_adapter(module) else tensor


def _resolve_layer_suffix(rest: str, layer_module, rules: dict[str, HfMapping]) -> tuple[HfMapping, str, str]:
    """(rule, HF prefix under the layer, Megatron suffix) for one name inside a layer."""
    te_expert = _TE_EXPERT_RE.match(rest)
    if te_expert:
        local = int(te_expert.group(2))
        expert = layer_module.mlp.local_expert_indices[local]
        return EXPERT_RULES[f"{te_expert.group(1)}.weight"], f"mlp.experts.{expert}.", rest
    match = _EXPERT_RE.match(rest)
    if match:
        expert = layer_module.mlp.local_expert_indices[int(match.group(1))]
        return EXPERT_RULES[match.group(2)], f"mlp.experts.{expert}.", rest
    rest = TE_ALIASES.get(rest, rest)
    if rest not in rules:
        raise ValueError(f"no HF mapping for Megatron tensor suffix {rest!r}")
    return rules[rest], "", rest


def _adapter_rule(model: torch.nn.Module, megatron_name: str) -> HfMapping:
    """The HF names of a LoRA adapter's tensor (``<linear>.lora_a`` / ``.lora_b``): ``A`` under the
    first HF linear the Megatron one fuses (one ``A`` serves them all), ``B`` split over them as the
    weight's rows are."""
    linear, which = megatron_name.rsplit(".", 1)
    rule = hf_names_for(model, f"{linear}.weight")
    modules = [name.removesuffix(".weight") for name in rule.hf]
    if which == "lora_a":
        return HfMapping((modules[0] + ADAPTER_HF[0],), "copy")
    return HfMapping(tuple(module + ADAPTER_HF[1] for module in modules), rule.kind)


def _fused_siblings() -> dict[str, str]:
    """HF linear suffix -> the first linear of the Megatron linear that fuses it (``self_attn.k_proj``
    -> ``self_attn.q_proj``, ``up_proj`` -> ``gate_proj``), over every rule that fuses several."""
    rules = [*GLOBAL_RULES.values(), *EXPERT_RULES.values()]
    rules += [rule for table in LAYER_RULES.values() for rule in table.values()]
    out: dict[str, str] = {}
    for rule in rules:
        first, *rest = (name.removesuffix(".weight") for name in rule.hf)
        out.update(dict.fromkeys(rest, first))
    return out


FUSED_SIBLINGS = _fused_siblings()
_SIBLINGS_LONGEST_FIRST = sorted(FUSED_SIBLINGS, key=len, reverse=True)  # (the most specific suffix wins)


def shared_a_module(module: str) -> str:
    """The HF module whose adapter ``A`` a fused linear's module shares (`_adapter_rule` sends it
    once, under the first HF linear): itself unless it is a later piece of a fused linear."""
    for suffix in _SIBLINGS_LONGEST_FIRST:
        if module == suffix or module.endswith(f".{suffix}"):
            return module[: len(module) - len(suffix)] + FUSED_SIBLINGS[suffix]
    return module


def hf_names_for(model: torch.nn.Module, megatron_name: str) -> HfMapping:
    """The rule for one Megatron tensor, with HF names made global (layer and expert offsets)."""
    from moe_rl.megatron.lora import is_adapter

    gpt = _unwrap(model)
    if is_adapter(megatron_name):
        return _adapter_rule(gpt, megatron_name)
    if megatron_name in GLOBAL_RULES:
        return GLOBAL_RULES[megatron_name]
    match = _LAYER_RE.match(megatron_name)
    if not match:
        raise ValueError(f"no HF mapping for Megatron tensor {megatron_name!r}")
    layer_module = gpt.decoder.layers[int(match.group(1))]
    layer = layer_module.layer_number - 1
    rules = LAYER_RULES[_attention_kind(gpt.config)]
    rule, sub_prefix, _ = _resolve_layer_suffix(match.group(2), layer_module, rules)
    prefix = f"model.layers.{layer}.{sub_prefix}"
    return HfMapping(tuple(prefix + name for name in rule.hf), rule.kind)


def _qkv_shape(config) -> tuple[int, int, int]:
    heads, groups = config.num_attention_heads, config.num_query_groups or config.num_attention_heads
    return heads, groups, config.kv_channels


def fuse(kind: str, pieces: list[Tensor], config) -> Tensor:
    """HF tensors -> the Megatron tensor (see the module docstring for the layouts)."""
    if kind == "copy":
        return pieces[0]
    if kind == "glu":
        return torch.cat(pieces, dim=0)
    heads, groups, head_dim = _qkv_shape(config)
    q, k, v = pieces
    hidden = q.shape[-1]
    q = q.reshape(groups, heads // groups, head_dim, hidden)
    k = k.reshape(groups, 1, head_dim, hidden)
    v = v.reshape(groups, 1, head_dim, hidden)
    return torch.cat([q, k, v], dim=1).reshape(-1, hidden)


def split(kind: str, tensor: Tensor, config) -> list[Tensor]:
    """The Megatron tensor -> its HF tensors (inverse of `fuse`)."""
    if kind == "copy":
        return [tensor]
    if kind == "glu":
        return list(torch.chunk(tensor, 2, dim=0))
    heads, groups, head_dim = _qkv_shape(config)
    hidden = tensor.shape[-1]
    grouped = tensor.reshape(groups, heads // groups + 2, head_dim, hidden)
    q, k, v = torch.split(grouped, [heads // groups, 1, 1], dim=1)
    return [q.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden)]


def iter_hf_weight_groups(
    model: torch.nn.Module, select: Callable[[str], bool] | None = None, copy: bool = True,
    adapters: bool = False, part: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, list[tuple[str, Tensor]]]]:  # fmt: skip
    """``(megatron_name, [(hf_name, tensor), ...])`` for every tensor this rank holds, in order:
    the HF pieces of one Megatron tensor together (a fused QKV or gate/up tensor gives several).

    Each piece is a contiguous, detached copy (at most one Megatron tensor's pieces are live at a
    time); with ``copy=False`` a piece may be a view of the parameter, valid until the weights
    change (for a consumer that copies it at once, as the weight sync does). Tensor-parallel
    shards are gathered, so every rank of a TP group must iterate together. ``select(megatron_name)``
    False skips a tensor (still taking part in its gather); ``part(megatron_name)`` False leaves it
    out on every rank (no gather). ``adapters``: LoRA's adapter tensors on their own and each weight
    as it is (for an engine that applies them), instead of each weight merged with its adapter.
    """
    gpt = _unwrap(model)
    for name, tensor in _local_tensors(gpt, adapters):
        if part is not None and not part(name):
            continue
        wanted = select is None or select(name)
        tp_split = _split_of(name, tensor)
        if not wanted and tp_split is None:
            continue
        rule = hf_names_for(gpt, name)
        whole = merged_tensor(gpt, name, tensor.detach(), merge=not adapters)
        if tp_split is not None:
            whole = gather_shards(whole, rule.kind, tp_split)
        if wanted:
            pieces = split(rule.kind, whole, gpt.config)
            pieces = [piece.contiguous() for piece in pieces]
            yield name, list(zip(rule.hf, [p.clone() for p in pieces] if copy else pieces))


def iter_hf_weights(model: torch.nn.Module) -> Iterator[tuple[str, Tensor]]:
    """Stream ``(hf_name, tensor)`` for every tensor this rank holds, layer by layer
    (`iter_hf_weight_groups`, flattened): TP shards gathered, one tensor's copies live at a time."""
    for _, group in iter_hf_weight_groups(model):
        yield from group


def _ignorable(name: str, num_layers: int) -> bool:
    """HF tensors the trainer does not use: rotary caches, multi-token-prediction layers."""
    if name.endswith("rotary_emb.inv_freq"):
        return True
    match = re.match(r"^model\.layers\.(\d+)\.", name)
    return bool(match) and int(match.group(1)) >= num_layers


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, hf_tensors: Mapping[str, Tensor]) -> None:
    """Copy HF tensors (canonical names) into the Megatron model, in place.

    ``hf_tensors`` may be lazy (`SafetensorsReader`): each tensor is read once, when needed.
    Missing tensors are an error, and so, on a rank that holds the whole model, are HF tensors
    left unused (other than rotary caches and multi-token-prediction layers).
    """
    gpt = _unwrap(model)
    used: set[str] = set()
    for name, target in _local_tensors(gpt):
        rule = hf_names_for(gpt, name)
        missing = [n for n in rule.hf if n not in hf_tensors]
        if missing:
            raise ValueError(f"HF weights lack {missing} needed for Megatron tensor {name!r}")
        _copy_into(gpt, name, target, rule, [hf_tensors[n] for n in rule.hf])
        used.update(rule.hf)
    if _holds_whole_model(gpt):
        extra = [n for n in hf_tensors if n not in used and not _ignorable(n, gpt.config.num_layers)]
        if extra:
            raise ValueError(f"{len(extra)} HF tensors have no Megatron counterpart, e.g. {extra[:5]}")


def hf_index(model: torch.nn.Module, adapters: bool = False) -> dict[str, str]:
    """HF name -> the Megatron tensor (of this rank) it is a piece of (``adapters``: see
    `iter_hf_weight_groups`)."""
    gpt = _unwrap(model)
    return {hf: name for name, _ in _local_tensors(gpt, adapters) for hf in hf_names_for(gpt, name).hf}


def hf_dtypes(model: torch.nn.Module, adapters: bool = False) -> dict[str, torch.dtype]:
    """HF name -> the dtype of the Megatron tensor (of this rank) it is a piece of."""
    gpt = _unwrap(model)
    return {hf: t.dtype for name, t in _local_tensors(gpt, adapters) for hf in hf_names_for(gpt, name).hf}


def piece_views(model: torch.nn.Module, adapters: bool = False) -> dict[str, Tensor]:
    """HF name -> the part of this rank's Megatron tensor that HF tensor fills, as a view, for the
    pieces that are one: a tensor this rank holds whole that is one HF tensor (``copy``) or gate and
    up stacked (``glu``). Interleaved (``qkv``) and tensor-parallel pieces have none. Writing a
    piece's values into its view loads it (a receiver may decode straight into it)."""
    gpt = _unwrap(model)
    views: dict[str, Tensor] = {}
    for name, target in _local_tensors(gpt, adapters):
        rule = hf_names_for(gpt, name)
        if rule.kind == "qkv" or _split_of(name, target) is not None:
            continue
        parts = [target] if rule.kind == "copy" else list(torch.chunk(target, len(rule.hf), dim=0))
        views.update(zip(rule.hf, parts, strict=True))
    return views


@torch.no_grad()
def load_hf_subset(
    model: torch.nn.Module, hf_tensors: Mapping[str, Tensor], index: Mapping[str, str]
) -> set[str]:
    """Load the Megatron tensors all of whose HF pieces are in ``hf_tensors``; returns their names.

    For weights that arrive in parts (buckets): ``index`` is `hf_index` of the model. An HF name
    the model has no tensor for is an error; pieces of a tensor whose other pieces are missing are
    an error too (a bucket carries whole tensors).
    """
    gpt = _unwrap(model)
    unknown = [n for n in hf_tensors if n not in index and not _ignorable(n, gpt.config.num_layers)]
    if unknown:
        raise ValueError(
            f"{len(unknown)} HF tensors have no Megatron counterpart on this rank, e.g. {unknown[:5]}"
        )
    loaded: set[str] = set()
    for name in dict.fromkeys(index[n] for n in hf_tensors if n in index):
        rule = hf_names_for(gpt, name)
        missing = [n for n in rule.hf if n not in hf_tensors]
        if missing:
            raise ValueError(f"Megatron tensor {name!r} arrived without its pieces {missing}")
        owner, _, attr = name.rpartition(".")  # the tensor itself, not a walk of the whole model
        target = getattr(gpt.get_submodule(owner) if owner else gpt, attr)
        _copy_into(gpt, name, target, rule, [hf_tensors[n] for n in rule.hf])
        loaded.add(name)
    return loaded


def _copy_into(gpt, name: str, target: Tensor, rule: HfMapping, pieces: list[Tensor]) -> None:
    value = fuse(rule.kind, pieces, gpt.config)
    tp_split = _split_of(name, target)
    if tp_split is not None:
        value = shard_of(value, rule.kind, tp_split)
    if tuple(value.shape) != tuple(target.shape):
        raise ValueError(
            f"HF tensor(s) {list(rule.hf)} give shape {tuple(value.shape)} for Megatron tensor "
            f"{name!r}, which has shape {tuple(target.shape)}"
        )
    # a byte copy on this process's threads where it can be, the cast where the dtypes differ
    copy_into(target, value.to(device=target.device), threads=torch.get_num_threads())


def _holds_whole_model(gpt) -> bool:
    config = gpt.config
    return config.pipeline_model_parallel_size == 1 and config.expert_model_parallel_size == 1


class SafetensorsReader(Mapping):
    """A lazy ``Mapping[name, Tensor]`` over the ``*.safetensors`` files of an HF folder."""

    def __init__(self, folder: str | Path):
        from safetensors import safe_open

        self.folder = Path(folder)
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise ValueError(f"no *.safetensors files in HF folder {self.folder}")
        self._handles = {f: safe_open(str(f), framework="pt") for f in files}
        self._where = {key: f for f, h in self._handles.items() for key in h.keys()}  # noqa: SIM118

    def __getitem__(self, name: str) -> Tensor:
        return self._handles[self._where[name]].get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def load_hf_checkpoint(model: torch.nn.Module, folder: str | Path) -> None:
    """Load an HF folder's safetensors into the Megatron model (see `load_hf_weights`)."""
    load_hf_weights(model, SafetensorsReader(folder))


def save_hf_checkpoint(
    model: torch.nn.Module,
    folder: str | Path,
    hf_config: dict,
    max_shard_bytes: int = 4 << 30,
    select: Callable[[str], bool] | None = None,
) -> Path:
    """Write an HF folder loadable by ``from_pretrained`` and vLLM: ``config.json`` plus
    safetensors shards (and ``model.safetensors.index.json`` when there is more than one).

    Streams `iter_hf_weight_groups`; at most one shard is held in memory. Collective over a
    trainer group: every rank calls it (tensor-parallel shards are gathered) and writes the tensors
    ``select(megatron_name)`` picks into its own shards; rank 0 then names the shards and writes
    the index. Without ``select`` the rank must hold the whole model (PP = EP = 1) and TP rank 0
    writes everything.
    """
    gpt = _unwrap(model)
    if select is None:
        if not _holds_whole_model(gpt):
            raise ValueError(
                "save_hf_checkpoint needs the whole model on this rank (PP = EP = 1), or select="
            )
        writer = _is_tp_writer()
        select = lambda name: writer  # noqa: E731
    folder = Path(folder)
    rank = _rank()
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True))
    _barrier()
    written: list[tuple[Path, list[str], int]] = []
    shard: dict[str, Tensor] = {}
    size = 0
    for _, group in iter_hf_weight_groups(gpt, select=select):
        for name, tensor in group:
            tensor = tensor.detach().cpu()  # files hold CPU tensors, in the model's dtype
            nbytes = tensor.numel() * tensor.element_size()
            if shard and size + nbytes > max_shard_bytes:
                written.append(_write_shard(folder, rank, len(written), shard, size))
                shard, size = {}, 0
            shard[name] = tensor
            size += nbytes
    if shard:
        written.append(_write_shard(folder, rank, len(written), shard, size))
    everyone = _gather(written)
    if rank == 0:
        _name_shards(folder, [item for part in everyone for item in part])
    _barrier()
    return folder


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _gather(items: list) -> list[list]:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [items]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, items)
    return out


def _is_tp_writer() -> bool:
    from megatron.core import parallel_state as ps

    return not ps.model_parallel_is_initialized() or ps.get_tensor_model_parallel_rank() == 0


def _write_shard(
    folder: Path, rank: int, index: int, shard: dict[str, Tensor], nbytes: int
) -> tuple[Path, list[str], int]:
    from safetensors.torch import save_file

    path = folder / f"shard-{rank:05d}-{index:05d}.tmp"
    save_file(shard, str(path), metadata={"format": "pt"})
    return path, list(shard), nbytes


def _name_shards(folder: Path, written: list[tuple[Path, list[str], int]]) -> None:
    """Give the shards their HF names; write the index when there are several."""
    if len(written) == 1:
        written[0][0].replace(folder / "model.safetensors")
        return
    weight_map = {}
    for i, (path, names, _) in enumerate(written):
        final = f"model-{i + 1:05d}-of-{len(written):05d}.safetensors"
        path.replace(folder / final)
        weight_map |= dict.fromkeys(names, final)
    total = sum(nbytes for _, _, nbytes in written)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
