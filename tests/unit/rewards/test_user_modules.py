"""A user's `module:function` reward or `module:Class` environment in the folder the command runs
from is found, as `python -m` would find it, by the `moe-rl` command too (whose own folder, not the
working directory, heads ``sys.path``); one found nowhere is refused with one line saying where it
was looked for and what to do. The run itself, the Ray reward worker importing it:
tests/e2e/test_reward_faults.py (its zero-scoring run)."""

from __future__ import annotations

import sys

import pytest

from moe_rl.envs.registry import build_env_factory
from moe_rl.errors import EnvError, RewardFunctionError
from moe_rl.rewards.functions import load_user_function


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A working directory off ``sys.path`` (as under the `moe-rl` command); the path and the
    modules imported are restored afterwards."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        del sys.modules[name]


def test_a_reward_module_in_the_working_directory_is_found(workdir):
    (workdir / "my_reward_cwd.py").write_text("def score(response, answer):\n    return 0.5\n")
    fn = load_user_function("my_reward_cwd:score")
    assert fn("x", "y") == 0.5 and sys.path[-1] == str(workdir)


def test_a_package_in_the_working_directory_is_found(workdir):
    (workdir / "my_pkg_cwd").mkdir()
    (workdir / "my_pkg_cwd" / "__init__.py").write_text("")
    (workdir / "my_pkg_cwd" / "rewards.py").write_text("def score(response, answer):\n    return 1.0\n")
    assert load_user_function("my_pkg_cwd.rewards:score")("a", "b") == 1.0


def test_an_environment_class_in_the_working_directory_is_found(workdir):
    (workdir / "my_env_cwd.py").write_text(
        "from moe_rl.envs import Environment, StepResult\n"
        "class Echo(Environment):\n"
        "    def step(self, turn):\n"
        "        return StepResult(done=True)\n"
    )
    assert type(build_env_factory("my_env_cwd:Echo", {})()).__name__ == "Echo"


def test_a_module_found_nowhere_says_where_it_was_looked_for(workdir):
    with pytest.raises(RewardFunctionError) as info:
        load_user_function("no_such_reward_module:score")
    assert str(info.value) == (
        "data.reward='no_such_reward_module:score': cannot import no_such_reward_module: no module named "
        f"'no_such_reward_module' in the installed packages, PYTHONPATH or the working directory {workdir}; "
        "put no_such_reward_module.py in the folder you run moe-rl from, or add its folder to PYTHONPATH"
    )
    with pytest.raises(
        EnvError, match=r"cannot import no_such_env_module: no module named 'no_such_env_module' in"
    ):
        build_env_factory("no_such_env_module:Env", {})


def test_a_module_that_fails_to_import_what_it_needs_says_so(workdir):
    """The module is found; what it imports is not: that is the error, unchanged."""
    (workdir / "my_broken_cwd.py").write_text("import not_installed_anywhere\n")
    with pytest.raises(
        RewardFunctionError, match=r"cannot import my_broken_cwd: No module named 'not_installed_anywhere'$"
    ):
        load_user_function("my_broken_cwd:score")
