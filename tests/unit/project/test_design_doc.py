"""docs/design.md says what the code is: its layer list is the import contract's, its library table
names every package, and its command-line row names every `moe-rl` command and module."""

from __future__ import annotations

import argparse
import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
DESIGN = (REPO / "docs" / "design.md").read_text()


def _section(title: str) -> str:
    match = re.search(rf"^#+ {re.escape(title)}\n(.*?)(?=^#+ )", DESIGN, re.S | re.M)
    assert match, f"docs/design.md has no section {title!r}"
    return match.group(1)


def _contract_layers() -> list[list[str]]:
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (layers,) = [c["layers"] for c in contracts if c["type"] == "layers"]
    return [sorted(m.strip() for m in line.split("|")) for line in layers]


def _documented_layers() -> list[list[str]]:
    block = re.search(r"```\n(.*?)```", _section("Layers"), re.S)
    assert block, "the Layers section shows the layers in a code block"
    rows = []
    for line in block.group(1).splitlines():
        modules = re.match(r"^((?:[\w.]+)(?: \| [\w.]+)*)", line).group(1)
        rows.append(sorted(m.strip() for m in modules.split("|")))
    return rows


def test_the_layer_list_is_the_import_contracts():
    assert _documented_layers() == _contract_layers()


def test_the_library_table_names_every_package_and_ground_floor_module():
    table = _section("The library, `moe_rl/`")
    packages = sorted(p.name for p in (REPO / "moe_rl").iterdir() if (p / "__init__.py").exists())
    missing = [p for p in packages if f"| `{p}/` |" not in table]
    assert not missing, f"docs/design.md's library table lacks {missing}"
    ground = [line for line in table.splitlines() if line.startswith("| ground floor |")]
    assert ground, "the library table has a ground-floor row"
    modules = sorted(p.name for p in (REPO / "moe_rl").glob("*.py") if p.name != "__init__.py")
    assert [m for m in modules if f"`{m}`" not in ground[0]] == []


def test_the_command_line_row_names_every_command_and_module():
    from launch.cli import _build_parser

    parser = _build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    row = next(line for line in _section("The repository").splitlines() if line.startswith("| `launch/` |"))
    commands = [name for name in sub.choices if f"`{name}" not in row]
    assert not commands, f"docs/design.md's launch row lacks the commands {commands}"
    modules = sorted(p.name for p in (REPO / "launch").glob("*.py") if p.name != "__init__.py")
    assert [m for m in modules if f"`{m}`" not in row] == []
