"""Recipe loading, validation and the `moe-rl config` command."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from moe_rl.config import ConfigError, load_recipe, to_yaml
from moe_rl.config.loader import recipes_root
from moe_rl.orchestration.preflight import load_checked
from tests.cli_testing import run_cli

REPO = Path(__file__).resolve().parents[3]
RECIPES = REPO / "recipes"
TINY = RECIPES / "tiny_moe.yaml"
ALL_YAML = sorted(RECIPES.rglob("*.yaml"))


def test_config_imports_without_heavy_libraries():
    code = textwrap.dedent(
        """
        import sys
        import moe_rl.config
        from moe_rl.config import load_recipe
        from moe_rl.orchestration.preflight import load_checked
        load_recipe("recipes/tiny_moe.yaml")
        load_checked("recipes/tiny_moe.yaml")
        heavy = sorted(m for m in ("torch", "vllm", "megatron", "modelopt", "ray", "transformers")
                       if m in sys.modules)
        print(",".join(heavy))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"moe_rl.config imported {out.stdout.strip()}"


@pytest.mark.parametrize("path", ALL_YAML, ids=[str(p.relative_to(RECIPES)) for p in ALL_YAML])
def test_every_recipe_yaml_loads(path: Path, tmp_path: Path):
    if path.parent.name == "quant":  # nvfp4 needs CUDA: load it for a CUDA machine
        config = load_checked(TINY, [f"rollout.quant={path.stem}", "run.device=cuda"])
        assert config.quant.name == path.stem
    elif path.parent in (RECIPES, RECIPES / "twins", RECIPES / "examples", RECIPES / "bench"):
        config = load_checked(path, paths=False)  # a runnable recipe (its dataset aside: not carried here)
    else:  # a piece (model/, algo/, cluster/): keys and types only; alone it is no whole recipe
        config = load_recipe(path)
    # the resolved YAML loads back to the same config
    root = tmp_path / "recipes"
    root.mkdir()
    (root / "quant").symlink_to(recipes_root(path) / "quant")
    (root / "resolved.yaml").write_text(to_yaml(config))
    if path.parent == RECIPES / "cluster":
        assert load_recipe(root / "resolved.yaml") == config
    else:
        assert load_checked(root / "resolved.yaml", paths=False) == config


def test_layers_and_overrides_take_precedence():
    config = load_checked(TINY, ["algo.objective=espo", "trainer.lr=2e-6", "quant.block_size=64"])
    assert config.algo.objective == "espo"
    assert config.trainer.lr == pytest.approx(2e-6)
    assert config.model.num_experts == 8  # from the model piece
    assert config.algo.routing_replay == "r3"  # from the algo piece
    assert config.quant.method == "fp8" and config.quant.block_size == 64  # quant file, then override


def test_quant_recipe_switch_is_one_override():
    assert load_checked(TINY, ["rollout.quant=bf16"]).quant.method == "none"
    assert load_checked(TINY, ["rollout.quant=int4_awq"]).quant.method == "int4_awq"


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        pytest.param(["trainer.lrr=1"], "did you mean `trainer.lr`", id="misspelt-key"),
        pytest.param(["lr=1"], "did you mean `critic.lr` or `trainer.lr`", id="key-without-section"),
        pytest.param(["algo.corrections.icepop.hgh=3"], "algo.corrections.icepop.high", id="nested-key"),
        # nothing close in its own section: a key of that name elsewhere, a close one (every section that
        # holds it), then the closest whole path
        pytest.param(["run.dgo_betaa=1"], "`run.dgo_betaa`; did you mean `algo.dgo_beta`? (valid", id="leaf"),
        pytest.param(
            ["run.tensor_parallel=2"],
            "`run.tensor_parallel`; did you mean `rollout.tensor_parallel_size`? (valid",
            id="close-leaf",
        ),
        pytest.param(
            ["data.lrr=1"], "`data.lrr`; did you mean `critic.lr` or `trainer.lr`? (valid", id="leaves"
        ),
        pytest.param(
            ["run.model_init_from=x"],
            "`run.model_init_from`; did you mean `model.init_from`? (valid",
            id="closest-path",
        ),
        pytest.param(["trainer.lr=abc"], "`trainer.lr` expects float", id="wrong-type"),
        pytest.param(["rollout.batch_size=1.5"], "`rollout.batch_size` expects int", id="float-for-int"),
        pytest.param(["algo.objective=ppo"], "algo.objective='ppo' is not one of", id="bad-choice"),
        pytest.param(["rollout.quant=fp9"], "no quantization recipe `fp9`", id="unknown-quant"),
        pytest.param(
            ["trainer.compute_entropy=false"], "trainer.compute_entropy=true", id="espo-needs-entropy"
        ),
        pytest.param(["rollout.group_size=7"], "divisible by rollout.group_size=7", id="batch-vs-group"),
        pytest.param(["trainer.num_mini_batches=3"], "trainer.num_mini_batches=3", id="batch-vs-minibatch"),
        pytest.param(["trainer.moe_router_fusion=true"], "moe_router_fusion", id="fusion-with-replay"),
        pytest.param(
            ["rollout.engine=vllm", "run.device=cpu"], "rollout.engine=megatron", id="vllm-cpu-capabilities"
        ),
        pytest.param(["algo.corrections.icepop.low=6"], "low < high", id="icepop-band"),
        pytest.param(["model.moe_router_topk=9"], "model.moe_router_topk=9", id="topk-over-experts"),
        pytest.param(["parallel.expert_model_parallel_size=3"], "expert_model_parallel_size=3", id="ep"),
        pytest.param(["quant.name=int8"], "switch recipes with rollout.quant", id="quant-name-direct"),
        pytest.param(["rollout.max_new_tokens=200"], "max_position_embeddings", id="too-long"),
        pytest.param(["model.moe_router_num_groups=4"], "set together", id="group-routing-pair"),
        pytest.param(
            ["model.rope_scaling_type=ntk"], "model.rope_scaling_type='ntk' is not one of", id="rope"
        ),
        pytest.param(["model.rope_scaling_type=yarn"], "yarn needs model.attention=mla", id="yarn-needs-mla"),
        pytest.param(["trainer.lr"], "section.key=value", id="override-without-value"),
        pytest.param(["trainer..lr=1"], "override `trainer..lr=1` is not of the form", id="empty-part"),
        # nothing close anywhere: no hint; an unknown section at the top level
        pytest.param(["run.zzqqxx=1"], "unknown key `run.zzqqxx` (valid keys in run: ", id="no-hint"),
        pytest.param(
            ["zzqqxx=1"], "unknown key `zzqqxx` (valid keys in the top level: algo, ", id="top-level"
        ),
        # a section given as null is skipped; the keys after it are still checked
        pytest.param(
            ["critic=null", "trainer.lrr=1"], "unknown key `trainer.lrr`; did you mean", id="after-null"
        ),
    ],
)
def test_bad_config_names_the_field(overrides, expected):
    with pytest.raises(ConfigError, match=None) as info:
        load_checked(TINY, overrides)
    assert expected in str(info.value)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["model.rope_scaling_factor=0"], "model.rope_scaling_factor=0.0 must be > 0"),
        (["model.rope_original_max_position_embeddings=null"], "rope_original_max_position_embeddings=None"),
        (["model.rope_beta_fast=0"], "model.rope_beta_fast=0.0 must be > 0"),
        (["model.rope_mscale=0.8", "model.rope_mscale_all_dim=0"], "model.rope_mscale=0.8"),
    ],
)
def test_bad_yarn_fields_are_named(overrides, expected):
    twin = RECIPES / "twins" / "deepseek_v3.yaml"
    assert load_checked(twin).model.rope_scaling_type == "yarn"
    with pytest.raises(ConfigError, match=None) as info:
        load_checked(twin, overrides)
    assert expected in str(info.value)


def test_unknown_key_in_a_file_names_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  lrr: 1.0\n")
    with pytest.raises(
        ConfigError, match=r"bad\.yaml: unknown key `trainer\.lrr`; did you mean `trainer\.lr`"
    ):
        load_checked(bad)


def test_defaults_cycle_is_an_error(tmp_path):
    (tmp_path / "a.yaml").write_text("defaults: [b]\n")
    (tmp_path / "b.yaml").write_text("defaults: [a]\n")
    (tmp_path / "quant").mkdir()
    (tmp_path / "quant" / "bf16.yaml").write_text("quant: {name: bf16}\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_checked(tmp_path / "a.yaml")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "launch.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=60
    )


def test_cli_config_show_prints_yaml():
    import yaml

    out = _cli("config", "show", "recipes/tiny_moe.yaml", "algo.objective=espo")
    assert out.returncode == 0, out.stderr
    data = yaml.safe_load(out.stdout)
    assert data["algo"]["objective"] == "espo"
    assert data["quant"]["name"] == "fp8_block128"


def test_cli_misspelt_key_fails_fast_naming_the_key():
    out, heavy = run_cli("config", "show", "recipes/tiny_moe.yaml", "trainer.lrr=1")
    assert out.returncode != 0
    assert "trainer.lr" in out.stderr
    assert not heavy, f"a bad recipe imported {heavy} before it failed"


def test_cli_config_check_reports_each_recipe():
    out = _cli("config", "check", "recipes/tiny_moe.yaml")
    assert out.returncode == 0 and out.stdout.startswith("OK")


@pytest.mark.parametrize(
    "override",
    ["trainer.compute_entropy=false", "rollout.group_size=7"],
    ids=["espo-without-entropy", "batch-not-divisible-by-group"],
)
def test_cli_train_rejects_bad_config_before_anything_heavy_starts(override, tmp_path):
    out, heavy = run_cli("train", "recipes/tiny_moe.yaml", override, f"run.output_dir={tmp_path}")
    assert out.returncode == 2, out.stderr
    assert override.split("=")[0] in out.stderr
    assert not heavy, f"a bad config imported {heavy} before it failed"
    assert not list(tmp_path.iterdir()), "a run directory was created for a bad config"


@pytest.mark.parametrize("word", ["off", "on", "yes", "no"])
def test_yaml_words_that_are_not_booleans_stay_strings(word, tmp_path):
    config = load_checked(TINY, [f"run.name={word}", "algo.routing_replay=off"])
    assert config.run.name == word and config.algo.routing_replay == "off"
    recipe = tmp_path / "recipes" / "r.yaml"
    recipe.parent.mkdir()
    (recipe.parent / "quant").symlink_to(RECIPES / "quant")
    recipe.write_text(f"run:\n  name: {word}\nalgo:\n  routing_replay: off\n")
    assert load_checked(recipe).algo.routing_replay == "off"
    assert load_checked(TINY, ["trainer.compute_entropy=true"]).trainer.compute_entropy is True


@pytest.mark.parametrize(
    ("overrides", "refusal"),
    [
        (["rollout.group_size=1", "algo.advantage=gae"], None),
        (["rollout.group_size=1", "algo.advantage=reinforce_pp"], None),
        (["rollout.group_size=1", "algo.advantage=reinforce_pp_baseline"], "compares each response"),
        (["rollout.group_size=1"], "compares each response"),
        (["algo.kl.coef=0.1", "algo.kl.in_reward=true"], "algo.kl.in_reward=true with algo.advantage=grpo"),
        (["algo.advantage=reinforce_pp", "algo.kl.in_reward=true"], "coefficient > 0"),
        (
            [
                "algo.advantage=reinforce_pp",
                "algo.kl.coef=0.1",
                "algo.kl.in_reward=true",
                "algo.kl.estimator=k3_is",
            ],
            "k3_is weighs by π_θ/π_old",
        ),
        (["algo.advantage=gae", "algo.dynamic_sampling=true"], "act on groups of equal rewards"),
        (["algo.advantage=gae", "critic.init=checkpoint"], "a checkpoint is named exactly when"),
        (["algo.advantage=gae", "algo.gae.lam=1.5"], "algo.gae.lam=1.5 must be in [0, 1]"),
        (["critic.lr=1e-4"], "critic.lr=0.0001 with algo.advantage=grpo: a critic trains only with"),
        (
            ["algo.advantage=reinforce_pp", "critic.warmup_steps=2"],
            "a critic trains only with algo.advantage=gae",
        ),
        (["algo.distill.coef=0.5"], "distillation needs a teacher"),
        (["teacher.path=runs/x"], "distillation needs a teacher"),
    ],
)
def test_token_level_estimators_critic_and_teacher_rules(overrides, refusal):
    """The recipe's rules on the token-level estimators, the critic and the teacher: one line each."""
    if refusal is None:
        assert load_checked(TINY, overrides).rollout.group_size == 1
        return
    with pytest.raises(ConfigError, match=re.escape(refusal)):
        load_checked(TINY, overrides)


TP2 = ("parallel.tensor_model_parallel_size=2", "parallel.trainer_world_size=2")


@pytest.mark.parametrize(
    ("overrides", "refusal"),
    [
        (["lora.rank=8", "lora.targets=[attention,experts]", "lora.dropout=0.1"], None),
        (["lora.rank=8", *TP2], None),
        (["lora.alpha=32"], "lora.alpha=32.0 with lora.rank=0: adapters exist only with lora.rank > 0"),
        (["lora.rank=-1"], "lora.rank=-1 must be >= 0"),
        (["lora.rank=8", "lora.dropout=1.0"], "lora.dropout=1.0 must be in [0, 1)"),
        (["lora.rank=8", "lora.targets=[]"], "lora.rank=8 with lora.targets=[]: name the linears"),
        (["lora.rank=8", "lora.targets=[experts,experts]"], "names a target twice"),
        (
            ["lora.rank=8", "lora.targets=[router]"],
            "lora.targets='router' is not one of: attention, dense_mlp",
        ),
        (["lora.rank=8", *TP2, "parallel.sequence_parallel=true"], None),  # the adapters follow its regions
        (["lora.rank=8", *TP2, "parallel.expert_tensor_parallel_size=2"], "expert_tensor_parallel_size=2"),
        (
            ["lora.rank=8", "lora.targets=[attention]", *TP2, "parallel.expert_tensor_parallel_size=2"],
            None,
        ),
    ],
)
def test_lora_rules(overrides, refusal):
    """The recipe's and the trainer's LoRA rules, one line each naming the field and value."""
    from moe_rl.trainer.rules import check_trainer

    if refusal is None:
        check_trainer(load_checked(TINY, overrides))
        return
    with pytest.raises((ConfigError, ValueError), match=re.escape(refusal)):
        check_trainer(load_checked(TINY, overrides))


def test_a_recipe_folder_without_quantization_recipes_says_none_are_available(tmp_path):
    recipes = tmp_path / "recipes"
    (recipes / "quant").mkdir(parents=True)
    (recipes / "r.yaml").write_text("rollout:\n  quant: fp8x\n")
    with pytest.raises(ConfigError) as info:
        load_recipe(recipes / "r.yaml")
    assert str(info.value).endswith(f"no quantization recipe `fp8x` in {recipes / 'quant'} (available: none)")
