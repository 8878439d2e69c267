"""Bad recipe values: each is refused by the one validation entry (`load_recipe`) with one line
naming the field, the value and what would be valid, before anything computes with it; every
command that takes a recipe refuses it the same way."""

from __future__ import annotations

import logging
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from launch.cli import main
from launch.submit import SlurmArgs, render_script, resolve, sbatch_options
from moe_rl.config import ConfigError, load_recipe
from moe_rl.config.validate import FLOATS, RANGES, UNBOUNDED
from moe_rl.orchestration.preflight import load_checked

REPO = Path(__file__).resolve().parents[3]
RECIPES = REPO / "recipes"
TINY = RECIPES / "tiny_moe.yaml"
PARALLEL_SIZES = [
    "trainer_world_size",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "context_parallel_size",
]
NAME = "must be a plain folder name inside run.output_dir (no `/` or `\\`; not empty, `.` or `..`)"

BAD = [
    *[(f"parallel.{size}=0", f"parallel.{size}=0 must be > 0") for size in PARALLEL_SIZES],
    (
        "parallel.virtual_pipeline_model_parallel_size=0",
        "trainer: no virtual pipeline stages: parallel.virtual_pipeline_model_parallel_size=0",
    ),
    ("model.num_key_value_heads=0", "model.num_key_value_heads=0 must be > 0"),
    ("model.num_attention_heads=0", "model.num_attention_heads=0 must be > 0"),
    ("model.head_dim=0", "model.head_dim=0 must be > 0"),
    ("model.vocab_size=0", "model.vocab_size=0 must be > 0"),
    ("model.moe_ffn_hidden_size=0", "model.moe_ffn_hidden_size=0 must be > 0"),
    ("model.num_experts=-1", "model.num_experts=-1 must be >= 0"),
    ("model.moe_router_topk=0", "model.moe_router_topk=0 must be in [1, model.num_experts=8]"),
    ("model.moe_router_num_groups=0", "model.moe_router_num_groups=0 must be null or > 0"),
    ("model.kv_lora_rank=0", "model.kv_lora_rank=0 must be > 0"),
    ("model.max_position_embeddings=0", "model.max_position_embeddings=0 must be > 0"),
    ("model.rms_norm_eps=0", "model.rms_norm_eps=0.0 must be > 0"),
    ("model.rope_theta=.inf", "model.rope_theta=inf must be a finite number"),
    ("model.eos_token_id=16", "model.eos_token_id=16 must be null or a token id in [0, model.vocab_size=16)"),
    ("rollout.batch_size=0", "rollout.batch_size=0 must be > 0"),
    ("rollout.group_size=0", "rollout.group_size=0 must be > 0"),
    ("rollout.max_new_tokens=0", "rollout.max_new_tokens=0 must be > 0"),
    ("rollout.num_engines=0", "rollout.num_engines=0 must be > 0"),
    ("rollout.tensor_parallel_size=0", "rollout.tensor_parallel_size=0 must be > 0"),
    ("rollout.sync_bucket_mb=0", "rollout.sync_bucket_mb=0 must be > 0"),
    ("rollout.max_model_len=0", "rollout.max_model_len=0 must be > 0"),
    ("rollout.gpu_memory_utilization=0", "rollout.gpu_memory_utilization=0.0 must be in (0, 1]"),
    ("rollout.temperature=.inf", "rollout.temperature=inf must be a finite number"),
    ("rollout.temperature=.nan", "rollout.temperature=nan must be a finite number"),
    ("rollout.temperature=-1", "rollout.temperature=-1.0 must be > 0"),
    ("rollout.top_p=.nan", "rollout.top_p=nan must be a finite number"),
    ("quant.block_size=0", "quant.block_size=0 must be > 0"),
    ("trainer.lr=.nan", "trainer.lr=nan must be a finite number"),
    ("trainer.lr=.inf", "trainer.lr=inf must be a finite number"),
    ("trainer.lr=-1e-6", "trainer.lr=-1e-06 must be > 0"),
    ("trainer.min_lr=1", "trainer.min_lr=1.0 must be <= trainer.lr=0.005"),
    ("trainer.adam_beta2=1", "trainer.adam_beta2=1.0 must be in [0, 1)"),
    ("trainer.grad_clip=-1", "trainer.grad_clip=-1.0 must be >= 0"),
    ("trainer.num_mini_batches=0", "trainer.num_mini_batches=0 must be > 0"),
    ("trainer.max_tokens_per_microbatch=0", "trainer.max_tokens_per_microbatch=0 must be > 0"),
    ("trainer.logprob_chunk_size=0", "trainer.logprob_chunk_size=0 must be > 0"),
    ("algo.dgo_beta=0", "algo.dgo_beta=0.0 must be > 0"),
    ("algo.clip_eps_high=.nan", "algo.clip_eps_high=nan must be a finite number"),
    ("algo.corrections.tis.cap=.nan", "algo.corrections.tis.cap=nan must be a number (.inf or -.inf: no"),
    ("data.max_prompt_len=0", "data.max_prompt_len=0 must be > 0"),
    ("cluster.nodes=0", "cluster.nodes=0 must be > 0"),
    ("cluster.trainer_nodes=0", "cluster.trainer_nodes=0 must be > 0"),
    ("cluster.gpus_per_node=-1", "cluster.gpus_per_node=-1 must be >= 0"),
    ("cluster.ray_port=0", "cluster.ray_port=0 must be a TCP port in [1, 65535]"),
    ("cluster.gpu_memory_gib=0", "cluster.gpu_memory_gib=0.0 must be > 0"),
    ("run.steps=-3", "run.steps=-3 must be > 0"),
    ("run.steps=0", "run.steps=0 must be > 0"),
    ("run.checkpoint_every=-1", "run.checkpoint_every=-1 must be >= 0"),
    ("run.seed=-1", "run.seed=-1 must be >= 0"),
    ("run.max_staleness=-1", "run.max_staleness=-1 must be >= 0"),
    ("run.async_depth=0", "run.async_depth=0 must be > 0"),
    ("logging.diagnose_every=-1", "logging.diagnose_every=-1 must be >= 0"),
    ("run.name=../../../esc", f"run.name='../../../esc' {NAME}"),
    ("run.name=/tmp/abs", f"run.name='/tmp/abs' {NAME}"),
    ("run.name=..", f"run.name='..' {NAME}"),
    ("run.name=''", f"run.name='' {NAME}"),
    ("run.name=a\\b", f"run.name='a\\\\b' {NAME}"),
    ("run.name=x%j%N", "run.name='x%j%N' must not contain `%`: sbatch and srun expand %j, %N, ..."),
    ("run.name='a\tb'", "run.name='a\\tb' contains a control character"),
    ("cluster.time=99:99:99", "cluster.time='99:99:99': 99 is not below 60 in its place"),
    ("cluster.time=2-25", "cluster.time='2-25': 25 is not below 24 in its place"),
    ("cluster.time=soon", "cluster.time='soon' is not a Slurm time limit; use minutes, MM:SS, HH:MM:SS"),
    (
        "rollout.group_size=1",
        "rollout.group_size=1: algo.advantage=grpo compares each response with the others",
    ),
    *[
        (f"data.task='{task}'", f"data.task={task!r}: expected `synthetic:<task>` or `file:<path>`")
        for task in ("count_up", "synthetic:", "file:", "files:a.jsonl", ":count_up")
    ],
]


@pytest.mark.parametrize(("override", "expected"), BAD, ids=[o for o, _ in BAD])
def test_bad_value_is_refused_with_one_line_naming_it(override, expected):
    with pytest.raises(ConfigError) as info:
        load_checked(TINY, [override])
    message = str(info.value)
    assert expected in message
    assert "\n" not in message


@pytest.mark.parametrize(("override", "expected"), BAD[:6], ids=[o for o, _ in BAD[:6]])
def test_field_values_are_checked_without_full_validation(override, expected):
    """`validate=False` (a recipe piece, `moe-rl plan`) still refuses values nothing can compute with."""
    with pytest.raises(ConfigError, match=None) as info:
        load_recipe(TINY, [override])
    assert expected in str(info.value)


@pytest.mark.parametrize(
    "override",
    [
        "algo.corrections.tis.cap=.inf",
        "algo.corrections.icepop.high=.inf",
        "algo.corrections.rejection.low=-.inf",
        "algo.corrections.rejection.high=.inf",
    ],
)
def test_an_infinite_bound_is_no_bound(override):
    load_checked(TINY, [override])


def test_every_float_field_is_checked_and_every_range_names_a_field():
    config = load_checked(TINY)
    assert set(UNBOUNDED) <= set(FLOATS)
    assert {"trainer.lr", "rollout.temperature", "model.rope_theta", "cluster.gpu_memory_gib"} <= set(FLOATS)
    for path in RANGES:
        obj = config
        for part in path.split("."):
            obj = getattr(obj, part)


def _recipes(tmp_path: Path) -> Path:
    """A recipes folder whose pieces are the shipped ones."""
    root = tmp_path / "recipes"
    root.mkdir()
    for entry in RECIPES.iterdir():
        (root / entry.name).symlink_to(entry)
    return root


def test_a_recipe_that_is_not_utf8_is_named_with_the_offset(tmp_path):
    bad = _recipes(tmp_path) / "latin1.yaml"
    text = "run:\n  name: caf\xe9\n"
    bad.write_bytes(text.encode("latin-1"))
    with pytest.raises(ConfigError) as info:
        load_checked(bad)
    offset = text.index("\xe9")
    assert (
        str(info.value) == f"{bad.resolve()}: not UTF-8 text (byte 0xe9 at offset {offset}); save it as UTF-8"
    )


def test_an_async_run_that_would_reject_every_batch_is_refused():
    with pytest.raises(
        ConfigError, match="run.mode=async with run.max_staleness=0: every batch is generated"
    ):
        load_checked(TINY, ["run.mode=async", "run.max_staleness=0"])
    with pytest.raises(
        ConfigError, match=r"run.async_depth=3 > run.max_staleness=2: every batch is generated 3"
    ):
        load_checked(TINY, ["run.mode=async", "run.max_staleness=2", "run.async_depth=3"])
    with pytest.raises(ConfigError, match="run.async_depth=2 with run.mode=sync: only an async run"):
        load_checked(TINY, ["run.async_depth=2"])
    with pytest.raises(ConfigError, match="rollout.inflight_updates=true with run.mode=sync: weights change"):
        load_checked(TINY, ["rollout.inflight_updates=true"])
    with pytest.raises(ConfigError, match="rollout.inflight_updates=true with rollout.engine=vllm: only the"):
        load_checked(TINY, ["rollout.inflight_updates=true", "run.mode=async", "rollout.engine=vllm"])


def test_a_key_given_twice_is_refused_with_its_lines(tmp_path):
    """YAML keeps the last of two equal keys silently: a second `rollout:` section would replace the
    whole first one. Refused, naming the file, the key and both lines, top-level or nested."""
    root = _recipes(tmp_path)
    twice = root / "twice.yaml"
    twice.write_text(
        "defaults: [tiny_moe]\nrollout:\n  quant: fp8_block128\nrun:\n  steps: 2\nrollout:\n  batch_size: 32\n"
    )
    with pytest.raises(ConfigError) as info:
        load_checked(twice)
    assert (
        str(info.value)
        == f"{twice.resolve()} line 6: `rollout` is given twice (first at line 2); give each key once"
    )
    nested = root / "nested.yaml"
    nested.write_text("defaults: [tiny_moe]\nrun:\n  steps: 2\n  seed: 1\n  steps: 3\n")
    with pytest.raises(ConfigError, match="line 5: `steps` is given twice \\(first at line 3\\)"):
        load_checked(nested)


@pytest.mark.parametrize(
    "text", ["", "\n\n", "# only a comment\n", "---\n"], ids=["empty", "blank", "comment", "document-marker"]
)
def test_an_empty_recipe_is_refused(tmp_path, text):
    empty = _recipes(tmp_path) / "empty.yaml"
    empty.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_checked(empty)
    assert str(info.value) == f"recipe {empty.resolve()} is empty"


def test_an_empty_piece_adds_nothing_and_an_empty_quant_recipe_is_refused(tmp_path):
    root = _recipes(tmp_path)
    (root / "placeholder.yaml").write_text("# nothing to add yet\n")
    recipe = root / "r.yaml"
    recipe.write_text("defaults: [tiny_moe, placeholder]\n")
    assert load_checked(recipe) == load_checked(TINY)
    (root / "quant").unlink()
    (root / "quant").mkdir()
    (root / "quant" / "bf16.yaml").write_text("# forgot the section\n")
    with pytest.raises(ConfigError, match=r"quantization recipe .*bf16\.yaml is empty"):
        load_checked(recipe, ["rollout.quant=bf16"])


def _main(argv: list[str], caplog) -> tuple[int, list[str]]:
    caplog.clear()
    with caplog.at_level(logging.ERROR):
        code = main(argv)
    return code, [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


AGREE = [
    ("parallel.tensor_model_parallel_size=0", "parallel.tensor_model_parallel_size=0 must be > 0"),
    ("model.num_key_value_heads=0", "model.num_key_value_heads=0 must be > 0"),
    ("trainer.lr=.nan", "trainer.lr=nan must be a finite number"),
    ("run.name=x%j%N", "run.name='x%j%N' must not contain `%`"),
]


@pytest.mark.parametrize(("override", "expected"), AGREE, ids=[o for o, _ in AGREE])
def test_every_command_refuses_the_same_way(override, expected, tmp_path, caplog, capsys, monkeypatch):
    import launch.train

    def past_validation(*_):
        raise AssertionError("train went past validation")

    monkeypatch.setattr(launch.train, "RunLock", past_validation)
    out = f"run.output_dir={tmp_path / 'runs'}"
    errors = {}
    for command in (["config", "show"], ["plan"], ["submit", "--dry-run"], ["train"]):
        code, messages = _main([*command, str(TINY), override, out], caplog)
        assert code == 2 and len(messages) == 1, (command, code, messages)
        errors[command[0]] = messages[0]
    assert len(set(errors.values())) == 1 and expected in errors["train"], errors
    assert not (tmp_path / "runs").exists()
    key, _, value = override.partition("=")
    section, field = key.split(".")
    recipe = _recipes(tmp_path) / "bad.yaml"
    recipe.write_text(f"defaults: [tiny_moe]\n{section}:\n  {field}: {value}\n")
    capsys.readouterr()
    assert main(["config", "check", str(recipe)]) == 1
    assert capsys.readouterr().out == f"FAIL  {recipe}: {errors['train']}\n"


@pytest.mark.parametrize(
    "override",
    ["parallel.tensor_model_parallel_size=0", "model.num_key_value_heads=0", "run.name=../../../esc"],
)
def test_cli_config_show_prints_one_line_and_no_traceback(override):
    out = subprocess.run(
        [sys.executable, "-m", "launch.cli", "config", "show", str(TINY), override],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert override.partition("=")[0] in lines[0]


CPU = SlurmArgs(nodes=1, gpus_per_node=0)


def test_a_percent_in_the_output_dir_reaches_the_log_patterns_doubled(tmp_path):
    config = resolve(str(TINY), [f"run.output_dir={tmp_path / '100%j'}"], CPU)
    logs = tmp_path / "100%j" / "tiny_moe" / "logs"
    pattern = str(logs).replace("%", "%%")
    assert f"#SBATCH --output={shlex.quote(pattern + '/%x-%j.out')}" in sbatch_options(config, tmp_path)
    script = render_script(config, tmp_path)
    assignments = [line for line in script.splitlines() if line.startswith(("LOG_DIR=", "LOG_PATTERN="))]
    shell = "\n".join([*assignments, 'printf "%s\\n%s" "$LOG_DIR" "$LOG_PATTERN"'])
    out = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == [str(logs), pattern]
    sruns = [line for line in script.splitlines() if "--output=" in line and not line.startswith("#SBATCH")]
    assert len(sruns) == 2 and all('--output="${LOG_PATTERN}/%x-%j-node%n.log"' in line for line in sruns)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["cluster.extra_sbatch=['--output=/x/%j.out']"], "moe-rl submit sets --output itself"),
        (["cluster.extra_sbatch=['-e/x/%j.err']"], "moe-rl submit sets -e itself"),
        (["run.output_dir=/tmp/a\\b"], "run.output_dir='/tmp/a\\\\b' contains `\\`"),
    ],
)
def test_submit_refuses_values_that_would_break_the_log_paths(overrides, expected):
    with pytest.raises(ConfigError) as info:
        resolve(str(TINY), overrides, CPU)
    assert expected in str(info.value)


def test_data_task_is_read_once_into_its_kind_and_name():
    from moe_rl.config.modes import TaskKind, TaskSource

    config = load_recipe(TINY, ["data.task=file:data/a:b.jsonl"])
    source = config.data.source
    assert source == TaskSource(TaskKind.FILE, "data/a:b.jsonl") and source.is_file
    assert config.data.source is source and str(source) == "file:data/a:b.jsonl"
    synthetic = TaskSource.parse("synthetic:count_up")
    assert (synthetic.kind, synthetic.name, synthetic.is_file) == (TaskKind.SYNTHETIC, "count_up", False)
    with pytest.raises(AttributeError):  # read once, never changed
        synthetic.name = "other"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("recipe", "override", "mode"),
    [("tiny_moe.yaml", "algo.objective=sft", "sync"), ("tiny_moe.yaml", "algo.objective=dgo", "sync"),
     ("tiny_moe_dgo.yaml", "algo.objective=ppo_clip", "offline")],
)  # fmt: skip
def test_the_offline_objectives_and_the_offline_mode_go_together(recipe, override, mode):
    objective = override.split("=")[1]
    with pytest.raises(ConfigError, match=rf"algo.objective={objective} with run.mode={mode}: DGO and SFT are the "
                       "offline objectives"):  # fmt: skip
        load_checked(RECIPES / recipe, [override, "algo.aggregation=token_mean"])


def test_an_offline_recipe_trains_sft_when_asked():
    sft = load_checked(RECIPES / "tiny_moe_dgo.yaml", ["algo.objective=sft"])
    assert sft.algo.objective == "sft" and sft.run.mode == "offline"
