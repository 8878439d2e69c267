"""Modes are typed: every choice field of a recipe holds a member of its mode, the loader refuses
any other value naming the field, and no code compares a mode with a string."""

from __future__ import annotations

import ast
import dataclasses
import re
from enum import Enum, StrEnum
from pathlib import Path

import pytest

from moe_rl.algo.modes import KLEstimator, TISMode
from moe_rl.config import ConfigError, load_recipe, to_yaml
from moe_rl.config.loader import recipes_root
from moe_rl.config.modes import ExpertGemm, RunMode, choice_fields
from moe_rl.config.schema import CHOICES

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "recipes" / "tiny_moe.yaml"

MODE_FIELDS = {path.rsplit(".", 1)[-1] for path in CHOICES} | {
    "run_device",
    "divergence",
    "estimator",
    "gemm",
}
"""Attribute and argument names that hold a mode (the schema's choice fields and their parameters)."""
SPELLINGS = {member.value for mode in CHOICES.values() for member in mode}


def _get(obj, path: str):
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def test_every_choice_field_holds_a_member_of_its_mode():
    config = load_recipe(TINY)
    for path, mode in CHOICES.items():
        value = _get(config, path)
        assert isinstance(value, mode), (path, value)


def _modes_held(section, prefix: str = "") -> dict[str, type[Enum]]:
    """The fields of a loaded recipe whose value is an enum member, by path (read from the
    values, not from the types `choice_fields` reads)."""
    found: dict[str, type[Enum]] = {}
    for field in dataclasses.fields(section):
        value, path = getattr(section, field.name), f"{prefix}{field.name}"
        if dataclasses.is_dataclass(value):
            found |= _modes_held(value, f"{path}.")
        elif isinstance(value, Enum):
            found[path] = type(value)
    return found


def test_the_choices_are_every_field_that_holds_a_mode():
    assert _modes_held(load_recipe(TINY)) == CHOICES
    assert CHOICES["trainer.expert_gemm"] is ExpertGemm


class Plain(Enum):
    A = "a"


@dataclasses.dataclass
class Inner:
    gemm: ExpertGemm | None = None
    count: int = 0


@dataclasses.dataclass
class Outer:
    inner: Inner = dataclasses.field(default_factory=Inner)
    mode: RunMode = RunMode.SYNC


@dataclasses.dataclass
class WithPlainEnum:
    plain: Plain = Plain.A


def test_choice_fields_reads_optional_modes_and_refuses_a_plain_enum():
    assert choice_fields(Outer) == {"inner.gemm": ExpertGemm, "mode": RunMode}
    with pytest.raises(TypeError, match=r"^plain: Plain is an Enum; a choice field's mode is a StrEnum$"):
        choice_fields(WithPlainEnum)


def test_a_value_outside_the_mode_is_refused_naming_the_field_and_the_valid_values():
    with pytest.raises(ConfigError, match=r"^algo.routing_replay='r4' is not one of: off, r2, r3$"):
        load_recipe(TINY, ["algo.routing_replay=r4"])
    with pytest.raises(ConfigError, match=r"^run.mode='3' is not one of: sync, async, offline$"):
        load_recipe(TINY, ["run.mode=3"])


@pytest.mark.parametrize(
    ("field", "spelling", "member", "valid"),
    [
        ("run.mode", "async", RunMode.ASYNC, "sync, async, offline"),
        ("algo.kl.estimator", "k1", KLEstimator.K1, "k1, k2, k3, abs, k3_is"),
        ("algo.corrections.tis.mode", "token", TISMode.TOKEN, "off, token, seq"),
        ("trainer.expert_gemm", "torch", ExpertGemm.TORCH, "auto, te, torch, sequential"),
    ],
)
def test_every_nesting_depth_takes_the_recipe_spelling_only(field, spelling, member, valid):
    """One rule at every depth: the value as recipes spell it is its member; the member's name
    (the value in capitals) and any other value are refused with the same one line."""
    assert _get(load_recipe(TINY, [f"{field}={spelling}"]), field) is member
    for bad in (spelling.upper(), "k9"):
        with pytest.raises(ConfigError, match=rf"^{re.escape(f'{field}={bad!r} is not one of: {valid}')}$"):
            load_recipe(TINY, [f"{field}={bad}"])


@pytest.mark.parametrize("field", sorted(CHOICES))
def test_every_choice_field_refuses_another_spelling_in_one_line(field):
    """The other case of a valid value (which OmegaConf would take as the member's name) is refused
    as every wrong value is, for every choice field."""
    mode = CHOICES[field]
    valid = ", ".join(member.value for member in mode)
    for bad in (next(iter(mode)).value.swapcase(), "k9"):
        with pytest.raises(ConfigError, match=rf"^{re.escape(f'{field}={bad!r} is not one of: {valid}')}$"):
            load_recipe(TINY, [f"{field}={bad}"])


def test_a_recipe_with_every_mode_changed_round_trips(tmp_path):
    """What `to_yaml` writes loads back to the same recipe with every choice field away from its
    default (the loader, not OmegaConf, reads each spelling)."""
    config = load_recipe(TINY, [f"{path}={list(mode)[-1].value}" for path, mode in CHOICES.items()])
    root = tmp_path / "recipes"
    root.mkdir()
    (root / "quant").symlink_to(recipes_root(TINY) / "quant")
    (root / "resolved.yaml").write_text(to_yaml(config))
    again = load_recipe(root / "resolved.yaml")
    assert again == config
    assert all(_get(again, path) is list(mode)[-1] for path, mode in CHOICES.items())


def test_the_resolved_recipe_spells_modes_as_recipes_do():
    text = to_yaml(load_recipe(TINY, ["run.mode=async"]))
    assert "  mode: async\n" in text and "routing_replay: r3\n" in text and "RunMode" not in text


def test_modes_are_spelled_as_their_values_in_capitals():
    for mode in CHOICES.values():
        assert issubclass(mode, StrEnum)
        assert all(member.name == member.value.upper() for member in mode), mode


def _mode_name(node: ast.AST) -> str | None:
    """The name a compared expression holds a mode under: an attribute or a variable (``device``
    only as ``<...>.run.device``: elsewhere it is torch's device type)."""
    if isinstance(node, ast.Attribute):
        if node.attr == "device":
            return "device" if isinstance(node.value, ast.Attribute) and node.value.attr == "run" else None
        return node.attr
    if isinstance(node, ast.Name) and node.id != "device":
        return node.id
    return None


def _string_comparisons(source: str) -> list[int]:
    """The lines of ``x.routing_replay == "r3"``-like comparisons (a mode-holding name against a
    mode's spelling)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        names = {_mode_name(s) for s in sides}
        strings = [s.value for s in sides if isinstance(s, ast.Constant) and isinstance(s.value, str)]
        for s in sides:  # `x.mode in ("sync", "async")`
            if isinstance(s, ast.Tuple | ast.List | ast.Set):
                strings += [
                    e.value for e in s.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)
                ]
        if names & MODE_FIELDS and set(strings) & SPELLINGS:
            found.append(node.lineno)
    return found


def test_no_code_compares_a_mode_with_a_string():
    files = [*sorted((REPO / "moe_rl").rglob("*.py")), *sorted((REPO / "launch").rglob("*.py"))]
    hits = [f"{f.relative_to(REPO)}:{line}" for f in files for line in _string_comparisons(f.read_text())]
    assert hits == []


@pytest.mark.parametrize("field", sorted(CHOICES))
def test_the_scan_sees_every_choice_field_compared_with_a_string(field):
    value = next(iter(CHOICES[field])).value
    source = f"if config.{field} == {value!r}:\n    pass\nok = config.{field} in ({value!r},)\n"
    assert _string_comparisons(source) == [1, 3]


def test_the_scan_sees_a_grouped_gemm_argument_compared_with_a_string():
    assert _string_comparisons('if gemm == "torch":\n    pass\n') == [1]
