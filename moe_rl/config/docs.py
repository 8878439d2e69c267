"""The recipe reference, `docs/recipes.md`, rendered from the dataclasses of `moe_rl.config.schema`.

Every schema field carries its documentation as the string literal right under it (an attribute
docstring). Python keeps no trace of such literals at run time, so `field_docs` reads them from the
class's source with `ast`: inside the class body, a string expression that directly follows an
annotated assignment documents that field. `render_recipe_docs` walks `RecipeConfig` with
`dataclasses.fields` and writes one markdown table per section (key, type, default, meaning); a
nested dataclass (``algo.kl``, ``algo.corrections.tis``, ...) gets a table of its own.

`moe-rl config docs` prints the result; a unit test keeps `docs/recipes.md` equal to it. Imports
nothing heavy.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import inspect
import itertools
import textwrap
import types
import typing
from typing import Any

from moe_rl.config.schema import RecipeConfig

REGENERATE = ".venv/bin/moe-rl config docs > docs/recipes.md"
"""The command that rewrites `docs/recipes.md` (named in the file and in the test's message)."""

_INTRO = """\
Every key a recipe may set, section by section, with its type, its default (the value a recipe
gets when neither the recipe, its `defaults:` pieces nor the command line sets it) and what it
does. Recipes are YAML files that mirror these sections one to one; a key is written
`section.key` on the command line (`trainer.lr=2e-6`) and nested under its section in YAML.
Unknown keys, values of the wrong type and values outside a key's choices are errors when a recipe
loads; the cross-field checks and every component's rules run in the preflight that `plan`,
`config check`, `submit` and `train` share (README, "Recipes"). The algorithms behind the `algo` keys, with their formulas and
papers: [algorithms.md](algorithms.md)."""


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of dataclass ``cls``: field name -> text (cleaned, one line)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    node = tree.body[0]
    assert isinstance(node, ast.ClassDef) and node.name == cls.__name__, node
    docs: dict[str, str] = {}
    for stmt, after in itertools.pairwise(node.body):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return docs


def missing_docs(cls: type = RecipeConfig, prefix: str = "") -> list[str]:
    """Dotted keys of the fields (nested sections included) without a non-empty docstring."""
    docs, hints = field_docs(cls), typing.get_type_hints(cls)
    missing: list[str] = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        if not docs.get(f.name):
            missing.append(key)
        if _is_section(hints[f.name]):
            missing += missing_docs(hints[f.name], f"{key}.")
    return missing


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def type_text(tp: Any) -> str:
    """A field's type in recipe terms: ``int``, ``list[str]``, ``float or null``."""
    if tp is type(None):
        return "null"
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = sorted(typing.get_args(tp), key=lambda a: a is type(None))
        return " or ".join(type_text(a) for a in args)
    if typing.get_origin(tp) is list:
        (item,) = typing.get_args(tp)
        return f"list[{type_text(item)}]"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):  # a mode: its values
        return "one of " + ", ".join(f"`{member.value}`" for member in tp)
    return getattr(tp, "__name__", str(tp))


def default_value(f: dataclasses.Field) -> Any:
    """The field's default (a factory is called)."""
    if f.default is not dataclasses.MISSING:
        return f.default
    assert f.default_factory is not dataclasses.MISSING, f"{f.name} has no default"
    return f.default_factory()


def default_text(value: Any) -> str:
    """A default as YAML would spell it: ``true``, ``null``, ``0.0003``, ``[]``."""
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, list):
        return "`[" + ", ".join(f'"{v}"' if isinstance(v, str) else repr(v) for v in value) + "]`"
    return f"`{value}`"


def _cell(text: str) -> str:
    """Text safe inside a markdown table cell (GitHub: a pipe must be escaped, also in code)."""
    return text.replace("|", "\\|")


def _section(cls: type, key: str, title_doc: str) -> list[str]:
    """The table of one section and, after it, those of its nested sections."""
    docs, hints = field_docs(cls), typing.get_type_hints(cls)
    heading = "##" if "." not in key else "###"
    lines = [f"{heading} `{key}`", "", title_doc, ""]
    lines += ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    nested: list[tuple[type, str, str]] = []
    for f in dataclasses.fields(cls):
        tp, doc = hints[f.name], docs.get(f.name, "")
        if _is_section(tp):
            nested.append((tp, f"{key}.{f.name}", doc))
            row = (f"`{key}.{f.name}`", "section", f"[below](#{_anchor(f'{key}.{f.name}')})", doc)
        else:
            row = (f"`{key}.{f.name}`", type_text(tp), default_text(default_value(f)), doc)
        lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
    lines.append("")
    for sub_cls, sub_key, sub_doc in nested:
        lines += _section(sub_cls, sub_key, sub_doc)
    return lines


def _anchor(key: str) -> str:
    """GitHub's anchor of a heading `` `key` `` (lower case, dots dropped)."""
    return key.lower().replace(".", "")


def render_recipe_docs() -> str:
    """The whole of `docs/recipes.md`."""
    lines = [
        "# Recipe reference",
        "",
        "<!-- Generated from the dataclasses in moe_rl/config/schema.py by `moe-rl config docs`; do not",
        f"     edit by hand. Regenerate: {REGENERATE} -->",
        "",
        _INTRO,
        "",
    ]
    docs, hints = field_docs(RecipeConfig), typing.get_type_hints(RecipeConfig)
    lines += ["| section | what |", "| --- | --- |"]
    lines += [
        f"| [`{f.name}`](#{f.name}) | {_cell(docs[f.name])} |" for f in dataclasses.fields(RecipeConfig)
    ]
    lines.append("")
    for f in dataclasses.fields(RecipeConfig):
        lines += _section(hints[f.name], f.name, docs[f.name])
    return "\n".join(lines).rstrip("\n") + "\n"
