"""Block-FP8 quantization (`moe_rl.quant.fp8_block`) against NVIDIA ModelOpt, bit for bit.

Three tiers, all compared with ModelOpt's `FP8QTensor.quantize` called here directly:

* CPU: the project function (`torch_fp8_block`: torch operations, a few row blocks at a time) on
  several shapes and dtypes, in one chunk and in many.
* Triton interpreter: the Triton kernel itself, run on CPU tensors under ``TRITON_INTERPRET=1``
  in a subprocess (the variable must be set before Triton is imported; this process stays
  unaffected). Skipped where Triton is not importable.
* GPU (`gpu` marker): the Triton kernel on CUDA, as `quantize_fp8_block` runs it there.

Bit-identity is checked on raw bytes (``.view(torch.uint8)`` / ``.view(torch.int32)``); all-zero
blocks must give scale 0 and data +0 (ModelOpt: NaN), NaN results must sit where ModelOpt's do.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_rl.quant import fp8_block
from moe_rl.quant.fp8_block import (
    INV_FP8_MAX,
    kernel_configs,
    quantize_fp8_block,
    triton_path_available,
)

ROOT = Path(__file__).resolve().parents[3]
FP8 = torch.float8_e4m3fn


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def modelopt(weight: torch.Tensor, b: int, cuda_rule: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """ModelOpt's result on a 2-D weight (3-D: per expert).

    ``cuda_rule``: the scales as ModelOpt's ``amax / 448.0`` comes out on CUDA, where torch
    multiplies by the fp32 reciprocal, ``amax * fl(1/448)``, computed on `weight`'s device and
    handed to ModelOpt, which quantizes with them (``x / scale`` divides on either device).
    """
    from modelopt.torch.quantization.qtensor import FP8QTensor

    if weight.dim() == 3:
        parts = [modelopt(expert, b, cuda_rule) for expert in weight.unbind(0)]
        return torch.stack([d for d, _ in parts]), torch.stack([s for _, s in parts])
    rows, cols = cdiv(weight.shape[0], b), cdiv(weight.shape[1], b)
    scales = None
    if cuda_rule:
        x = torch.zeros(rows * b, cols * b, dtype=torch.float32, device=weight.device)
        x[: weight.shape[0], : weight.shape[1]] = weight.abs()
        amax = x.view(rows, b, cols, b).amax(dim=(1, 3))
        scales = amax * torch.tensor(INV_FP8_MAX, device=weight.device)  # two tensors: an IEEE product
    qtensor, scale = FP8QTensor.quantize(weight.float(), scales=scales, block_sizes={-1: b, -2: b})
    return qtensor._quantized_data.view(FP8), scale.reshape(rows, cols).float()


def per_element(block_mask: torch.Tensor, b: int, shape: torch.Size) -> torch.Tensor:
    """Expand a per-block boolean mask to the elements of a weight of `shape`."""
    full = block_mask.repeat_interleave(b, dim=-2).repeat_interleave(b, dim=-1)
    return full[..., : shape[-2], : shape[-1]]


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    diff = got != want
    assert not bool(diff.any()), (
        f"{what}: {int(diff.sum())} of {diff.numel()} differ, first at flat index {int(diff.nonzero()[0])}"
    )


def assert_matches_modelopt(
    data: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, b: int, cuda_rule: bool = False
) -> None:
    """The contract of `fp8_block`: ModelOpt's bits, but +0 data in scale-0 blocks; NaN where ModelOpt's."""
    ref_data, ref_scale = modelopt(weight, b, cuda_rule)
    assert data.dtype == FP8 and scale.dtype == torch.float32
    assert data.shape == weight.shape and scale.shape == ref_scale.shape
    assert data.device == weight.device and scale.device == weight.device
    ref_data, ref_scale = ref_data.to(data.device), ref_scale.to(data.device)

    nan_scale = ref_scale.isnan()
    assert torch.equal(scale.isnan(), nan_scale), "scale: NaN at other blocks than ModelOpt's"
    assert_same_bits(scale.view(torch.int32)[~nan_scale], ref_scale.view(torch.int32)[~nan_scale], "scale")

    zero = per_element(ref_scale == 0, b, weight.shape)
    got, want = data.view(torch.uint8), ref_data.view(torch.uint8)
    assert bool((got[zero] == 0).all()), "blocks with scale 0 must give data +0 (byte 0x00)"
    rest = ~zero
    got_nan, want_nan = data.float().isnan(), ref_data.float().isnan()
    assert torch.equal(got_nan[rest], want_nan[rest]), "data: NaN at other places than ModelOpt's"
    keep = rest & ~want_nan
    assert_same_bits(got[keep], want[keep], "data")


def random_weight(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 0.02).to(dtype)


def special_weight() -> torch.Tensor:
    """fp32 [260, 390], 3×4 blocks of 128: every edge case of the contract next to ordinary blocks."""
    w = random_weight((260, 390), torch.float32, seed=1)
    w[:128, :128] = 0.0  # an all-zero block (ModelOpt: 0/0 = NaN data)
    w[5, 7] = -0.0  # a negative zero in it
    w[3, 200] = float("nan")  # a NaN block
    w[100, 300] = float("inf")  # an Inf block
    w[128:256, :128] *= 1e-37 / 0.02  # fp32-subnormal scale (amax / 448 < 2**-126)
    w[128:256, 128:256] = (
        torch.randn(128, 128, generator=torch.Generator().manual_seed(2)) * 1e-40
    )  # subnormals
    w[128:256, 256:384] = torch.randn(128, 128, generator=torch.Generator().manual_seed(3)) * 1e-44  # scale 0
    w[256:, 384:] = 0.0  # a partial, all-zero block at the corner
    return w


# --- CPU: the project function (the torch path) is ModelOpt (+ the zero-block rule) ------------------

CPU_CASES = [
    ((256, 384), torch.bfloat16, 128),
    ((200, 300), torch.bfloat16, 128),  # not multiples of the block
    ((130, 1000), torch.float16, 128),
    ((7, 5), torch.float32, 128),  # smaller than one block
    ((96, 80), torch.float32, 32),
    ((3, 64, 48), torch.float32, 24),  # a block size that is not a power of two
    ((4, 200, 136), torch.bfloat16, 128),  # an expert stack
]


@pytest.mark.parametrize(("shape", "dtype", "b"), CPU_CASES)
def test_cpu_path_is_modelopt_bit_for_bit(shape, dtype, b):
    w = random_weight(shape, dtype)
    data, scale = quantize_fp8_block(w, b)
    assert scale.shape == (*shape[:-2], cdiv(shape[-2], b), cdiv(shape[-1], b))
    ref_data, ref_scale = modelopt(w, b)
    assert torch.equal(data.view(torch.uint8), ref_data.view(torch.uint8))
    assert torch.equal(scale.view(torch.int32), ref_scale.view(torch.int32))
    assert data.device.type == "cpu" and not triton_path_available(w)


@pytest.mark.parametrize("chunk", [1, 128 * 128 * 3])
def test_torch_path_in_row_chunks_is_modelopt(monkeypatch, chunk):
    """A chunk of one row block (or three 128-blocks of elements) at a time: the same bits."""
    monkeypatch.setattr(fp8_block, "CHUNK_ELEMENTS", chunk)
    for w, b in [(random_weight((520, 300), torch.bfloat16), 128), (special_weight(), 128),
                 (random_weight((3, 70, 50), torch.float32), 16)]:  # fmt: skip
        data, scale = fp8_block.torch_fp8_block(w, b)
        assert_matches_modelopt(data, scale, w, b)


def test_zero_blocks_give_scale_0_and_data_0_where_modelopt_gives_nan():
    w = special_weight()
    ref_data, ref_scale = modelopt(w, 128)
    zero_blocks = [(0, 0), (2, 3), (1, 2)]  # all zeros, the zero corner, amax/448 underflowing to 0
    for r, c in zero_blocks:
        assert ref_scale[r, c] == 0
    for r, c in zero_blocks[:2]:  # ModelOpt: 0 / 0 = NaN
        assert bool(ref_data[r * 128 : (r + 1) * 128, c * 128 : (c + 1) * 128].float().isnan().all())
    tiny, tiny_in = ref_data[128:256, 256:384].float(), w[128:256, 256:384]
    # ModelOpt: ±x / 0 = ±Inf, cast by torch: to ±448 (torch 2.13 on the CPU) or NaN (torch 2.11)
    inf_cast = torch.tensor([float("inf")]).to(FP8).float().abs()
    got = tiny[tiny_in != 0].abs()
    assert bool(got.isnan().all()) if inf_cast.isnan() else bool((got == inf_cast).all())
    assert bool(tiny[tiny_in == 0].isnan().all()) and bool((tiny_in == 0).any())
    assert int((ref_scale == 0).sum()) == len(zero_blocks)

    data, scale = quantize_fp8_block(w, 128)
    for r, c in zero_blocks:
        assert scale[r, c] == 0
        assert bool((data.view(torch.uint8)[r * 128 : (r + 1) * 128, c * 128 : (c + 1) * 128] == 0).all())
    assert_matches_modelopt(data, scale, w, 128)
    finite_blocks = per_element((scale != 0) & scale.isfinite(), 128, w.shape)
    assert not bool(data.float()[finite_blocks].isnan().any())

    stack = torch.stack(
        [random_weight((130, 260), torch.bfloat16), torch.zeros(130, 260, dtype=torch.bfloat16)]
    )
    data, scale = quantize_fp8_block(stack, 128)
    assert_matches_modelopt(data, scale, stack, 128)
    assert bool((scale[1] == 0).all()) and bool((data[1].view(torch.uint8) == 0).all())


def test_stack_equals_its_experts_and_views_equal_copies():
    stack = random_weight((3, 200, 136), torch.bfloat16)
    data, scale = quantize_fp8_block(stack, 128)
    for i in range(3):
        d, s = quantize_fp8_block(stack[i], 128)
        assert torch.equal(data[i].view(torch.uint8), d.view(torch.uint8)) and torch.equal(scale[i], s)
    wt = random_weight((384, 256), torch.bfloat16).t()  # a transposed (non-contiguous) view
    d1, s1 = quantize_fp8_block(wt, 128)
    d2, s2 = quantize_fp8_block(wt.contiguous(), 128)
    assert torch.equal(d1.view(torch.uint8), d2.view(torch.uint8)) and torch.equal(s1, s2)


def test_empty_weight():
    data, scale = quantize_fp8_block(torch.zeros(0, 300), 128)
    assert data.shape == (0, 300) and data.dtype == FP8 and scale.shape == (0, 3)


@pytest.mark.parametrize(
    ("weight", "block_size", "message"),
    [
        (torch.zeros(5), 128, "got 1-D shape (5,)"),
        (torch.zeros(2, 2, 2, 2), 128, "got 4-D"),
        (torch.zeros(4, 4), 0, "block_size must be a positive int, got 0"),
        (torch.zeros(4, 4), -128, "got -128"),
        (torch.zeros(4, 4), 1.5, "got 1.5"),
        (torch.zeros(4, 4), True, "got True"),
        (torch.zeros(4, 4, dtype=torch.int32), 128, "dtype=torch.int32"),
        ("not a tensor", 128, "got str"),
    ],
)
def test_bad_input_raises_naming_the_value(weight, block_size, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        quantize_fp8_block(weight, block_size)


def test_cpu_tensors_never_reach_the_kernel(monkeypatch):
    def no_kernel():
        raise AssertionError("the Triton kernel was built for a CPU tensor")

    monkeypatch.setattr(fp8_block, "_kernel", no_kernel)
    data, _ = quantize_fp8_block(random_weight((130, 130), torch.bfloat16), 128)
    assert data.device.type == "cpu"


def test_kernel_configs_and_config_check():
    assert kernel_configs(128)[0] == (32, 8) and (128, 16) in kernel_configs(128)
    assert kernel_configs(32)[0] == (32, 1)
    assert all(tile & (tile - 1) == 0 for tile, _ in kernel_configs(24))  # powers of two
    with pytest.raises(ValueError, match=r"got \(64, 3\)"):
        fp8_block._triton_quantize(torch.zeros(4, 4), 128, config=(64, 3))


# --- Triton interpreter: the kernel itself, on CPU -------------------------------------------------

_INTERPRETER_SCRIPT = """
import os, sys
import torch
assert os.environ.get("TRITON_INTERPRET") == "1"
from moe_rl.quant.fp8_block import _triton_quantize
import triton
cases = torch.load(sys.argv[1])
out = [_triton_quantize(c["weight"], c["block"], config=c["config"], reciprocal=c["cuda_rule"]) for c in cases]
torch.save({"triton": triton.__version__, "out": out}, sys.argv[2])
"""


def interpreter_cases() -> list[dict]:
    cases = [
        {"weight": special_weight(), "block": 128, "config": None},
        {"weight": special_weight(), "block": 128, "config": (16, 4)},  # the two-pass path
        {"weight": random_weight((200, 300), torch.bfloat16), "block": 128, "config": None},
        {"weight": random_weight((3, 130, 260), torch.float16), "block": 128, "config": None},
        {"weight": random_weight((300, 520), torch.bfloat16), "block": 256, "config": (32, 8)},
        {"weight": random_weight((100, 70), torch.bfloat16), "block": 32, "config": None},
        {"weight": random_weight((50, 40), torch.float32), "block": 24, "config": (8, 4)},
        {"weight": random_weight((50, 40), torch.float32), "block": 24, "config": (16, 4)},  # partial tiles
        {
            "weight": random_weight((260, 450), torch.bfloat16),
            "block": 200,
            "config": None,
        },  # 2 passes, partial
        {"weight": random_weight((384, 256), torch.bfloat16).t(), "block": 128, "config": None},
    ]
    cases[2]["weight"][128:, 256:] = 0  # a partial zero block in bf16
    for case in cases:
        case["cuda_rule"] = False
    # the scale rule the kernel follows on CUDA (amax * fl(1/448)), on the edge cases and a stack
    return cases + [{**cases[i], "cuda_rule": True} for i in (0, 1, 3)]


def test_triton_kernel_in_interpreter_matches_modelopt(tmp_path):
    triton = pytest.importorskip("triton")
    cases = interpreter_cases()
    torch.save(cases, tmp_path / "in.pt")
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": pythonpath}
    proc = subprocess.run(
        [sys.executable, "-c", _INTERPRETER_SCRIPT, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = torch.load(tmp_path / "out.pt")
    assert result["triton"] == triton.__version__ and len(result["out"]) == len(cases)
    for case, (data, scale) in zip(cases, result["out"]):
        assert_matches_modelopt(data, scale, case["weight"], case["block"], case["cuda_rule"])


# --- GPU: the Triton path on CUDA ------------------------------------------------------------------


def _cuda_weight(w: torch.Tensor) -> torch.Tensor:
    w = w.cuda()
    if not triton_path_available(w):
        pytest.skip(
            f"the Triton path needs Triton and an NVIDIA GPU of compute capability >= 9.0 "
            f"(this one: {torch.cuda.get_device_capability()})"
        )
    return w


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(7168, 2048), (2048, 7168), (8, 512, 384)])
def test_gpu_triton_path_is_modelopt_bit_for_bit(shape, monkeypatch):
    w = _cuda_weight(random_weight(shape, torch.bfloat16))

    def no_fallback(*args, **kwargs):
        raise AssertionError("quantize_fp8_block took the torch path on CUDA")

    monkeypatch.setattr(fp8_block, "torch_fp8_block", no_fallback)
    data, scale = quantize_fp8_block(w, 128)
    assert data.is_cuda and scale.is_cuda
    assert_matches_modelopt(data, scale, w, 128)  # ModelOpt on the GPU
    assert_matches_modelopt(data.cpu(), scale.cpu(), w.cpu(), 128, cuda_rule=True)  # its rule, on the CPU
    # the CPU's rule (division) in the kernel, on the GPU: ModelOpt's result on the CPU
    data, scale = fp8_block._triton_quantize(w, 128, reciprocal=False)
    assert_matches_modelopt(data.cpu(), scale.cpu(), w.cpu(), 128)


@pytest.mark.gpu
def test_gpu_every_config_and_edge_case():
    for case in interpreter_cases():
        if case["cuda_rule"]:
            continue  # every case runs with the CUDA rule here
        w = _cuda_weight(case["weight"])
        configs = kernel_configs(case["block"]) if case["config"] is None else [case["config"]]
        for config in configs:
            data, scale = fp8_block._triton_quantize(w, case["block"], config=config)
            assert_matches_modelopt(data, scale, w, case["block"])
