"""bench/algo_*.py still run (tiny sizes; the figures themselves are not checked)."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    "argv",
    [
        ["bench/algo_ksm.py", "--quick", "--vocab", "64", "--tokens", "16", "--kept", "4", "--repeats", "1"],
        [
            "bench/algo_stack.py",
            "--quick",
            "--vocab",
            "64",
            "--tokens",
            "512",
            "--kept",
            "4",
            "--repeats",
            "1",
        ],
    ],
    ids=["ksm", "stack"],
)
def test_bench_runs_and_prints_ratios(argv):
    out = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "x |" in out.stdout  # a ratio column was printed


def test_bench_refuses_cuda_without_a_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    out = subprocess.run(
        [sys.executable, "bench/algo_ksm.py", "--device", "cuda"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0 and "torch.cuda.is_available() is False" in out.stderr
