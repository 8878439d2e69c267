"""The fused CPU kernels of the FP8 wire give bit for bit what the torch operations give, run only
where they apply, and give way to the torch operations where they cannot be compiled."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from moe_rl.config.schema import QuantConfig
from moe_rl.quant import fused
from moe_rl.quant.codec import dequantize, quant_errors
from moe_rl.quant.fp8_block import torch_fp8_block
from moe_rl.weight_sync.wire import WireEncoder
from tests.unit.weight_sync.sync_testing import encode

FP8_BLOCK128 = QuantConfig(name="fp8_block128", method="fp8", granularity="block", block_size=128)
NAME = "model.layers.0.mlp.experts.0.down_proj.weight"


def _weight(dtype: torch.dtype) -> torch.Tensor:
    """384×512 (3×4 blocks of 128), each block at its own magnitude, one all-zero block, one outlier."""
    g = torch.Generator().manual_seed(0)
    magnitude = torch.logspace(-6, 3, 12).reshape(3, 4).repeat_interleave(128, 0).repeat_interleave(128, 1)
    weight = torch.randn(384, 512, generator=g) * magnitude
    weight[128:256, 256:384] = 0
    weight[5, 7] = 3e4
    return weight.to(dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, NaNs aside (a NaN's sign and payload carry nothing)."""
    nan = a.isnan()
    bits = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[a.dtype]
    return torch.equal(nan, b.isnan()) and torch.equal(a.view(bits)[~nan], b.view(bits)[~nan])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_encode_and_decode_equal_the_torch_operations(monkeypatch, dtype):
    monkeypatch.setattr(fused, "FUSED_MIN_ELEMENTS", 1)  # a small weight, so the test stays quick
    weight = _weight(dtype)
    assert fused.usable(weight.shape, (128, 128), weight.device)
    want_data, want_scale = torch_fp8_block(weight, 128)

    encoder = WireEncoder(FP8_BLOCK128, num_layers=2)
    (_, data, meta), (_, scale, _) = encode(encoder, NAME, weight)
    assert torch.equal(data.view(torch.uint8), want_data.view(torch.uint8))
    assert torch.equal(scale, want_scale) and bool(
        (scale[1, 2] == 0) & (data[128:256, 256:384].view(torch.uint8) == 0).all()
    )
    err, ref = quant_errors(weight, want_data, want_scale, (128, 128))
    assert encoder.report.err_sq == pytest.approx(err, rel=1e-4)
    assert encoder.report.ref_sq == pytest.approx(ref, rel=1e-4)

    # Decoding, with a NaN byte and scales past 2**8 (which the torch path's bit decode hands to torch's
    # conversion), into a weight and into a strided view of a wider one.
    data = data.clone()
    data.view(torch.uint8)[300, 500] = 0xFF
    scale = scale.clone()
    scale[0, 0] = 1000.0
    want = data.float() * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
    for out_dtype in (torch.bfloat16, torch.float32):
        wider = torch.zeros(384, 520, dtype=out_dtype)
        assert fused.decode(data, scale, (128, 128), wider[:, 3:515])
        assert _same_bits(wider[:, 3:515], want.to(out_dtype))
        assert int(wider.isnan().sum()) == 1 and not wider[:, :3].any() and not wider[:, 515:].any()
        out = dequantize(data, scale, tuple(meta["block"]), out=torch.empty(384, 512, dtype=out_dtype))
        with fused.turned_off():
            torch_path = dequantize(data, scale, (128, 128), out=torch.empty(384, 512, dtype=out_dtype))
        assert _same_bits(out, torch_path)
    assert not fused.decode(data, scale[:, :3], (128, 128), out)  # scales that do not tile the weight


def test_fused_kernels_run_on_large_cpu_weights_of_whole_blocks():
    big = (2048, 2048)
    assert big[0] * big[1] >= fused.FUSED_MIN_ELEMENTS
    cpu = torch.device("cpu")
    assert fused.usable(big, (128, 128), cpu)
    assert fused.usable(big, (1, 128), cpu) and fused.usable(big, (1, 2048), cpu)
    assert not fused.usable((64, 64), (32, 32), cpu)  # small: the torch operations are as fast
    assert not fused.usable((2048, 2000), (128, 128), cpu)  # a partial block
    assert not fused.usable(big, (128, 128), torch.device("cuda"))
    assert not fused.usable((4, 2048, 2048), (128, 128), cpu)


NO_COMPILER = """
import logging, sys, torch
import torch._inductor.config as inductor
inductor.cpp.cxx = (None, "/nonexistent/c++")
inductor.compile_threads = 1
from moe_rl.quant.fp8_block import torch_fp8_block
from moe_rl.quant import fused
from moe_rl.quant import codec
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(name)s|%(message)s")
fused.FUSED_MIN_ELEMENTS = 1
weight = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
data, scale = torch_fp8_block(weight, 64)
got = codec.dequantize(data, scale, (64, 64), out=torch.empty(256, 256))
want = data.float() * scale.repeat_interleave(64, 0).repeat_interleave(64, 1)
print("enabled", fused.usable((256, 256), (64, 64), torch.device("cpu")), "equal", torch.equal(got, want))
"""


def test_a_kernel_that_cannot_be_compiled_leaves_the_torch_operations(tmp_path):
    """A machine without a working C++ compiler: one warning, and the same values."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, "-c", NO_COMPILER], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    ours = [line for line in lines if line.startswith(fused.__name__ + "|")]
    assert len(ours) == 1 and "fused CPU kernels for the FP8 wire are off in this process" in ours[0], lines
    assert lines[-1] == "enabled False equal True"
