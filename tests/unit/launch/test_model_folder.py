"""`model.hf_path` is read for what it holds before anything starts: a Hugging Face folder of an
architecture the trainer does not convert (a real Llama folder, written by transformers) or a
``*.safetensors`` file that is not one is refused by `config check`, `plan` and `train` with the
same line, naming the architecture and the supported ones. Before, `config check` said OK and
`train` ended in a 61-line traceback once Ray and the model were up."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="`moe-rl train` runs on Ray")

from launch.cli import main
from moe_rl.config.modes import Family
from moe_rl.megatron.rules import HF_ARCHITECTURES

RECIPES = Path(__file__).resolve().parents[3] / "recipes"
TINY = str(RECIPES / "tiny_moe.yaml")
SUPPORTED = (
    "the trainer converts Qwen3MoeForCausalLM (model.family=qwen3_moe), DeepseekV3ForCausalLM "
    "(model.family=deepseek_v3)"
)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """A real Llama checkpoint folder, as transformers writes it: config.json and model.safetensors."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("llama")
    config = transformers.LlamaConfig(
        vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    return folder


def _qwen3_named(llama: Path, tmp_path: Path, weights: bytes | None) -> Path:
    """The Llama folder with a config.json naming Qwen3-MoE and, given ``weights``, a
    model.safetensors holding those bytes."""
    folder = tmp_path / "model"
    shutil.copytree(llama, folder)
    hf_config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(hf_config | {"architectures": ["Qwen3MoeForCausalLM"]}))
    if weights is not None:
        (folder / "model.safetensors").write_bytes(weights)
    return folder


def _refusals(tmp_path: Path, capsys, caplog, monkeypatch, folder: Path) -> list[str]:
    """The line each of `config check`, `plan` and `train` refuses ``folder`` by, in that order."""
    import ray

    override = f"model.hf_path={folder}"
    lines = []
    assert main(["config", "check", TINY, override]) == 1
    lines.append(capsys.readouterr().out.strip().removeprefix(f"FAIL  {TINY}: "))
    assert main(["plan", TINY, override]) == 1
    verdict = " ".join(capsys.readouterr().out.split("FAIL: model checkpoint (")[-1].split())
    lines.append(verdict.removesuffix(")"))
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray started despite a bad model folder"))
    caplog.clear()
    with caplog.at_level(logging.ERROR):
        code = main(["train", TINY, override, f"run.output_dir={tmp_path / 'runs'}"])
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert code == 2 and len(errors) == 1, (code, errors)
    lines.append(errors[0])
    assert not (tmp_path / "runs").exists()  # refused before the run directory was made
    return lines


def test_a_llama_folder_is_refused_by_check_plan_and_train_alike(
    tmp_path, capsys, caplog, monkeypatch, llama
):
    line = (
        f"model.hf_path={llama}: config.json names LlamaForCausalLM: {SUPPORTED}; model.family=qwen3_moe "
        "needs Qwen3MoeForCausalLM"
    )
    assert _refusals(tmp_path, capsys, caplog, monkeypatch, llama) == [line] * 3


@pytest.mark.parametrize(
    ("weights", "problem"),
    [
        (b"not a safetensors file\n", "header too large"),
        (b"", "header too small"),
        (b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all", "invalid"),
    ],
    ids=["text", "empty", "header-not-json"],
)
def test_a_safetensors_file_that_is_not_one_is_refused_alike(
    tmp_path, capsys, caplog, monkeypatch, llama, weights, problem
):
    folder = _qwen3_named(llama, tmp_path, weights)
    lines = _refusals(tmp_path, capsys, caplog, monkeypatch, folder)
    assert lines[0] == lines[1] == lines[2], lines
    prefix = f"model.hf_path={folder}: model.safetensors is not a safetensors file ("
    assert lines[0].startswith(prefix) and problem in lines[0].lower(), lines[0]


def test_a_folder_of_the_other_family_names_what_the_recipe_needs(tmp_path, llama):
    from moe_rl.config import load_recipe
    from moe_rl.megatron.rules import checkpoint_rule

    folder = _qwen3_named(llama, tmp_path, None)
    model = load_recipe(str(RECIPES / "deepseek_v3.yaml")).model
    rule = checkpoint_rule(model, folder)
    assert rule.broken and rule.detail == (
        f"model.hf_path={folder}: config.json names Qwen3MoeForCausalLM: {SUPPORTED}; "
        "model.family=deepseek_v3 needs DeepseekV3ForCausalLM"
    )
    assert checkpoint_rule(load_recipe(TINY).model, folder).ok  # the header of a real file reads


def test_the_architectures_written_are_the_ones_read():
    """`model_config_to_hf_config` writes, for each family, the architecture the rule accepts."""
    from moe_rl.config import load_recipe
    from moe_rl.megatron.model import model_config_to_hf_config

    for recipe, family in (("tiny_moe.yaml", Family.QWEN3_MOE), ("deepseek_v3.yaml", Family.DEEPSEEK_V3)):
        model = load_recipe(str(RECIPES / recipe)).model
        assert model_config_to_hf_config(model)["architectures"] == [HF_ARCHITECTURES[family]]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            '{"model_type": "llama"}',
            "config.json names no architecture (model_type=llama): the trainer converts",
        ),
        ("{not json", "config.json is not JSON (Expecting property name enclosed in double quotes"),
    ],
    ids=["no-architectures", "not-json"],
)
def test_a_config_json_without_a_readable_architecture_is_refused(tmp_path, text, expected):
    from moe_rl.config import load_recipe
    from moe_rl.megatron.rules import checkpoint_rule

    (tmp_path / "config.json").write_text(text)
    rule = checkpoint_rule(load_recipe(TINY).model, tmp_path)
    assert rule.broken and rule.detail.startswith(f"model.hf_path={tmp_path}: {expected}"), rule.detail
