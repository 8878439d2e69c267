"""How much of the model a weight sync would carry as a delta: the share of what travels that changes
from one training step to the next, on the tiny recipe, for each rollout recipe's wire.

    python bench/sync_delta.py [--steps 100] [--lrs 5e-3 1e-6] [--recipes bf16 fp8_block128 ...]
                               [--overrides KEY=VALUE ...]

One run of the tiny recipe (`recipes/tiny_moe.yaml`, in this process: `moe_rl.orchestration.local`)
per learning rate; after every step the trainer's weights (HF-named, as a sync sends them) are
encoded by each recipe's wire (`moe_rl.weight_sync.wire.WireEncoder`) and compared with the step
before:

* a weight that travels as it is: the share of its elements whose value changed, in the bf16 an
  engine holds (``bf16`` recipe) — and, beside it, in the trainer's own dtype (``raw``);
* a quantized weight: the share of its quantization blocks whose codes or scale changed (a block is
  what a lossless delta of a quantized wire must resend whole); beside it (``codes``) the share of
  its 8-bit codes that changed, element by element.

``delta share`` is the bytes a delta of the step would carry (each changed element with a 4-byte
index; each changed block's codes, scale and a 4-byte index) over a full sync's bytes; ``changed``
is the share of elements (or blocks) that changed. The table gives the median over the steps after
the first and the largest. All recipes' wires encode the same run's weights (the rollout recipe
changes the data a step trains on only through the engine's sampling; the tiny recipe's own
``fp8_block128`` drives the run).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_rl.config import load_recipe
from moe_rl.megatron.hf_weights import iter_hf_weights
from moe_rl.orchestration.local import LocalRun
from moe_rl.orchestration.preflight import load_checked
from moe_rl.weight_sync.wire import WireEncoder

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "tiny_moe.yaml"
RECIPES = ("bf16", "fp8_block128", "fp8_tensor", "int8")
INDEX_BYTES = 4
"""Bytes of one position in a delta (an element's or a block's flat index)."""


@dataclass
class Wire:
    """What travels for one tensor under one recipe: its pieces' values (codes, scales or the tensor)."""

    pieces: dict[str, torch.Tensor]
    blocks: tuple[int, int] | None
    """The quantization block of the codes (None: the tensor travels as it is)."""


def wire_of(encoder: WireEncoder, name: str, tensor: torch.Tensor) -> Wire:
    """``tensor`` as ``encoder`` writes it into a bucket (its pieces, computed into tensors of their own)."""
    group = encoder.lazy_group([(name, tensor)])
    views = [torch.empty(piece.shape, dtype=piece.dtype) for piece in group.pieces]
    group.fill(views)
    blocks = None
    for piece in group.pieces:
        if "block" in piece.meta:
            blocks = tuple(piece.meta["block"])
    return Wire({piece.name: view for piece, view in zip(group.pieces, views, strict=True)}, blocks)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's elements as integers of their own width (equal bits, equal values; NaN-safe)."""
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(view)


@dataclass
class Tally:
    changed: float = 0.0
    counted: float = 0.0
    delta_bytes: float = 0.0
    full_bytes: float = 0.0
    codes_changed: float = 0.0
    codes: float = 0.0

    def add(self, other: Tally) -> None:
        self.changed += other.changed
        self.counted += other.counted
        self.delta_bytes += other.delta_bytes
        self.full_bytes += other.full_bytes
        self.codes_changed += other.codes_changed
        self.codes += other.codes


def compare(before: Wire, after: Wire, as_bf16: bool) -> Tally:
    """What a delta from ``before`` to ``after`` carries (see the module docstring)."""
    if after.blocks is None:
        (name,) = after.pieces
        old, new = before.pieces[name], after.pieces[name]
        if as_bf16:
            old, new = old.to(torch.bfloat16), new.to(torch.bfloat16)
        changed = int((_bits(old) != _bits(new)).sum())
        size = new.element_size()
        return Tally(changed, new.numel(), changed * (size + INDEX_BYTES), new.numel() * size)
    codes_name = next(n for n in after.pieces if not n.endswith("_scale_inv"))
    scale_name = next(n for n in after.pieces if n.endswith("_scale_inv"))
    old, new = before.pieces[codes_name], after.pieces[codes_name]
    diff = (_bits(old) != _bits(new)).float()
    grid = diff.view(1, 1, *diff.shape) if diff.dim() == 2 else diff.view(1, 1, 1, -1)
    block = after.blocks if diff.dim() == 2 else (1, after.blocks[-1])
    per_block = F.max_pool2d(grid, kernel_size=block, stride=block, ceil_mode=True)[0, 0] > 0
    scale_changed = _bits(before.pieces[scale_name]) != _bits(after.pieces[scale_name])
    changed_blocks = per_block.reshape(scale_changed.shape) | scale_changed
    n = changed_blocks.numel()
    k = int(changed_blocks.sum())
    codes, scales = new.numel() * new.element_size(), after.pieces[scale_name].numel() * 4
    per = codes / n + 4 + INDEX_BYTES
    return Tally(k, n, k * per, codes + scales, float(diff.sum()), float(diff.numel()))


def quant_of(recipe: str):
    return load_recipe(RECIPE, [f"rollout.quant={recipe}"]).quant


def measure(lr: float, steps: int, recipes: list[str], overrides: list[str]) -> dict[str, list[Tally]]:
    config = load_checked(
        RECIPE, [*overrides, f"run.steps={steps}", f"trainer.lr={lr}", "logging.progress=false"]
    )
    encoders = {r: WireEncoder(quant_of(r), config.model.num_layers) for r in recipes}
    local = LocalRun(config)
    series: dict[str, list[Tally]] = {r: [] for r in recipes} | {"raw": []}
    previous: dict[str, dict[str, Wire]] | None = None
    try:
        for record in local.run(steps):
            weights = {n: t.detach().clone() for n, t in iter_hf_weights(local.trainer.model)}
            now = {r: {n: wire_of(e, n, t) for n, t in weights.items()} for r, e in encoders.items()}
            now["raw"] = {n: Wire({n: t}, None) for n, t in weights.items()}
            if previous is not None:
                for r in series:
                    total = Tally()
                    for n in weights:
                        total.add(compare(previous[r][n], now[r][n], as_bf16=r == "bf16"))
                    series[r].append(total)
            previous = now
            if record["step"] % 10 == 0:
                print(f"  lr {lr:g}: step {record['step']} of {steps}", file=sys.stderr, flush=True)
    finally:
        local.job.shutdown()
    return series


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lrs", type=float, nargs="+", default=[5e-3, 1e-6])
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=RECIPES)
    parser.add_argument("--overrides", nargs="*", default=[], help="recipe overrides (a larger model)")
    args = parser.parse_args()
    print(" ".join(["`recipes/tiny_moe.yaml`", *args.overrides]) + f", {args.steps} steps")
    print()
    print(
        "| lr | wire | changed (median) | changed (max) | codes (median) | delta share (median) | delta share (max) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for lr in args.lrs:
        series = measure(lr, args.steps, args.recipes, args.overrides)
        for recipe, tallies in series.items():
            changed = [t.changed / t.counted for t in tallies]
            share = [t.delta_bytes / t.full_bytes for t in tallies]
            codes = (
                f"{statistics.median(t.codes_changed / t.codes for t in tallies):.2%}"
                if tallies[0].codes
                else ""
            )
            print(
                f"| {lr:g} | {recipe} | {statistics.median(changed):.2%} | {max(changed):.2%} | {codes} | "
                f"{statistics.median(share):.2%} | {max(share):.2%} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
