"""The preflight returns what it read, and a run that starts here takes its inputs from it, read
once (`moe_rl.orchestration.preflight.run_inputs`); the probe's prompt stream draws from those
prompts, seeded apart, without reading the dataset again."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from moe_rl.config import load_recipe
from moe_rl.orchestration import preflight
from moe_rl.rewards.registry import build_prompt_source

TINY = Path(__file__).resolve().parents[3] / "recipes" / "tiny_moe.yaml"


@pytest.fixture
def file_recipe(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(f'{{"prompt": "{i}+{i}=", "answer": "{2 * i}"}}\n' for i in range(6)))
    return load_recipe(TINY, [f"data.task=file:{data}", "model.vocab_size=320", "data.reward=exact_match"])


@pytest.fixture
def reads(monkeypatch):
    """Every `build_inputs` call the preflight makes, with what it built."""
    built = []
    real = preflight.build_inputs

    def counted(config):
        built.append(real(config))
        return built[-1]

    monkeypatch.setattr(preflight, "build_inputs", counted)
    return built


def test_a_run_takes_the_inputs_its_preflight_read_and_reads_them_once(file_recipe, reads):
    found = preflight.preflight(file_recipe)
    assert [section.component for section in found.sections][:2] == ["recipe", "inputs"]
    assert found.inputs is reads[0] and len(found.inputs.prompt_source.records) == 6
    reads.clear()
    inputs = preflight.run_inputs(file_recipe)
    assert len(reads) == 1 and inputs is reads[0]  # the check's, not built again


def test_a_recipe_that_reads_nothing_a_user_gave_gets_its_inputs_built_after_the_check(reads):
    config = load_recipe(TINY)
    assert preflight.preflight(config).inputs is None and not reads
    inputs = preflight.run_inputs(config)
    assert len(reads) == 1 and inputs is reads[0] and inputs.prompt_source.synthetic is not None


def test_refused_or_unread_inputs_come_back_as_none(file_recipe, tmp_path):
    assert preflight.preflight(file_recipe, paths=False).inputs is None  # left to the job's machines
    broken = load_recipe(TINY, [f"data.task=file:{tmp_path / 'missing.jsonl'}", "data.reward=exact_match"])
    found = preflight.preflight(broken)
    assert found.inputs is None and found.sections[1].broken is not None


def test_the_probe_stream_draws_the_same_prompts_seeded_apart_without_reading_the_file_again(file_recipe):
    source = build_prompt_source(file_recipe)
    before = source.state()
    probe = source.stream(1234)
    assert probe.records is source.records  # the records read once
    fresh = build_prompt_source(file_recipe)
    fresh.rng.seed(1234)
    assert probe.next_batch(8) == fresh.next_batch(8)
    assert source.state() == before  # the training stream is left where it was
    assert source.next_batch(3) == build_prompt_source(file_recipe).next_batch(3)


def test_an_operating_system_refusal_while_reading_is_one_line_and_any_other_error_is_raised(
    file_recipe, monkeypatch
):
    """A refusal of the machine's (a full disk, a permission) while the inputs are read is the
    rule's line, naming the file; an error that is not one is the project's to see, raised."""

    def refused(config):
        raise PermissionError(errno.EACCES, "Permission denied", "/data/prompts.jsonl")

    monkeypatch.setattr(preflight, "build_inputs", refused)
    rule, inputs = preflight._read_rule(file_recipe)
    assert (rule.ok, rule.detail, inputs) == (False, "/data/prompts.jsonl: permission denied", None)

    def broken(config):
        raise OSError(errno.EIO, "Input/output error", "/data/prompts.jsonl")

    monkeypatch.setattr(preflight, "build_inputs", broken)
    with pytest.raises(OSError, match="Input/output error"):
        preflight._read_rule(file_recipe)


def test_a_dataset_row_that_does_not_read_refuses_the_inputs_with_the_readers_line(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"question": "2+2="}\n')
    config = load_recipe(TINY, [f"data.task=file:{data}", "model.vocab_size=320", "data.reward=exact_match"])
    found = preflight.preflight(config)
    broken = found.sections[1].broken
    assert found.inputs is None and broken.name == "inputs read" and f"{data}: line 2" in broken.detail
