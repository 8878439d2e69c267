"""`moe-rl diagnose` on the tiny MoE with the Megatron engine: the bf16 engine matches the
trainer exactly, fp8_block128 does not; R3 makes the routing used agree with the engine's and
lowers the KL; nvfp4 runs on CUDA and is "not available", with the reason, on the CPU. The
mismatch budget splits each recipe's KL into routing and precision (top_p=1: no truncation)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
from matplotlib import image

from launch.cli import main

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("device")]

TINY = str(Path(__file__).resolve().parents[2] / "recipes" / "tiny_moe.yaml")


@pytest.fixture(scope="module")
def diagnosed(tmp_path_factory):
    out = tmp_path_factory.mktemp("diagnose") / "diagnose.json"
    terminal = io.StringIO()
    args = ["--json", str(out), "--budget-png", str(out.with_suffix(".png"))]
    with contextlib.redirect_stdout(terminal):
        code = main(["diagnose", TINY, "--quant", "bf16,fp8_block128,nvfp4", "--prompts", "8", *args])
    assert code == 0
    data = json.loads(out.read_text())
    return {r["quant"]: r for r in data["recipes"]}, data, terminal.getvalue(), out.with_suffix(".png")


def test_bf16_engine_matches_the_trainer_exactly(diagnosed):
    bf16 = diagnosed[0]["bf16"]
    assert bf16["weights"]["quant/rel_err"] == 0.0
    for mode in ("plain", "ksm", "r3", "r3+ksm"):
        m = bf16["modes"][mode]
        assert m["kl_k3"] <= 1e-9 and abs(m["kl_k1"]) < 1e-6 and m["prob_abs_diff_max"] < 1e-6, mode
        assert m["routing_agreement"] == 1.0 and m["icepop_masked_frac"] == 0.0
    assert bf16["configured_mode"] == "r3+ksm"
    assert "negligible" in [v["code"] for v in bf16["verdicts"]]


def test_fp8_block128_mismatch_and_what_r3_does(diagnosed):
    bf16, fp8 = diagnosed[0]["bf16"], diagnosed[0]["fp8_block128"]
    assert fp8["weights"]["quant/num_quantized"] > 0 and fp8["weights"]["quant/rel_err"] > 0.005
    plain, r3 = fp8["modes"]["plain"], fp8["modes"]["r3"]
    assert plain["kl_k3"] > bf16["modes"]["plain"]["kl_k3"] + 1e-7
    assert plain["routing_agreement"] < 1.0 and plain["routing_agreement_natural"] < 1.0
    assert r3["routing_agreement"] == 1.0  # the routing the trainer used is the engine's
    assert r3["routing_agreement_natural"] == plain["routing_agreement"]  # its routers still disagree
    assert r3["kl_k3"] < plain["kl_k3"]
    assert fp8["modes"]["r3+ksm"]["kl_k3"] < fp8["modes"]["ksm"]["kl_k3"]


def test_nvfp4_runs_on_cuda_and_is_not_available_on_cpu(diagnosed, device):
    nvfp4 = diagnosed[0]["nvfp4"]
    if device.type == "cpu":
        assert nvfp4["unavailable"].startswith("not available: ") and "CUDA" in nvfp4["unavailable"]
        assert nvfp4["modes"] == {} and nvfp4["verdicts"] == []
        return
    assert not nvfp4.get("unavailable") and nvfp4["device"] == "cuda"
    assert nvfp4["weights"]["quant/num_quantized"] > 0
    bf16 = diagnosed[0]["bf16"]["modes"]["plain"]["kl_k3"]
    assert nvfp4["modes"]["plain"]["kl_k3"] > bf16 + 1e-7


def test_terminal_table_and_verdicts(diagnosed):
    text = diagnosed[2]
    assert "Mismatch" in text and "Masked shares" in text and "R3+KSM *" in text
    assert "fp8_block128 (trains as R3+KSM):" in text
    refused = "not available: engine: rollout.engine=megatron on cpu cannot run rollout.quant=nvfp4"
    assert (refused in " ".join(text.split())) == (not diagnosed[1]["recipes"][2]["modes"])  # lines wrap


def test_report_json_header(diagnosed):
    data = diagnosed[1]
    assert (data["engine"], data["num_prompts"], data["responses_per_prompt"]) == ("megatron", 8, 8)
    assert data["recipes"][0]["counts"]["responses"] == 64


def test_mismatch_budget(diagnosed):
    """bf16: nothing to split. fp8_block128: the KL without R3 is routing (what R3 removes) plus
    precision (what remains); top_p=1 truncates nothing and the zero-update test has no staleness."""
    bf16, fp8 = diagnosed[0]["bf16"]["budget"], diagnosed[0]["fp8_block128"]["budget"]
    assert bf16["routing"] == 0.0 and bf16["precision"] <= 1e-9
    for budget in (bf16, fp8):
        assert budget["truncation"].startswith("not available: rollout.top_p=1 and rollout.top_k=-1")
        assert budget["staleness"].startswith("not available: zero-update test")
    modes = diagnosed[0]["fp8_block128"]["modes"]
    assert (
        fp8["routing"] == pytest.approx(modes["plain"]["kl_k3"] - modes["r3"]["kl_k3"]) and fp8["routing"] > 0
    )
    assert fp8["precision"] == modes["r3"]["kl_k3"] > 0
    assert fp8["same_weights"] == pytest.approx(modes["plain"]["kl_k3"])
    assert "budget" not in diagnosed[0]["nvfp4"] or diagnosed[0]["nvfp4"]["budget"]["precision"] > 0
    assert "Mismatch budget" in diagnosed[2] and "routing (R3 removes)" in diagnosed[2]
    height, width = image.imread(diagnosed[3]).shape[:2]
    assert diagnosed[3].stat().st_size > 10_000 and width >= 600 and height >= 400
