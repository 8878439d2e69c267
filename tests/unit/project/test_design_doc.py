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


NOT_OURS = {
    "LoRARequest": "vLLM's",
    "RouterReplay": "Megatron-core's",
    "StrEnum": "Python's",
    "torch.distributed": "torch's",
}
"""Names docs/design.md quotes from the libraries the project builds on."""
RUN_WRITES = {"driver.json", "metrics.jsonl", "trajectories/", "shard-00000.arrow", "manifest.json"}
"""What a run writes into its run directory, which docs/design.md names too."""
SYMBOLS = re.compile(r"[A-Z]")  # the sizes of a batch's fields (`N` samples, `P`, `R` tokens)


def _quoted() -> list[str]:
    return sorted(set(re.findall(r"`([^`\n]+)`", DESIGN)))


def _tracked() -> list[str]:
    import subprocess

    listed = subprocess.run(["git", "ls-files"], cwd=REPO, check=True, capture_output=True, text=True)
    return listed.stdout.split()


def _defined(name: str, sources: str) -> bool:
    return (
        re.search(
            rf"^\s*(?:class|def|async def) {re.escape(name)}\b|^\s*{re.escape(name)}\s*[:=]", sources, re.M
        )
        is not None
    )


def _module_attr(name: str, modules: dict[str, list[str]]) -> bool:
    """Whether ``name`` is a module of the project (its dotted path, or its last part, as the doc
    says `loop.py`'s `loop`) followed by attributes it has."""
    import importlib

    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        for candidate in modules.get(".".join(parts[:i]), []):
            obj = importlib.import_module(candidate)
            for attr in parts[i:]:
                obj = getattr(obj, attr, None)
            if obj is not None:
                return True
    return False


def test_every_file_module_class_and_function_the_design_doc_names_exists():
    """Each quoted file (``*.py`` and the like) and folder (``x/``) is in the repository; each quoted
    class, function (``f(...)``) and dotted name is defined by the project: a module and its
    attributes (``loop.run_loop``, ``moe_rl.orchestration.local``), or a recipe key
    (``run.mode``); what a run writes and the libraries' names apart."""
    from moe_rl.config.loader import _all_paths
    from moe_rl.config.schema import RecipeConfig

    files = _tracked()
    folders = {
        "/".join(parts[i:j]) + "/"
        for parts in (f.split("/") for f in files)
        for j in range(1, len(parts))
        for i in range(j)
    }
    sources = "\n".join((REPO / f).read_text(errors="replace") for f in files if f.endswith(".py"))
    modules: dict[str, list[str]] = {}
    for f in files:
        if f.endswith(".py") and f.startswith(("moe_rl/", "launch/")):
            dotted = f.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
            for short in {dotted, dotted.split(".")[-1], dotted.removeprefix("moe_rl.")}:
                modules.setdefault(short, []).append(dotted)
    keys = set(_all_paths(RecipeConfig))
    wrong = []
    for name in _quoted():
        if name in NOT_OURS or name in RUN_WRITES or SYMBOLS.fullmatch(name):
            continue
        if re.fullmatch(r"[\w./-]+\.(py|sh|toml|sbatch|txt|yaml|md)", name):
            ok = any(f == name or f.endswith("/" + name) for f in files)
        elif re.fullmatch(r"[\w./-]+/", name):
            ok = name in folders
        elif re.fullmatch(r"[A-Z]\w*(?:\.\w+)*(?:\(.*\))?", name):
            ok = _defined(name.split("(")[0].split(".")[0], sources)
        elif re.fullmatch(r"[a-z_]\w*(?:\.\w+)+", name):
            ok = name in keys or any(k.startswith(name + ".") for k in keys) or _module_attr(name, modules)
        elif re.fullmatch(r"[a-z_]\w*\(.*\)", name):
            ok = _defined(name.split("(")[0], sources)
        else:
            continue  # a value, a field, a command, words
        if not ok:
            wrong.append(name)
    assert not wrong, f"docs/design.md names what the project does not have: {wrong}"
