"""Mutation testing of named modules on cosmic-ray: do the tests fail when the code is wrong?

    scripts/mutate.sh MODULE... [-- TESTS...]

MODULE is a path (``moe_rl/trainer/returns.py``) or a dotted name (``moe_rl.trainer.returns``).
The tests run are the test files that import a named module (directly, through a package's
``__init__`` or a test helper, or through ``--depth`` library modules in between) plus TESTS.

How a run goes (all of it in a copy of the tree under ``.mutate/``, never in the working tree):

1. the chosen tests run once unmutated under coverage, each test in its own coverage context,
   and so does each Python process a test starts; they must pass. This gives, for every line of
   the named modules, the tests that execute it (a line run outside any test, at import, counts
   for every test that runs some line of the module);
2. cosmic-ray lists the mutants of the operators in ``OPERATORS`` (lines marked
   ``# pragma: no mutate`` are skipped) and applies each in turn, running
   ``mutate.py run-mutant``: the tests that execute the changed line, ``-x``, within a deadline
   of five times their unmutated time. A mutant on a line with no coverage recorded (no chosen
   test runs it, or only a process that was killed did: coverage saves at a normal exit) survives
   without a run;
3. the report: per module its mutants, killed and survivors, then each survivor as
   ``file:line``, the change and the test files run. ``.mutate/scores.json`` keeps each
   module's last figures (docs/testing.md lists them).

``--since REV`` keeps only the mutants on the lines changed since git revision REV: a change's own
lines, checked before it lands without waiting for every mutant of a large module.

Not part of CI (it runs the tests once per mutant); it is how a change is checked before it lands.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import difflib
import functools
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STATE = ROOT / ".mutate"
PYTHON = sys.executable
RECORD = "MUTATE-RECORD "
UNRECORDED = "no coverage recorded"
LIBRARY = ("moe_rl", "launch")

# The mutation operators run: each changes what a result can depend on, one mutant a site (the
# operator pairs cosmic-ray also offers, such as + into <<, mostly produce code that cannot run).
OPERATORS = (
    "core/ReplaceBinaryOperator_Add_Sub",
    "core/ReplaceBinaryOperator_Sub_Add",
    "core/ReplaceBinaryOperator_Mul_Div",
    "core/ReplaceBinaryOperator_Div_Mul",
    "core/ReplaceBinaryOperator_FloorDiv_Div",
    "core/ReplaceBinaryOperator_Mod_FloorDiv",
    "core/ReplaceBinaryOperator_Pow_Mul",
    "core/ReplaceBinaryOperator_BitOr_BitAnd",
    "core/ReplaceBinaryOperator_BitAnd_BitOr",
    "core/ReplaceComparisonOperator_Eq_NotEq",
    "core/ReplaceComparisonOperator_NotEq_Eq",
    "core/ReplaceComparisonOperator_Lt_LtE",
    "core/ReplaceComparisonOperator_LtE_Lt",
    "core/ReplaceComparisonOperator_Gt_GtE",
    "core/ReplaceComparisonOperator_GtE_Gt",
    "core/ReplaceComparisonOperator_Is_IsNot",
    "core/ReplaceComparisonOperator_IsNot_Is",
    "core/ReplaceUnaryOperator_USub_UAdd",
    "core/ReplaceUnaryOperator_Delete_Not",
    "core/AddNot",
    "core/ReplaceTrueWithFalse",
    "core/ReplaceFalseWithTrue",
    "core/ReplaceAndWithOr",
    "core/ReplaceOrWithAnd",
    "core/ReplaceBreakWithContinue",
    "core/ReplaceContinueWithBreak",
    "core/ExceptionReplacer",
    "core/NumberReplacer",
    "core/ZeroIterationForLoop",
)


class MutateError(Exception):
    """A mistake in what was asked (a module that is not there, tests that fail unmutated)."""


# ---------------------------------------------------------------------------------------------
# Which tests: the files that import a named module
# ---------------------------------------------------------------------------------------------


def module_path(spec: str) -> Path:
    """The repository-relative path of MODULE given as a path or a dotted name."""
    path = Path(spec)
    if path.suffix != ".py":
        path = Path(*spec.split(".")).with_suffix(".py")
        if not (ROOT / path).is_file() and (ROOT / path.with_suffix("") / "__init__.py").is_file():
            path = path.with_suffix("") / "__init__.py"
    if path.is_absolute():
        path = path.resolve().relative_to(ROOT)
    if not (ROOT / path).is_file() or path.parts[0] not in LIBRARY:
        raise MutateError(
            f"module {spec!r}: no file {path} in the library ({', '.join(LIBRARY)}); give a path "
            "such as moe_rl/trainer/returns.py or a dotted name such as moe_rl.trainer.returns"
        )
    return path


def _dotted(path: Path) -> str:
    parts = path.with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The dotted names a file imports (``from a import b`` gives both ``a`` and ``a.b``)."""
    tree = ast.parse((ROOT / path).read_text(), str(path))
    here = _dotted(path).split(".")
    if path.name != "__init__.py":
        here = here[:-1]
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = here[: len(here) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def _python_files(top: str) -> list[Path]:
    return sorted(p.relative_to(ROOT) for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts)


def _resolve(name: str, importer: Path, by_name: dict[str, Path]) -> Path | None:
    """The project file a dotted name means: a library or ``tests.`` module, or a test helper
    imported by its bare name from the importer's folder (pytest puts test folders on the path)."""
    if name in by_name:
        return by_name[name]
    if importer.parts[0] == "tests" and "." not in name:
        local = importer.parent / f"{name}.py"
        if (ROOT / local).is_file():
            return local
    return None


@functools.cache
def _importers() -> dict[Path, set[Path]]:
    """Each project file, and the files that import it."""
    files = [p for top in (*LIBRARY, "tests") for p in _python_files(top)]
    by_name = {_dotted(p): p for p in files}
    importers: dict[Path, set[Path]] = {p: set() for p in files}
    for src in files:
        for name in _imports(src):
            dst = _resolve(name, src, by_name)
            if dst is not None and dst != src:
                importers[dst].add(src)
    return importers


def select_tests(targets: list[Path], depth: int) -> list[Path]:
    """Test files that reach a target through imports. Package ``__init__`` files and test
    helpers are passed through freely; each other library module on the way costs one of
    ``depth``."""
    importers = _importers()

    def free(p: Path) -> bool:
        return p.name == "__init__.py" or (p.parts[0] == "tests" and not _is_test_file(p))

    best: dict[Path, int] = {t: 0 for t in targets}
    frontier = list(targets)
    while frontier:  # a shortest-path walk where free hops cost 0
        nxt = []
        for node in frontier:
            for src in importers[node]:
                cost = best[node] + (0 if free(src) or src.parts[0] == "tests" else 1)
                if cost <= depth and cost < best.get(src, depth + 1):
                    best[src] = cost
                    nxt.append(src)
        frontier = nxt
    return sorted((p for p in best if _is_test_file(p)), key=_tier_order)


def _is_test_file(path: Path) -> bool:
    return path.parts[0] == "tests" and path.name.startswith("test_")


def _tier_order(path: Path) -> tuple[int, str]:
    tiers = ("unit", "distributed", "e2e", "slurm")
    tier = path.parts[1] if len(path.parts) > 2 else ""
    return (tiers.index(tier) if tier in tiers else len(tiers), str(path))


# ---------------------------------------------------------------------------------------------
# Which lines a test executes
# ---------------------------------------------------------------------------------------------


def statement_lines(source: str) -> dict[int, int]:
    """Each line of a statement mapped to the line coverage records it by (the statement's
    first); a compound statement's header only (its body's statements are their own)."""
    first: dict[int, int] = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.stmt):
            continue
        body = getattr(node, "body", None)
        last = node.end_lineno or node.lineno
        if isinstance(body, list) and body and isinstance(body[0], ast.stmt):
            last = body[0].lineno - 1
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                for line in range(start, node.lineno):
                    first[line] = node.lineno
        for line in range(node.lineno, last + 1):
            first[line] = node.lineno
    return first


@dataclass
class Session:
    """What a run decided once, read back by every ``run-mutant``."""

    modules: list[str]
    tests: list[str]
    tree: str
    # module -> first line of a statement -> the node ids that executed it ("*": all the tests)
    lines: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    durations: dict[str, float] = field(default_factory=dict)
    baseline_s: float = 0.0
    run_unrecorded: bool = False
    """Run a mutant on a line with no coverage recorded against the module's tests anyway."""
    since: str | None = None
    """Only the mutants on lines changed since this git revision (`changed_lines`)."""

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls, path: Path) -> Session:
        return cls(**json.loads(path.read_text()))


def _copy_tree(dest: Path) -> None:
    """The tracked and not-ignored files of the working tree, as they are now."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True, capture_output=True
    ).stdout.decode()
    if dest.exists():
        shutil.rmtree(dest)
    for name in filter(None, listed.split("\0")):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def _test_env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1", CI="false")
    return env


def measure_baseline(session: Session, work: Path) -> None:
    """Run the chosen tests once, unmutated, under coverage with a context per test."""
    tree = Path(session.tree)
    data = work / "coverage"
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True)
    rc_file = work / "coveragerc"
    includes = "\n    ".join(str(tree / m) for m in session.modules)
    rc_file.write_text(
        f"[run]\ndata_file = {data}/.coverage\nparallel = true\npatch =\n    subprocess\n    _exit\n"
        f"include =\n    {includes}\n"
    )
    durations = work / "durations.json"
    cmd = [PYTHON, "-m", "coverage", "run", f"--rcfile={rc_file}", "-m", "pytest", "-q", "-x"]
    cmd += ["-p", "no:cacheprovider", "-p", "mutate_contexts", *session.tests]
    env = _test_env(tree)
    env["PYTHONPATH"] += os.pathsep + str(ROOT / "scripts")
    env["MUTATE_DURATIONS"] = str(durations)
    print(f"unmutated run of {len(session.tests)} test file(s) under coverage ...", flush=True)
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    session.baseline_s = time.monotonic() - start
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-30:])
        raise MutateError(f"the chosen tests fail without any mutant (exit {done.returncode}):\n{tail}")
    subprocess.run([PYTHON, "-m", "coverage", "combine", f"--rcfile={rc_file}", "-q"], cwd=tree, check=True)
    session.durations = json.loads(durations.read_text())
    session.lines = _lines_by_test(tree, session.modules, data / ".coverage")


def _lines_by_test(tree: Path, modules: list[str], data_file: Path) -> dict[str, dict[str, list[str]]]:
    from coverage import CoverageData

    data = CoverageData(basename=str(data_file))
    data.read()
    out: dict[str, dict[str, list[str]]] = {}
    for module in modules:
        contexts = data.contexts_by_lineno(str(tree / module)) or {}
        out[module] = {
            str(line): sorted({_test_of(c) for c in ctx} or {"*"}) for line, ctx in contexts.items()
        }
    return out


def _test_of(context: str) -> str:
    """The test to run against a mutant of a line run in ``context``: its node id; the test's whole file
    when the line ran in a process the test started (a shared fixture's, checked by the file's other
    tests); ``*`` (every test) for a line run outside any test (at import)."""
    from mutate_contexts import STARTED_BY

    if context.endswith(STARTED_BY):
        return context.removesuffix(STARTED_BY).split("::")[0]
    return context or "*"


def _expected_s(tests: list[str], durations: dict[str, float]) -> float:
    """The unmutated run's time of ``tests`` (node ids, or files: every test of the file)."""
    return sum(
        s for node, s in durations.items() if any(node == t or node.startswith(f"{t}::") for t in tests)
    )


# ---------------------------------------------------------------------------------------------
# One mutant: the tests that execute its line
# ---------------------------------------------------------------------------------------------


def run_mutant(work: Path) -> int:
    """cosmic-ray's test command: find the changed lines, run the tests that execute them."""
    session = Session.load(work / "session.json")
    tree = Path(session.tree)
    record: dict = {"tests": [], "outcome": UNRECORDED}
    changed: list[tuple[str, int]] = []
    for module in session.modules:
        before = (work / "pristine" / module).read_text().splitlines()
        after = (tree / module).read_text().splitlines()
        if before == after:
            continue
        first = statement_lines("\n".join(before))
        matcher = difflib.SequenceMatcher(a=before, b=after, autojunk=False)
        for tag, i1, i2, _, _ in matcher.get_opcodes():
            changed += (
                [(module, first.get(n + 1, n + 1)) for n in range(i1, max(i2, i1 + 1))]
                if tag != "equal"
                else []
            )
    tests: set[str] = set()
    for module, line in changed:
        found = set(session.lines.get(module, {}).get(str(line), []))
        if not found and session.run_unrecorded:  # run only in a process a test started: any test may
            found = {"*"}
            tests.add("*")
        if "*" in found:  # run at import: the tests that run any line of the module
            found = {t for ts in session.lines.get(module, {}).values() for t in ts} - {"*"} or {"*"}
        tests |= found
    if "*" in tests:
        tests = set(session.tests)
    if tests:
        ordered = sorted(tests, key=lambda t: (_tier_order(Path(t.split("::")[0])), t))
        expected = _expected_s(ordered, session.durations) if "*" not in tests else 0.0
        deadline = 5 * (expected or session.baseline_s) + 30
        record["tests"] = sorted({t.split("::")[0] for t in ordered})
        record["outcome"], rc = _pytest(ordered, tree, deadline)
    else:
        rc = 0
    print(RECORD + json.dumps(record), flush=True)
    return rc


def _pytest(tests: list[str], tree: Path, deadline: float) -> tuple[str, int]:
    """Run pytest on ``tests`` in ``tree``: in a fork of the warm server when one is up (the
    heavy libraries already imported), else in a process of its own."""
    args = ["-q", "-x", "-p", "no:cacheprovider", *tests]
    sock = tree.parent / SOCKET
    if sock.exists():
        import socket

        with socket.socket(socket.AF_UNIX) as conn:
            conn.connect(str(sock))
            conn.sendall(json.dumps({"args": args, "deadline": deadline}).encode() + b"\n")
            rc = int(conn.makefile().readline() or 1)
    else:
        proc = subprocess.Popen(
            [PYTHON, "-m", "pytest", *args], cwd=tree, env=_test_env(tree),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        rc = _wait(proc.pid, deadline)
    if rc == TIMED_OUT:
        return f"killed: over its deadline of {deadline:.0f} s", 1
    return ("killed" if rc else "survived"), rc


SOCKET = "server.sock"
TIMED_OUT = -999
# Imported once by the server and shared by every fork; never the project's own modules, which
# each fork imports afresh from the mutated tree.
WARM = ("torch", "numpy", "pyarrow", "omegaconf", "hypothesis", "megatron.core", "transformers", "pytest")


def _wait(pid: int, deadline: float) -> int:
    """The exit code of child ``pid`` (leader of its own session), or TIMED_OUT once its whole
    process group was killed at the deadline."""
    end = time.monotonic() + deadline
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > end:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return TIMED_OUT
        time.sleep(0.05)


def serve(work: Path) -> None:
    """The warm server: one fork per request, pytest run in the fork on the tree."""
    import importlib
    import socket

    for name in WARM:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    import pytest

    session = Session.load(work / "session.json")
    tree = Path(session.tree)
    path = work / SOCKET
    path.unlink(missing_ok=True)
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(path))
        server.listen(1)
        while True:
            conn, _ = server.accept()
            with conn:
                request = json.loads(conn.makefile().readline())
                pid = os.fork()
                if pid == 0:  # the fork: its own session, quiet, the tree first on the path
                    os.setsid()
                    devnull = os.open(os.devnull, os.O_WRONLY)
                    os.dup2(devnull, 1)
                    os.dup2(devnull, 2)
                    os.chdir(tree)
                    sys.path.insert(0, str(tree))
                    sys.dont_write_bytecode = True
                    os._exit(int(pytest.main(request["args"])))
                conn.sendall(f"{_wait(pid, request['deadline'])}\n".encode())


# ---------------------------------------------------------------------------------------------
# The run and its report
# ---------------------------------------------------------------------------------------------


def _session_dir(modules: list[str]) -> Path:
    key = hashlib.sha1("\n".join(modules).encode()).hexdigest()[:10]
    return STATE / "sessions" / key


def _cosmic(args: list[str], cwd: Path) -> None:
    exe = Path(PYTHON).parent / args[0]
    done = subprocess.run([str(exe), *args[1:]], cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise MutateError(f"{' '.join(args[:2])} failed:\n{done.stdout}{done.stderr}")


def prepare(
    modules: list[str], tests: list[str], work: Path, run_unrecorded: bool, since: str | None = None
) -> Session:
    tree = work / "tree"
    _copy_tree(tree)
    pristine = work / "pristine"
    shutil.rmtree(pristine, ignore_errors=True)
    for module in modules:
        (pristine / module).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / module, pristine / module)
    session = Session(
        modules=modules, tests=tests, tree=str(tree), run_unrecorded=run_unrecorded, since=since
    )
    measure_baseline(session, work)
    session.save(work / "session.json")
    return session


def cosmic_config(session: Session, work: Path) -> Path:
    import cosmic_ray.plugins
    import toml

    exclude = sorted(set(cosmic_ray.plugins.operator_names()) - set(OPERATORS))
    config = {
        "module-path": session.modules,
        "timeout": 5 * session.baseline_s + 120,
        "excluded-modules": [],
        "test-command": f"{PYTHON} {Path(__file__).resolve()} run-mutant --work {work}",
        "distributor": {"name": "local"},
        "filters": {"operators-filter": {"exclude-operators": [f"^{e}$" for e in exclude]}},
    }
    path = work / "cosmic-ray.toml"
    path.write_text(toml.dumps({"cosmic-ray": config}))
    return path


def inert_spans(source: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Where a mutant cannot change what runs: annotations (never evaluated under
    ``from __future__ import annotations``) and the bare ``*`` / ``/`` of a parameter list."""
    spans = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            params = node.args
            args = [*params.posonlyargs, *params.args, *params.kwonlyargs, params.vararg, params.kwarg]
            notes = [a.annotation for a in args if a is not None and a.annotation is not None]
            notes += [node.returns] if node.returns is not None else []
            if params.args or params.kwonlyargs or params.posonlyargs:  # the whole parameter list,
                first = min(a.lineno for a in args if a is not None)  # less defaults (below)
                spans.append(((first, 0), (node.body[0].lineno, 0)))
                spans = _minus_defaults(spans, params)
            spans += [((n.lineno, n.col_offset), (n.end_lineno, n.end_col_offset)) for n in notes]
        elif isinstance(node, ast.AnnAssign):
            n = node.annotation
            spans.append(((n.lineno, n.col_offset), (n.end_lineno, n.end_col_offset)))
    return spans


def _minus_defaults(spans: list, params: ast.arguments) -> list:
    """The parameter-list span split around each default value (a default is code that runs)."""
    start, end = spans.pop()
    for d in sorted(
        (d for d in [*params.defaults, *params.kw_defaults] if d is not None),
        key=lambda d: (d.lineno, d.col_offset),
    ):
        spans.append((start, (d.lineno, d.col_offset)))
        start = (d.end_lineno, d.end_col_offset)
    spans.append((start, end))
    return spans


def skip_inert(db_path: Path, tree: Path) -> int:
    """Mark the mutants inside ``inert_spans`` skipped; how many."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    spans: dict[str, list] = {}
    skipped = 0
    with use_db(str(db_path), WorkDB.Mode.open) as db:
        for item in list(db.pending_work_items):
            (m,) = item.mutations
            module = str(m.module_path)
            if module not in spans:
                spans[module] = inert_spans((tree / module).read_text())
            if any(a <= tuple(m.start_pos) and tuple(m.end_pos) <= b for a, b in spans[module]):
                db.set_result(item.job_id, WorkResult(output="inert", worker_outcome=WorkerOutcome.SKIPPED))
                skipped += 1
    return skipped


def changed_lines(module: str, since: str) -> set[int]:
    """The lines of ``module`` in the working tree that differ from revision ``since`` (added or
    changed; a deletion marks nothing: no mutant sits on a line that is gone)."""
    done = subprocess.run(
        ["git", "diff", "--no-color", "-U0", since, "--", module], cwd=ROOT, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise MutateError(f"--since {since}: git diff failed: {done.stderr.strip()}")
    if not done.stdout and module not in _tracked_at(since):  # new since then: every line
        return set(range(1, len((ROOT / module).read_text().splitlines()) + 1))
    lines: set[int] = set()
    for hunk in re.finditer(r"^@@ -\S+ \+(\d+)(?:,(\d+))? @@", done.stdout, re.MULTILINE):
        start, count = int(hunk.group(1)), int(hunk.group(2) or 1)
        lines.update(range(start, start + count))
    return lines


def _tracked_at(revision: str) -> set[str]:
    done = subprocess.run(
        ["git", "ls-tree", "-r", "--name-only", revision],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return set(done.stdout.splitlines())


def skip_unchanged(db_path: Path, changed: dict[str, set[int]]) -> int:
    """Mark the mutants outside ``changed`` (module -> lines) skipped; how many."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    skipped = 0
    with use_db(str(db_path), WorkDB.Mode.open) as db:
        for item in list(db.pending_work_items):
            (m,) = item.mutations
            first, last = m.start_pos[0], m.end_pos[0]
            if not changed[str(m.module_path)] & set(range(first, last + 1)):
                db.set_result(
                    item.job_id, WorkResult(output="unchanged", worker_outcome=WorkerOutcome.SKIPPED)
                )
                skipped += 1
    return skipped


@dataclass
class ModuleScore:
    module: str
    mutants: int = 0
    killed: int = 0
    survived: list[dict] = field(default_factory=list)

    @property
    def not_executed(self) -> int:
        return sum(s["outcome"] == UNRECORDED for s in self.survived)


def collect(work: Path, session: Session) -> dict[str, ModuleScore]:
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome

    scores = {m: ModuleScore(m) for m in session.modules}
    with use_db(str(work / "session.sqlite"), WorkDB.Mode.open) as db:
        for item, result in db.completed_work_items:
            if result.worker_outcome == WorkerOutcome.SKIPPED:
                continue
            (mutation,) = item.mutations
            score = scores[str(mutation.module_path)]
            score.mutants += 1
            if result.test_outcome == TestOutcome.KILLED or result.worker_outcome != WorkerOutcome.NORMAL:
                score.killed += 1
                continue
            record = {"tests": [], "outcome": "survived"}
            for line in (result.output or "").splitlines():
                if line.startswith(RECORD):
                    record = json.loads(line[len(RECORD) :])
            score.survived.append(
                {
                    "where": f"{mutation.module_path}:{mutation.start_pos[0]}",
                    "operator": mutation.operator_name.removeprefix("core/"),
                    "change": _change(result.diff or ""),
                    **record,
                }
            )
    return scores


def _change(diff: str) -> str:
    old = [ln[1:].strip() for ln in diff.splitlines() if ln.startswith("-") and not ln.startswith("---")]
    new = [ln[1:].strip() for ln in diff.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    return f"{' / '.join(old)}  ->  {' / '.join(new)}"


def report(scores: dict[str, ModuleScore], tests: list[str], since: str | None = None) -> None:
    print(f"\ntests chosen ({len(tests)}): {' '.join(tests)}")
    if since:
        print(f"mutants on the lines changed since {since} only")
    for score in scores.values():
        share = len(score.survived) / score.mutants if score.mutants else 0.0
        print(
            f"\n{score.module}: {score.mutants} mutants, {score.killed} killed, {len(score.survived)} "
            f"survived ({share:.1%}; {score.not_executed} on lines with no coverage recorded)"
        )
        for s in sorted(score.survived, key=lambda s: int(s["where"].rsplit(":", 1)[1])):
            ran = ", ".join(s["tests"]) if s["tests"] else "none: no coverage recorded for this line"
            print(f"  {s['where']}  [{s['operator']}]  {s['change']}\n      tests run: {ran}")
    _save_scores(scores, since)


def _save_scores(scores: dict[str, ModuleScore], since: str | None = None) -> None:
    path = STATE / "scores.json"
    table = json.loads(path.read_text()) if path.exists() else {}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    for score in scores.values():
        table[score.module] = {
            "mutants": score.mutants,
            "survived": len(score.survived),
            "not_executed": score.not_executed,
            "commit": commit.stdout.strip(),
            "date": time.strftime("%Y-%m-%d"),
            **({"since": since} if since else {}),  # the lines of one change, not the whole module
        }
    path.write_text(json.dumps(table, indent=1, sort_keys=True))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["run-mutant"]:
        return run_mutant(Path(argv[argv.index("--work") + 1]))
    if argv[:1] == ["serve"]:
        serve(Path(argv[argv.index("--work") + 1]))
        return 0
    extra: list[str] = []
    if "--" in argv:
        argv, extra = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    parser = argparse.ArgumentParser(prog="scripts/mutate.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="+", metavar="MODULE")
    parser.add_argument(
        "--depth",
        type=int,
        help="library modules allowed between a test and MODULE (default: the fewest that reach a test file)",
    )
    parser.add_argument(
        "--list", action="store_true", help="print the chosen tests and the mutants, run nothing"
    )
    parser.add_argument("--resume", action="store_true", help="go on with the last run of these modules")
    parser.add_argument(
        "--only", action="store_true",
        help="run only the tests named after --, not those chosen by imports (a quick look at a "
        "module many tests import)",
    )  # fmt: skip
    parser.add_argument(
        "--since", metavar="REV",
        help="only the mutants on lines changed since git revision REV (a change's own lines: "
        "scripts/mutate.sh MODULE --since main)",
    )  # fmt: skip
    parser.add_argument(
        "--run-unrecorded", action="store_true",
        help="run the module's tests against mutants on lines with no coverage recorded (code only a "
        "killed process ran) instead of counting them survivors unrun",
    )  # fmt: skip
    args = parser.parse_args(argv)
    try:
        modules = [str(module_path(m)) for m in args.modules]
        missing = [t for t in extra if not (ROOT / t.split("::")[0]).exists()]
        if missing:
            raise MutateError(f"tests given after --: no such file {', '.join(missing)}")
        if args.only and not extra:
            raise MutateError("--only runs the tests named after --, and none is named")
        tests = []
        for depth in [] if args.only else [args.depth] if args.depth is not None else range(4):
            tests = [str(p) for p in select_tests([Path(m) for m in modules], depth)]
            if tests:
                break
        tests += [t for t in extra if t not in tests]
        if not tests:
            raise MutateError(f"no test file imports {', '.join(modules)}: name the tests after --")
        return _run(modules, tests, args)
    except MutateError as err:
        print(f"mutate: {err}", file=sys.stderr)
        return 2


def _run(modules: list[str], tests: list[str], args: argparse.Namespace) -> int:
    if args.list:
        print("\n".join(tests))
        return 0
    work = _session_dir(modules)
    work.mkdir(parents=True, exist_ok=True)
    if args.resume and (work / "session.json").exists():
        session = Session.load(work / "session.json")
        for module in session.modules:  # a stopped run may have left its mutant in place
            shutil.copy2(work / "pristine" / module, Path(session.tree) / module)
    else:
        changed = {m: changed_lines(m, args.since) for m in modules} if args.since else None
        session = prepare(modules, tests, work, args.run_unrecorded, args.since)
        print(f"  {session.baseline_s:.0f} s unmutated", flush=True)
        config = cosmic_config(session, work)
        db = work / "session.sqlite"
        db.unlink(missing_ok=True)
        _cosmic(["cosmic-ray", "init", str(config), str(db)], Path(session.tree))
        _cosmic(["cr-filter-operators", str(db), str(config)], Path(session.tree))
        _cosmic(["cr-filter-pragma", str(db)], Path(session.tree))
        skip_inert(db, Path(session.tree))
        if changed is not None:
            skip_unchanged(db, changed)
    config, db = work / "cosmic-ray.toml", work / "session.sqlite"
    print(
        "mutants running (cosmic-ray exec; progress: scripts/mutate.sh --resume ... after a stop)", flush=True
    )
    exe = Path(PYTHON).parent / "cosmic-ray"
    sock = work / SOCKET
    sock.unlink(missing_ok=True)
    log = (work / "server.log").open("w")
    server = subprocess.Popen(
        [PYTHON, __file__, "serve", "--work", str(work)],
        env=_test_env(Path(session.tree)),
        stdout=log,
        stderr=log,
    )
    try:
        deadline = time.monotonic() + 120
        while not sock.exists() and server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        subprocess.run([str(exe), "exec", str(config), str(db)], cwd=session.tree, check=True)
    finally:
        server.kill()
        server.wait()
        sock.unlink(missing_ok=True)
    report(collect(work, session), session.tests, session.since)
    return 0


if __name__ == "__main__":
    sys.exit(main())
