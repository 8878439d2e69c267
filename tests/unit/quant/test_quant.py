"""Rollout quantization recipes through ModelOpt (CPU)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from moe_rl.orchestration.preflight import load_checked
from moe_rl.quant.fp8_block import quantize_fp8_block
from moe_rl.quant.recipes import (
    FP8_E4M3_MAX,
    QuantReport,
    WeightQuantizer,
    check_quant_supported,
    should_quantize,
)

TINY = Path(__file__).resolve().parents[3] / "recipes" / "tiny_moe.yaml"


def quant_cfg(name: str):
    return load_checked(TINY, [f"rollout.quant={name}"]).quant


def named_weights(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("model.embed_tokens.weight", torch.randn(64, 256, generator=g)),
        ("model.layers.0.mlp.gate.weight", torch.randn(8, 256, generator=g)),
        ("model.layers.0.mlp.experts.0.up_proj.weight", torch.randn(256, 256, generator=g) * 0.02),
        ("model.layers.0.input_layernorm.weight", torch.ones(256)),
        ("model.layers.1.self_attn.q_proj.weight", torch.randn(384, 256, generator=g) * 0.02),
        ("decoder.layers.1.mlp.router.weight", torch.randn(8, 256, generator=g)),
        ("lm_head.weight", torch.randn(64, 256, generator=g)),
    ]


def quantize(name: str, **overrides):
    cfg = replace(quant_cfg(name), **overrides)
    report = QuantReport(cfg.name)
    out = dict(WeightQuantizer(cfg, num_layers=2).fake_quantize(named_weights(), report))
    return out, report


@pytest.mark.parametrize("recipe", ["fp8_block128", "fp8_tensor", "int8", "int4_awq"])
def test_excluded_tensors_are_sent_bit_exact(recipe):
    out, report = quantize(recipe)
    original = dict(named_weights())
    for name in (
        "model.embed_tokens.weight",
        "model.layers.0.mlp.gate.weight",
        "decoder.layers.1.mlp.router.weight",
        "lm_head.weight",
        "model.layers.0.input_layernorm.weight",
    ):
        assert torch.equal(out[name], original[name]), name
    assert report.num_quantized == 2 and report.num_kept == 5


@pytest.mark.parametrize(
    ("recipe", "low", "high"),
    [
        ("fp8_block128", 0.005, 0.05),
        ("fp8_tensor", 0.005, 0.05),
        ("int8", 1e-4, 0.02),
        ("int4_awq", 0.03, 0.3),
    ],
)
def test_quantization_error_is_real_and_bounded(recipe, low, high):
    out, report = quantize(recipe)
    original = dict(named_weights())
    name = "model.layers.0.mlp.experts.0.up_proj.weight"
    assert not torch.equal(out[name], original[name])
    assert low < report.rel_err < high
    assert report.per_tensor[name] == pytest.approx(
        float((out[name] - original[name]).norm() / original[name].norm()), rel=1e-4
    )


def test_error_grows_as_bits_shrink():
    errs = {r: quantize(r)[1].rel_err for r in ("int8", "fp8_block128", "int4_awq")}
    assert errs["int8"] < errs["fp8_block128"] < errs["int4_awq"]


def test_first_and_last_layer_exclusion():
    out, _report = quantize("fp8_block128", exclude_first_layers=1)
    original = dict(named_weights())
    assert torch.equal(
        out["model.layers.0.mlp.experts.0.up_proj.weight"],
        original["model.layers.0.mlp.experts.0.up_proj.weight"],
    )
    assert not torch.equal(
        out["model.layers.1.self_attn.q_proj.weight"], original["model.layers.1.self_attn.q_proj.weight"]
    )
    out, _ = quantize("fp8_block128", exclude_last_layers=1)
    assert torch.equal(
        out["model.layers.1.self_attn.q_proj.weight"], original["model.layers.1.self_attn.q_proj.weight"]
    )


def test_bf16_recipe_sends_everything_unchanged():
    out, report = quantize("bf16")
    assert all(torch.equal(out[n], t) for n, t in named_weights())
    assert report.num_quantized == 0 and report.summary()["quant/compression"] == 1.0


def test_fp8_block_real_layout_matches_fake_quantization():
    w = torch.randn(300, 200) * 0.05  # ragged blocks at both edges
    data, scale = quantize_fp8_block(w, 128)
    assert data.dtype == torch.float8_e4m3fn and data.shape == w.shape
    assert scale.shape == (3, 2) and scale.dtype == torch.float32
    # scale is the block amax over the e4m3 range
    assert scale[0, 0] == pytest.approx(float(w[:128, :128].abs().max()) / FP8_E4M3_MAX, rel=1e-5)
    deq = data.float() * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:300, :200]
    fake = WeightQuantizer(quant_cfg("fp8_block128"), num_layers=2)._qdq(w)
    torch.testing.assert_close(deq, fake, rtol=1e-6, atol=1e-7)


def test_nvfp4_needs_cuda():
    with pytest.raises(ValueError, match="needs a CUDA GPU.*fp8_block128"):
        check_quant_supported(quant_cfg("nvfp4"), cuda=False)
    check_quant_supported(quant_cfg("fp8_block128"), cuda=False)


def test_should_quantize_skips_vectors_and_integers():
    cfg = quant_cfg("fp8_block128")
    assert not should_quantize("x.layers.0.bias", torch.zeros(4), cfg, 2)
    assert not should_quantize("x.layers.0.w", torch.zeros(4, 4, dtype=torch.int32), cfg, 2)
    assert should_quantize("x.layers.0.w", torch.zeros(4, 4), cfg, 2)
