"""The command line in a process of its own, and which heavy libraries it had imported when it
returned: a refusal before anything heavy starts imports none of them, whatever the machine's speed
(tests assert that, not a wall-clock bound)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "ray", "megatron", "vllm")
_CODE = (
    "import sys\n"
    "from launch.cli import main\n"
    "rc = main(sys.argv[1:])\n"
    f"print('heavy:' + ','.join(m for m in {HEAVY!r} if m in sys.modules), file=sys.stderr)\n"
    "sys.exit(rc)\n"
)


def run_cli(*args: str, timeout: float = 300) -> tuple[subprocess.CompletedProcess, set[str]]:
    """`moe-rl ARGS` run from the repository; its result and the heavy libraries it imported."""
    out = subprocess.run(
        [sys.executable, "-c", _CODE, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )
    lines = [line for line in out.stderr.splitlines() if line.startswith("heavy:")]
    assert lines, f"the command did not return normally: {out.stderr[-2000:]}"
    return out, {m for m in lines[-1].removeprefix("heavy:").split(",") if m}
