"""Helpers of the weight-sync tests."""

from __future__ import annotations

import pickle
import subprocess
import sys


def in_another_process(code: str, sent: object) -> float:
    """Run ``code`` in a fresh Python process with ``sent`` pickled on its standard input (as
    ``sent = pickle.loads(...)``); the float it prints."""
    program = f"import pickle, sys, torch\nsent = pickle.loads(sys.stdin.buffer.read())\n{code}"
    out = subprocess.run(
        [sys.executable, "-c", program], input=pickle.dumps(sent), capture_output=True, check=True
    )
    return float(out.stdout)
