"""`moe-rl export` refuses bad input with one line each, before torch or Megatron load: a folder
that is not a run directory, a step without a checkpoint (the message lists the saved ones), a
damaged or unsealed checkpoint, a non-empty OUT without --force, a bad --shard-size. Without
--step it takes the newest checkpoint that verifies, as --resume does. (The export itself:
tests/e2e/test_export_to_vllm.py.)"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from launch import export
from launch.cli import main
from moe_rl.config import to_yaml
from moe_rl.errors import UserError
from moe_rl.orchestration.preflight import load_checked
from moe_rl.run_dir import write_manifest

TINY = Path(__file__).resolve().parents[3] / "recipes" / "tiny_moe.yaml"
SHARD = "trainer/__0_0.distcp"


def _checkpoint(run: Path, step: int) -> Path:
    ckpt = run / "checkpoints" / f"step_{step:06d}"
    (ckpt / "trainer").mkdir(parents=True)
    (ckpt / SHARD).write_bytes(bytes(range(256)) * 4)
    (ckpt / "driver.json").write_text("{}")
    write_manifest(ckpt)
    return ckpt


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """A run directory with the resolved tiny recipe and sealed checkpoints of steps 0 and 3."""
    run = tmp_path / "runs" / "tiny"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(to_yaml(load_checked(TINY)))
    for step in (0, 3):
        _checkpoint(run, step)
    return run


def _damage(ckpt: Path) -> None:
    data = bytearray((ckpt / SHARD).read_bytes())
    data[100] ^= 0xFF
    (ckpt / SHARD).write_bytes(bytes(data))


def _export(monkeypatch, caplog, *args: str) -> str:
    """`moe-rl export ARGS` in this process; returns its one error line (asserting there is one)."""
    monkeypatch.setattr(
        export, "_write_weights", lambda *a: pytest.fail("the export started despite bad input")
    )
    caplog.clear()
    with caplog.at_level(logging.ERROR):
        code = main(["export", *args])
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert code == 2 and len(errors) == 1, (code, errors)
    return errors[0]


def test_a_folder_without_config_yaml_is_not_a_run_directory(tmp_path, monkeypatch, caplog):
    (tmp_path / "checkpoints").mkdir()
    line = _export(monkeypatch, caplog, str(tmp_path), str(tmp_path.parent / "out"))
    assert line == f"{tmp_path} is not a run directory: it has no config.yaml (the resolved recipe of a run)"


def test_a_step_without_a_checkpoint_lists_the_saved_steps(run, tmp_path, monkeypatch, caplog):
    line = _export(monkeypatch, caplog, str(run), str(tmp_path / "out"), "--step", "7")
    assert line == f"--step 7: {run / 'checkpoints'} has no step_000007; steps saved: 0, 3"


def test_a_run_without_checkpoints_has_nothing_to_export(tmp_path, monkeypatch, caplog):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text(to_yaml(load_checked(TINY)))
    line = _export(monkeypatch, caplog, str(tmp_path / "run"), str(tmp_path / "out"))
    assert line.startswith(f"{tmp_path / 'run' / 'checkpoints'}: no checkpoint to export"), line


@pytest.mark.parametrize(
    ("spoil", "why"),
    [
        (_damage, f"{SHARD} does not match its checksum (damaged)"),
        (lambda c: (c / SHARD).write_bytes(b"cut"), f"{SHARD} has 3 bytes, the manifest says 1024"),
        (lambda c: (c / "manifest.json").unlink(), "no manifest.json (the save did not finish)"),
    ],
    ids=["damaged", "truncated", "unsealed"],
)
def test_a_checkpoint_that_fails_its_manifest_is_refused_by_name(
    run, tmp_path, monkeypatch, caplog, spoil, why
):
    ckpt = run / "checkpoints" / "step_000003"
    spoil(ckpt)
    line = _export(monkeypatch, caplog, str(run), str(tmp_path / "out"), "--step", "3")
    assert line == f"checkpoint {ckpt} is not usable: {why}"


def test_without_step_the_newest_usable_checkpoint_is_taken(run, caplog):
    assert export.pick_checkpoint(run, None).step == 3
    _damage(run / "checkpoints" / "step_000003")
    with caplog.at_level(logging.WARNING):
        chosen = export.pick_checkpoint(run, None)
    assert (chosen.step, chosen.path) == (0, run / "checkpoints" / "step_000000")
    newest = run / "checkpoints" / "step_000003"
    assert f"checkpoint {newest} is not usable ({SHARD} does not match its checksum" in caplog.text
    _damage(run / "checkpoints" / "step_000000")
    with pytest.raises(UserError, match=r"no usable checkpoint \(.*step_000003: .*; .*step_000000: "):
        export.pick_checkpoint(run, None)


def test_a_non_empty_out_needs_force(run, tmp_path, monkeypatch, caplog):
    out = tmp_path / "out"
    out.mkdir()
    export.check_out(out, run, force=False)  # empty: fine
    (out / "config.json").write_text("{}")
    line = _export(monkeypatch, caplog, str(run), str(out))
    assert line == f"OUT {out} is not empty; choose another folder or replace it with --force"
    export.check_out(out, run, force=True)
    for inside in (run, run.parent, run / "checkpoints" / "step_000003"):
        with pytest.raises(UserError, match="would replace the run directory"):
            export.check_out(inside, run, force=True)


def test_shard_size(run, tmp_path, monkeypatch, caplog):
    sizes = {"5GB": 5 * 10**9, "500MB": 5 * 10**8, "2GiB": 2 << 30, "1.5kb": 1500, "4096": 4096}
    assert {text: export.parse_size(text) for text in sizes} == sizes
    line = _export(monkeypatch, caplog, str(run), str(tmp_path / "out"), "--shard-size", "5 gigs")
    assert line.startswith("--shard-size '5 gigs': expected a positive size such as 5GB"), line


@pytest.mark.parametrize(
    ("recipe", "lora", "expected"),
    [
        ([], "adapter", "--lora adapter: run {run} trains full weights (lora.rank is 0); export it without --lora"),
        (
            ["lora.rank=4", "lora.train_router=true", "lora.train_output_layer=true"], "base",
            "--lora base: run {run} also trains weights whole (lora.train_router, lora.train_output_layer), which "
            "an adapter folder does not hold; export the merged model (--lora merged)",
        ),
    ],
    ids=["full-weights", "whole-weights-too"],
)  # fmt: skip
def test_an_adapter_or_base_export_needs_a_run_whose_training_is_all_in_its_adapters(
    run, tmp_path, monkeypatch, caplog, recipe, lora, expected
):
    (run / "config.yaml").write_text(to_yaml(load_checked(TINY, recipe)))
    line = _export(monkeypatch, caplog, str(run), str(tmp_path / "out"), "--lora", lora)
    assert line == expected.format(run=run)
