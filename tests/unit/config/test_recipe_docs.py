"""`docs/recipes.md` is generated from the schema's field docstrings and stays equal to it."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path

from launch.cli import main
from moe_rl.config.docs import (
    REGENERATE,
    default_text,
    field_docs,
    missing_docs,
    render_recipe_docs,
    type_text,
)
from moe_rl.config.schema import RecipeConfig

REPO = Path(__file__).resolve().parents[3]
RECIPES_MD = REPO / "docs" / "recipes.md"


@dataclass
class _Documented:
    count: int = 3
    """How many."""
    names: list[str] = field(default_factory=lambda: ["a"])
    """Names,
    on two lines."""
    undocumented: float | None = None
    after: bool = True
    """After a field without a docstring."""


def _leaf_keys(cls: type = RecipeConfig, prefix: str = "") -> list[str]:
    hints = typing.get_type_hints(cls)
    keys: list[str] = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            keys += _leaf_keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


def test_every_schema_field_has_a_docstring():
    assert missing_docs() == [], "document these fields with a string literal under each in schema.py"


def test_field_docs_reads_the_string_under_each_field():
    assert field_docs(_Documented) == {
        "count": "How many.",
        "names": "Names, on two lines.",
        "after": "After a field without a docstring.",
    }
    assert missing_docs(_Documented) == ["undocumented"]


def test_types_and_defaults_read_as_in_yaml():
    hints = typing.get_type_hints(_Documented)
    assert [type_text(hints[n]) for n in ("count", "names", "undocumented")] == [
        "int",
        "list[str]",
        "float or null",
    ]
    assert [default_text(v) for v in (None, True, 3e-4, "sync", [], ["*a*", "b"])] == [
        "`null`",
        "`true`",
        "`0.0003`",
        "`sync`",
        "`[]`",
        '`["*a*", "b"]`',
    ]


def test_every_key_is_in_the_reference():
    text = render_recipe_docs()
    absent = [key for key in _leaf_keys() if f"| `{key}` |" not in text]
    assert absent == []


def test_recipes_md_equals_the_generated_reference():
    assert RECIPES_MD.read_text() == render_recipe_docs(), (
        f"docs/recipes.md is out of date with moe_rl/config/schema.py; regenerate it: {REGENERATE}"
    )


def test_cli_config_docs_prints_the_reference(capsys):
    assert main(["config", "docs"]) == 0
    assert capsys.readouterr().out == render_recipe_docs()
