"""The `colocated` tier of scripts/gpu_check.sh: the real Ray loop on this machine, trainer rank and
Megatron engine as separate processes sharing its GPU (`moe-rl train` on the tiny recipe), run twice
— memory given back between phases (`cluster.release_memory=on`) and kept (`off`) — and compared;
then once more with memory given back on a wider model (`WIDE`: hidden 1024, 32 experts of width
1024, 0.8 GB of fp32 weights), whose phases move enough memory for the driver's figures to show it
beside the CUDA contexts. The engine takes unquantized weights (`rollout.quant`, default bf16), so
its log-probs must equal the trainer's.

Prints one table per run that gave memory back: after each phase, what the trainer and the engine
hold as tensors (the caching allocator) and as the driver counts the process (NVML, on CUDA:
context, allocator segments, workspaces); then the verdict:

* every RL step of the two tiny runs is equal (rewards, losses, gradient norms, mismatch, bytes);
* each step the trainer released its memory once and the engine slept once;
* asleep, the engine keeps at most 10 % of its generation footprint: its tensors, and on CUDA the
  segments its caching allocator holds (the driver's count of the process, printed, also holds its
  CUDA context and the kernels loaded into it, which only the process's end gives back);
* while the engine generates the trainer keeps its weights and at most 10 % of the rest it holds
  after training (no gradients, no optimizer state);
* on CUDA the weights went from the trainer's GPU memory to the engine's by IPC handle
  (`sync/transport` = device_ipc), never through host memory, and with unquantized weights the
  engine's log-probs equal the trainer's: bit for bit at the start (`old/kl_k3` = 0), within
  round-off after every sync (`KL_ROUNDOFF`).

    python scripts/colocated_check.py OUT_DIR [--device cuda] [--steps 4] [--level 1] [--no-wide]

Exit status 0 when every check holds, 1 otherwise. With ``--device cpu`` it smoke-tests the tier on
a machine without a GPU (the memory is then the bytes of the tensors the phases move).
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `python scripts/colocated_check.py` from anywhere
KEPT_SHARE = 0.10
"""The most of its generation footprint an engine may keep asleep, and of what a trainer holds
beyond its weights after training that it may keep while the engine generates."""
KL_ROUNDOFF = 1e-6
"""With unquantized weights the engine's log-probs equal the trainer's at the start (the same
weights, bit for bit: ``old/kl_k3`` = 0); after updates the two passes' different shapes (one token
at a time against the whole sequence) leave round-off, about 1e-9 on the CPU. A sync that left the
engine a step behind differs by a whole update."""
WIDE = [
    "model.hidden_size=1024", "model.num_experts=32", "model.moe_ffn_hidden_size=1024",
    "model.ffn_hidden_size=2048", "trainer.lr=1.0e-4",
]  # fmt: skip
"""The wider model of the third run: 2 layers of 32 experts of width 1024, 0.2 G parameters."""


def train(out: Path, name: str, args: argparse.Namespace, release: str, extra: list[str]) -> list[dict]:
    cmd = [
        sys.executable, "-m", "launch.cli", "train", str(REPO / "recipes" / "tiny_moe.yaml"),
        f"run.name={name}", f"run.output_dir={out}", f"run.device={args.device}", f"run.steps={args.steps}",
        f"cluster.release_memory={release}", f"cluster.engine_sleep_level={args.level}",
        f"rollout.quant={args.quant}", "logging.progress=false", "logging.tensorboard=false", *extra,
    ]  # fmt: skip
    print("$", " ".join(cmd), flush=True)
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stdout[-3000:], done.stderr[-3000:], sep="\n")
        raise SystemExit(f"colocated_check: the {name} run failed (exit {done.returncode})")
    return [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]


def comparable(record: dict) -> dict:
    """What the two runs agree on: not times and rates, not memory (`metrics.repeatable`)."""
    from moe_rl.orchestration.metrics import repeatable

    return repeatable(record, ("memory/",))


def _get(record: dict, key: str) -> float:
    return record.get(key, float("nan"))


def memory_table(name: str, records: list[dict], args: argparse.Namespace, bitwise: bool = True) -> list[str]:
    """Prints the run's memory per phase; returns what fails the checks. ``bitwise``: the engine's
    log-probs at the start equal the trainer's bit for bit (the tiny model's do on the CPU and on an
    H200; the wider model's products differ in round-off on a GPU)."""
    cuda = args.device == "cuda"
    failures = []
    print(f"\n{name}: memory per phase, GiB (level {args.level}; tensors: the allocator's bytes"
          f"{'; driver: NVML per process' if cuda else ', on CPU the bytes the phases move'})")  # fmt: skip
    header = (
        "step  trainer tensors: weights / generate / train / peak   engine tensors: generate / asleep   kl_k3"
    )
    if cuda:
        header += (
            "   driver: trainer context / generate / train   engine context / awake / generate / asleep"
            "   engine segments: generate / asleep"
        )
    print(header)
    for r in records:
        g = functools.partial(_get, r)
        line = (
            f"{r['step']:4d}  {g('memory/trainer_weights_gib'):24.3f} / {g('memory/trainer_generate_gib'):8.3f} / "
            f"{g('memory/trainer_train_gib'):5.3f} / {g('memory/trainer_peak_gib'):5.3f}   "
            f"{g('memory/engine_generate_gib'):24.3f} / {g('memory/engine_asleep_gib'):6.3f}   {g('old/kl_k3'):9.2e}"
        )
        if cuda:
            line += (
                f"   {g('memory/trainer_context_gib'):23.3f} / {g('memory/trainer_generate_device_gib'):8.3f} / "
                f"{g('memory/trainer_train_device_gib'):5.3f}   {g('memory/engine_context_gib'):14.3f} / "
                f"{g('memory/engine_awake_device_gib'):5.3f} / {g('memory/engine_generate_device_gib'):8.3f} / "
                f"{g('memory/engine_asleep_device_gib'):6.3f}   {g('memory/engine_generate_reserved_gib'):26.3f} / "
                f"{g('memory/engine_asleep_reserved_gib'):6.3f}"
            )
        print(line)
        step = f"{name} step {r['step']}"
        if r["memory/trainer_releases"] != 1 or r["memory/engine_sleeps"] != 1:
            failures.append(
                f"{step}: released {r['memory/trainer_releases']}x, slept {r['memory/engine_sleeps']}x"
            )
        shares = {"tensors": r["memory/engine_asleep_gib"] / max(r["memory/engine_generate_gib"], 1e-12)}
        if cuda:  # the segments the allocator took from the driver (the rest only the process's end frees)
            shares["allocator segments"] = r["memory/engine_asleep_reserved_gib"] / max(
                r["memory/engine_generate_reserved_gib"], 1e-12
            )
        for what, share in shares.items():
            if not share <= KEPT_SHARE:  # NaN fails: the driver did not tell
                failures.append(f"{step}: the engine kept {share:.1%} of its footprint asleep ({what})")
        weights = r["memory/trainer_weights_gib"]
        rest = r["memory/trainer_train_gib"] - weights
        kept = r["memory/trainer_generate_gib"] - weights
        if not (rest > 0 and kept <= KEPT_SHARE * rest):
            failures.append(
                f"{step}: while the engine generated the trainer kept {kept:.4f} GiB beyond its weights, of "
                f"{rest:.4f} GiB it holds beyond them after training"
            )
        expected = "device_ipc" if cuda else "shared_memory"  # GPU to GPU on CUDA
        if r.get("sync/transport") != expected:
            failures.append(f"{step}: weights went by {r.get('sync/transport')}, not {expected}")
        kl = r.get("old/kl_k3", float("nan"))
        if args.quant == "bf16" and not (kl == 0 if r["step"] == 0 and bitwise else abs(kl) <= KL_ROUNDOFF):
            failures.append(f"{step}: the engine's log-probs differ from the trainer's (kl_k3 {kl:.3g})")
    if len(records) != args.steps:
        failures.append(f"{name}: {len(records)} steps of {args.steps}")
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--level", type=int, default=1, choices=[1, 2])
    parser.add_argument("--quant", default="bf16", help="rollout.quant of the runs (default bf16)")
    parser.add_argument("--no-wide", dest="wide", action="store_false", help="skip the wider model's run")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    released = train(args.out, "released", args, "on", [])
    kept = train(args.out, "kept", args, "off", [])
    failures = memory_table("released", released, args)
    for a, b in zip(released, kept, strict=True):
        if comparable(a) != comparable(b):
            keys = sorted(k for k in set(comparable(a)) | set(comparable(b)) if a.get(k) != b.get(k))
            failures.append(f"step {a['step']}: differs from the run that keeps its memory in {keys[:5]}")
    if args.wide:
        failures += memory_table(
            "wide_released", train(args.out, "wide_released", args, "on", WIDE), args, bitwise=False
        )
    print()
    for failure in failures:
        print("FAIL:", failure)
    print(
        "colocated_check:", "PASS" if not failures else "FAIL", f"({len(released)} steps, level {args.level})"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
