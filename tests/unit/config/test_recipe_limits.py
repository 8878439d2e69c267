"""A recipe cannot stall the loader, nor make an error line long: a file whose YAML aliases expand
it to ~10^8 values (an "alias bomb", a dozen lines of nested anchors) is refused as it is parsed,
with one line naming the file, the line and the key, wherever it is: the recipe body, a `defaults:`
piece or the `defaults:` list itself; a value that refers to itself likewise. Before, `config
check` built the expansion (the `defaults:` one printed half a gigabyte, ~20 s). Each command runs
in a process of its own under a deadline (`run_cli`'s timeout): a stall fails the test, no
wall-clock assert."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_rl.config import ConfigError, load_recipe
from moe_rl.config.loader import MAX_VALUES
from moe_rl.errors import BRIEF_CHARS, brief
from moe_rl.orchestration.preflight import load_checked
from tests.cli_testing import run_cli

RECIPES = Path(__file__).resolve().parents[3] / "recipes"
DEADLINE_S = 120  # the loader refuses in well under a second; building the expansion takes minutes


def _bomb(levels: int = 8, indent: str = "") -> str:
    """Anchors nested ``levels`` deep, each a list of ten uses of the one before: the last stands
    for ~10^levels values."""
    lines = [f"{indent}l0: &l0 [{', '.join(['x'] * 10)}]"]
    lines += [f"{indent}l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def _recipes(tmp_path: Path) -> Path:
    """A recipes folder beside the project's pieces (a user's own recipes compose them)."""
    folder = tmp_path / "recipes"
    folder.mkdir()
    for piece in ("model", "algo", "quant", "tiny_moe.yaml"):
        (folder / piece).symlink_to(RECIPES / piece)
    return folder


def _one_line(out) -> str:
    lines = [line for line in out.stderr.splitlines() if not line.startswith("heavy:")]
    lines += out.stdout.splitlines()
    assert out.returncode != 0 and len(lines) == 1, (out.returncode, lines[:5])
    assert "Traceback" not in lines[0] and len(lines[0]) < 600, lines[0][:1000]
    return lines[0]


def test_an_alias_bomb_in_the_recipe_body_is_refused_as_it_is_parsed(tmp_path):
    recipe = _recipes(tmp_path) / "bomb.yaml"
    recipe.write_text("defaults:\n  - tiny_moe\nenv:\n  kwargs:\n" + _bomb(indent="    "))
    out, heavy = run_cli("config", "check", str(recipe), timeout=DEADLINE_S)
    line = _one_line(out)
    assert f"{recipe}: line 9: `env.kwargs.l4` expands to 111,111 values" in line, line
    assert f"a recipe holds at most {MAX_VALUES:,}" in line and not heavy


def test_an_alias_bomb_in_a_defaults_piece_stops_train_before_anything_starts(tmp_path):
    folder = _recipes(tmp_path)
    (folder / "piece.yaml").write_text("run:\n  name: x\n" + _bomb())
    recipe = folder / "uses_piece.yaml"
    recipe.write_text("defaults:\n  - tiny_moe\n  - piece\n")
    out, heavy = run_cli("train", str(recipe), f"run.output_dir={tmp_path / 'runs'}", timeout=DEADLINE_S)
    line = _one_line(out)
    assert f"{folder / 'piece.yaml'}: line 7: `l4` expands to 111,111 values" in line, line
    assert out.returncode == 2 and not heavy and not (tmp_path / "runs").exists()


def test_an_alias_bomb_as_the_defaults_list_is_refused(tmp_path):
    recipe = _recipes(tmp_path) / "bomb.yaml"
    recipe.write_text(_bomb() + "defaults: *l7\n")
    line = _one_line(run_cli("config", "check", str(recipe), timeout=DEADLINE_S)[0])
    assert f"{recipe}: line 5: `l4` expands to 111,111 values" in line, line


def test_an_alias_bomb_in_an_override_is_refused():
    value = "{" + _bomb().replace("\n", ", ").rstrip(", ") + "}"
    out, _ = run_cli(
        "config", "show", str(RECIPES / "tiny_moe.yaml"), f"env.kwargs={value}", timeout=DEADLINE_S
    )
    line = _one_line(out)
    assert (
        "override `env.kwargs={l0: &l0 [x, x," in line and "line 1: `l4` expands to 111,111 values" in line
    ), line


def test_a_value_that_refers_to_itself_is_refused(tmp_path):
    recipe = _recipes(tmp_path) / "loop.yaml"
    recipe.write_text("defaults:\n  - tiny_moe\nenv:\n  kwargs:\n    a: &a [1, *a]\n")
    line = _one_line(run_cli("config", "check", str(recipe), timeout=DEADLINE_S)[0])
    assert f"{recipe}: line 5: a value refers to itself through a YAML alias" in line, line


def test_a_recipe_just_under_the_bound_loads(tmp_path):
    """The bound counts values as the aliases expand them: four levels (11,111 values) load whole."""
    recipe = _recipes(tmp_path) / "fine.yaml"
    recipe.write_text("defaults:\n  - tiny_moe\nenv:\n  kwargs:\n" + _bomb(levels=4, indent="    "))
    kwargs = load_recipe(recipe).env.kwargs
    assert len(kwargs["l3"]) == 10 and kwargs["l3"][9][9][9] == ["x"] * 10


LONG = "y" * 5000


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (f"rollout:\n  engine: {LONG}\n", "rollout.engine='yyy"),
        (f"run: {LONG}\n", "`run` is a section; expected a mapping, got 'yyy"),
        (f"rollout:\n  batch_size: {LONG}\n", "`rollout.batch_size` expects int: Value 'yyy"),
        (f"defaults: [{', '.join(['1'] * 5000)}]\n", "`defaults` must be a list of recipe piece names, got [1, 1,"),
        (f"{LONG[:1000]}: 1\n{LONG[:1000]}: 2\n", "line 4: `yyy"),
        (f"{LONG}: 1\n", "not valid YAML: line 3, column 5001: could not find expected ':' (while scanning a simple key)"),
    ],
    ids=["mode", "section", "int", "defaults", "duplicate-key", "key-too-long"],
)  # fmt: skip
def test_an_error_shows_a_long_value_only_in_part(tmp_path, body, expected):
    recipe = _recipes(tmp_path) / "long.yaml"
    recipe.write_text(body if body.startswith("defaults") else "defaults:\n  - tiny_moe\n" + body)
    with pytest.raises(ConfigError) as info:
        load_recipe(recipe)
    message = str(info.value)
    assert expected in message and len(message) < 2 * BRIEF_CHARS + len(str(recipe)) + 120, message[:600]


def test_brief_cuts_a_value_and_says_how_long_it_was():
    assert brief("abc") == "'abc'"
    text = brief(LONG)
    assert text.endswith("(5000 characters)") and len(text) < BRIEF_CHARS + 30
    assert brief(list(range(10_000))) == "[0, 1, 2, 3, 4, 5, 6, 7, ...]"


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (f"run.name={LONG}/x", "run.name='yyy"),
        (f"cluster.time={LONG}", "cluster.time='yyy"),
        (f"rollout.quant={LONG}", "rollout.quant: no quantization recipe `yyy"),
        (f"data.task=file:{LONG}", "data.task=file:yyy"),
        (f"model.hf_path={LONG}", "model.hf_path=yyy"),
    ],
    ids=["run-name", "slurm-time", "quant-recipe", "dataset-path", "model-path"],
)
def test_a_long_value_given_on_the_command_line_is_one_short_line(override, expected):
    """The recipe's checks and the preflight's (a path too long to look up is said so, no
    traceback) show a long value only in part."""
    with pytest.raises(ConfigError) as info:
        load_checked(RECIPES / "tiny_moe.yaml", [override])
    message = str(info.value)
    assert message.startswith(expected) and "\n" not in message and len(message) < 500, message[:600]


def test_config_check_takes_an_override_longer_than_a_file_name():
    """`config check` tells recipes from overrides by looking for a file of that name: an override no
    file system takes as a name is an override, not a traceback."""
    out, _ = run_cli("config", "check", "recipes/tiny_moe.yaml", f"run.name={'x' * 300}", timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("OK    recipes/tiny_moe.yaml"), out.stderr[-2000:]


def test_the_bound_holds_exactly_max_values_and_refuses_one_more():
    """Counted by hand: ``a`` (99 scalars) is 100 values, ``b`` (998 uses of ``a``) 1 + 99,800, ``c``
    (k scalars) 1 + k, each key 1 and the mapping 1: 99,906 + k in all. k = 94 is exactly
    `MAX_VALUES` and composes; k = 95 is refused, the whole file named (no key alone is too big)."""
    import yaml

    from moe_rl.config.loader import TooManyValues, _YamlLoader

    assert MAX_VALUES == 100_000

    def doc(k: int) -> str:
        return (
            f"a: &a [{', '.join(['x'] * 99)}]\nb: [{', '.join(['*a'] * 998)}]\nc: [{', '.join(['x'] * k)}]\n"
        )

    assert yaml.compose(doc(94), Loader=_YamlLoader) is not None
    with pytest.raises(TooManyValues) as err:
        yaml.compose(doc(95), Loader=_YamlLoader)
    assert str(err.value) == (
        "line 1: the file expands to 100,001 values with its YAML aliases followed; a recipe holds at most 100,000"
    )


def test_a_key_at_exactly_the_bound_is_not_named_one_past_it_is():
    """The deepest key named is one that alone is past `MAX_VALUES`: ``b`` (999 uses of ``a``'s 100
    values and 99 scalars) holds exactly 100,000, so the file is named; one scalar more and ``b`` is."""
    import yaml

    from moe_rl.config.loader import TooManyValues, _YamlLoader

    def doc(extra: int) -> str:
        return f"a: &a [{', '.join(['x'] * 99)}]\nb: [{', '.join(['*a'] * 999 + ['x'] * extra)}]\n"

    for extra, named in ((99, "the file expands to 100,103"), (100, "`b` expands to 100,001")):
        with pytest.raises(TooManyValues) as err:
            yaml.compose(doc(extra), Loader=_YamlLoader)
        assert str(err.value).startswith(f"line {1 if extra == 99 else 2}: {named} values"), str(err.value)


def test_a_yaml_error_without_a_place_or_a_problem_is_told_in_its_own_words():
    """PyYAML's errors name a place and a problem; one that lacks either is its own message on one line."""
    import yaml

    from moe_rl.config.loader import _yaml_problem

    mark = yaml.Mark("recipe", 0, 2, 4, None, None)
    assert _yaml_problem(yaml.MarkedYAMLError("while parsing", mark, "found a tab", mark)) == (
        "line 3, column 5: found a tab (while parsing)"
    )
    placeless = yaml.MarkedYAMLError("while parsing", None, "found a tab", None)
    assert _yaml_problem(placeless) == "while parsing found a tab"
    unnamed = yaml.MarkedYAMLError(None, None, None, mark, "a note")
    assert _yaml_problem(unnamed) == ' in "recipe", line 3, column 5 a note'.strip()
