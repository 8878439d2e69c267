"""The mutation tool's own decisions (scripts/mutate.py): which tests it runs for a module, which
line a changed line counts as, where a mutant cannot change what runs, and how a change reads."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "scripts"))
import mutate  # noqa: E402


def test_a_module_is_named_by_path_or_dotted_name_and_a_missing_one_is_refused():
    assert mutate.module_path("moe_rl.orchestration.run_state") == Path("moe_rl/orchestration/run_state.py")
    assert mutate.module_path("moe_rl/run_dir.py") == Path("moe_rl/run_dir.py")
    assert mutate.module_path("moe_rl.rewards") == Path("moe_rl/rewards/__init__.py")
    with pytest.raises(mutate.MutateError, match=r"module 'moe_rl\.nope': no file moe_rl/nope\.py"):
        mutate.module_path("moe_rl.nope")
    with pytest.raises(mutate.MutateError, match="not_the_library"):
        mutate.module_path("tests/conftest.py".replace("tests", "not_the_library"))


def test_the_tests_chosen_are_those_that_import_the_module_through_helpers_and_packages():
    run_state = mutate.select_tests([Path("moe_rl/orchestration/run_state.py")], depth=0)
    assert Path("tests/unit/orchestration/test_run_state.py") in run_state
    # a distributed test reaches the critic through its worker helper, imported by bare name
    critic = mutate.select_tests([Path("moe_rl/trainer/critic.py")], depth=0)
    assert Path("tests/distributed/test_trainer_dp.py") in critic
    assert critic.index(Path("tests/unit/trainer/test_critic.py")) < critic.index(
        Path("tests/distributed/test_trainer_dp.py")
    )  # the unit tier first
    # one library module in between: none at depth 0, found at depth 1
    assert mutate.select_tests([Path("moe_rl/trainer/returns.py")], depth=0) == []
    assert Path("tests/unit/trainer/test_distill.py") in mutate.select_tests(
        [Path("moe_rl/trainer/returns.py")], depth=1
    )


def test_a_line_of_a_statement_counts_as_its_first_line_a_compound_statement_as_its_header():
    source = "x = f(\n    1,\n    2,\n)\nif (a and\n        b):\n    y = 3\n@dec\ndef g(\n    p,\n):\n    return p\n"
    first = mutate.statement_lines(source)
    assert [first[n] for n in (1, 2, 3, 4)] == [1, 1, 1, 1]
    assert (first[5], first[6], first[7]) == (5, 5, 7)
    assert (first[8], first[9], first[10], first[11], first[12]) == (9, 9, 9, 9, 12)


def test_annotations_and_bare_star_are_inert_defaults_and_bodies_are_not():
    source = (
        "def f(a: int | None, *, b: float = 0.5) -> int | None:\n    return a * b\nx: int | str = 1 | 2\n"
    )
    spans = mutate.inert_spans(source)

    def inert(line: int, col: int) -> bool:
        return any(a <= (line, col) and (line, col + 1) <= b for a, b in spans)

    line1 = source.splitlines()[0]
    assert inert(1, line1.index("|"))  # a's annotation
    assert inert(1, line1.index("*"))  # the keyword-only marker
    assert not inert(1, line1.index("0.5"))  # a default runs
    assert inert(1, line1.rindex("|"))  # the return annotation
    assert not inert(2, source.splitlines()[1].index("*"))  # a product in the body
    assert inert(3, 7) and not inert(3, source.splitlines()[2].index("1 | 2") + 2)


def test_a_change_reads_as_the_old_lines_then_the_new():
    diff = "--- a/m.py\n+++ b/m.py\n@@ -3 +3 @@\n-    if k < n:\n+    if k <= n:\n"
    assert mutate._change(diff) == "if k < n:  ->  if k <= n:"


def _git(repo: Path, *args: str) -> None:
    import subprocess

    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True, capture_output=True
    )


def test_since_a_revision_the_changed_and_added_lines_count_a_new_file_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(mutate, "ROOT", tmp_path)
    _git(tmp_path, "init", "-q")
    (tmp_path / "m.py").write_text("a = 1\nb = 2\nc = 3\nd = 4\ne = 5\nf = 6\n")
    _git(tmp_path, "add", "m.py")
    _git(tmp_path, "commit", "-qm", "one")
    # line 2 changed, two lines added after d, the last one deleted
    (tmp_path / "m.py").write_text("a = 1\nb = 20\nc = 3\nd = 4\nx = 7\ny = 8\ne = 5\n")
    assert mutate.changed_lines("m.py", "HEAD") == {2, 5, 6}
    (tmp_path / "new.py").write_text("p = 1\nq = 2\n")
    assert mutate.changed_lines("new.py", "HEAD") == {1, 2}
    with pytest.raises(mutate.MutateError, match="--since nope: git diff failed"):
        mutate.changed_lines("m.py", "nope")


def test_the_mutants_outside_the_changed_lines_are_skipped(tmp_path, monkeypatch):
    import subprocess

    from cosmic_ray.work_db import WorkDB, use_db

    (tmp_path / "m.py").write_text("def f(a, b):\n    x = a + b\n    y = a - b\n    return x < y\n")
    config = tmp_path / "cr.toml"
    config.write_text(
        '[cosmic-ray]\nmodule-path = "m.py"\ntimeout = 10\nexcluded-modules = []\ntest-command = "true"\n'
        '[cosmic-ray.distributor]\nname = "local"\n'
    )
    exe = Path(sys.executable).parent / "cosmic-ray"
    subprocess.run(
        [str(exe), "init", str(config), "db.sqlite"], cwd=tmp_path, check=True, capture_output=True
    )

    def pending_lines() -> list[int]:
        with use_db(str(tmp_path / "db.sqlite"), WorkDB.Mode.open) as db:
            return sorted({item.mutations[0].start_pos[0] for item in db.pending_work_items})

    assert {2, 3, 4} <= set(pending_lines())
    skipped = mutate.skip_unchanged(tmp_path / "db.sqlite", {"m.py": {3}})
    assert pending_lines() == [3] and skipped > 0


def test_a_line_run_in_a_process_a_test_started_is_tried_with_every_test_of_its_file(tmp_path):
    """The unmutated run under coverage: a line run in the test's own process counts for that test;
    one run in a process that a module fixture started (the first test that asked for it) counts for
    the whole file, whose other tests check that process's outputs; a line run at import, for all."""
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "m.py").write_text("def here():\n    return 1\n\n\ndef there():\n    return 2\n")
    (tree / "test_m.py").write_text(
        "import subprocess, sys\n\nimport pytest\n\nimport m\n\n\n"
        "@pytest.fixture(scope='module')\n"
        "def started():\n"
        "    cmd = [sys.executable, '-c', 'import m; print(m.there())']\n"
        "    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout\n\n\n"
        "def test_first(started):\n    assert m.here() == 1\n\n\n"
        "def test_second(started):\n    assert started.strip() == '2'\n"
    )
    session = mutate.Session(modules=["m.py"], tests=["test_m.py"], tree=str(tree))
    mutate.measure_baseline(session, tmp_path / "work")
    lines = session.lines["m.py"]
    assert lines["2"] == ["test_m.py::test_first"]
    assert lines["6"] == ["test_m.py"]
    assert "*" in lines["1"]  # the ``def``, run at import
    assert set(session.durations) == {"test_m.py::test_first", "test_m.py::test_second"}
    assert mutate._expected_s(["test_m.py"], session.durations) == sum(session.durations.values())
    first = session.durations["test_m.py::test_first"]
    assert mutate._expected_s(["test_m.py::test_first"], session.durations) == first
    assert mutate._expected_s(["test_m.py::test_fir"], session.durations) == 0.0
