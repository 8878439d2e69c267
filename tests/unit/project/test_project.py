"""The project's own promises: the README's commands and CI stay in step."""

from __future__ import annotations

import re
from pathlib import Path

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
