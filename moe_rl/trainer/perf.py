"""Throughput of a trainer rank: the model FLOPs of its passes (`moe_rl.planner.flops`), the time
they took, and the matrix product this device reaches, measured here (the MFU's denominator is a
measurement on the same device in the same process, not a datasheet figure).

``perf/tflops`` is the rank's model FLOPs over the step's π_old pass (and π_ref's, with a KL
penalty) and its training passes, divided by their time; each rank is credited its share of the
FLOPs of the samples it holds (they are computed together by the TP x PP x CP ranks that hold
them). ``perf/mfu`` is that over the measured matrix-product rate.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from moe_rl.config.schema import RecipeConfig
from moe_rl.planner.flops import ModelFlops, model_flops

MATMUL_SIZE = {"cuda": 8192, "cpu": 1024}
"""Side of the square matrices of the peak measurement, per device type."""


def matmul_tflops(
    device: torch.device, dtype: torch.dtype, size: int | None = None, repeats: int = 5
) -> float:
    """TFLOP/s of a square matrix product in ``dtype`` on ``device``: the best of ``repeats`` runs
    after a warm-up."""
    n = size or MATMUL_SIZE.get(device.type, 1024)
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
    torch.matmul(a, b)
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        torch.matmul(a, b)
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best / 1e12


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing to wait for on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sequence_lengths(cu_seqlens: Iterable[torch.Tensor]) -> list[int]:
    """The packed sequences' lengths of micro-batches, from their cumulative offsets."""
    return [int(n) for cu in cu_seqlens for n in torch.diff(cu.cpu()).tolist()]


@dataclass
class RankPerf:
    """One rank's FLOPs accounting: its share of the FLOPs of the samples it holds, and the peak
    it is measured against (measured at the first use)."""

    flops: ModelFlops
    share: float
    """1 / (TP x PP x CP): the ranks that compute the same samples together."""
    device: torch.device
    dtype: torch.dtype
    peak_tflops: float | None = None

    @classmethod
    def of(cls, config: RecipeConfig, device: torch.device, dtype: torch.dtype) -> RankPerf:
        p = config.parallel
        together = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
        return cls(model_flops(config.model), 1.0 / together, device, dtype)

    def tflop(self, lengths: list[int], forwards: float = 1.0, training: bool = False) -> float:
        """This rank's TFLOP of ``forwards`` forward passes (``training``: forward and backward)."""
        each = self.flops.forward_backward(lengths) if training else self.flops.forward(lengths)
        return forwards * each * self.share / 1e12

    def metrics(self, tflop: float, seconds: float) -> dict[str, float]:
        """``perf/tflops`` and ``perf/mfu`` of ``tflop`` done in ``seconds``."""
        if self.peak_tflops is None:
            self.peak_tflops = matmul_tflops(self.device, self.dtype)
        rate = tflop / seconds if seconds > 0 else 0.0
        return {
            "perf/tflops": rate,
            "perf/mfu": rate / self.peak_tflops,
            "perf/peak_tflops": self.peak_tflops,
        }
