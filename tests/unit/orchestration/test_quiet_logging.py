"""Where messages go during a run (`moe_rl.log`): library messages, Python warnings and vLLM's own
logging into the run's log files only; the project's messages and anyone's errors on the terminal.
Each case runs in a fresh process, since it configures the root logger."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe_rl.log import LOG_DIR_ENV

pytest.importorskip("ray", reason="the child processes configure Ray's loggers")

REPO = Path(__file__).resolve().parents[3]
SCRIPT = """
import json, logging, logging.config, os, sys, warnings
import ray  # adds a handler of its own to the "ray" logger
from moe_rl.log import log_to_file, route_library_logs, setup_actor_logging, setup_logging

mode = sys.argv[1]
if mode == "driver":
    setup_logging("INFO", quiet=True)
    log_to_file(os.path.join(os.environ["LOGS"], "train.log"))
    route_library_logs()
else:
    setup_actor_logging("engine0", "INFO", verbose=mode == "verbose")
if "VLLM_LOGGING_CONFIG_PATH" in os.environ:  # what importing vLLM does with it
    logging.config.dictConfig(json.load(open(os.environ["VLLM_LOGGING_CONFIG_PATH"])))
logging.getLogger("megatron.core.optimizer").info("megatron info")
logging.getLogger("ray._private.worker").warning("ray notice")
logging.getLogger("vllm.triton_utils").warning("vllm notice")
warnings.warn("a library warning")
logging.getLogger("moe_rl.rollout").info("project info")
logging.getLogger("moe_rl.rollout").warning("project warning")
logging.getLogger("torch.distributed").error("library error")
"""
LIBRARY = ["megatron info", "ray notice", "vllm notice", "UserWarning: a library warning"]


def _run(mode: str, logs: Path | None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", LOG_DIR_ENV))}
    if logs is not None:
        env[LOG_DIR_ENV if mode != "driver" else "LOGS"] = str(logs)
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    return (out.stdout + out.stderr).splitlines()


def _messages(lines: list[str]) -> list[str]:
    return [line.split(": ", 1)[1] for line in lines if ": " in line]


def test_an_actor_in_a_run_shows_project_warnings_and_errors_and_logs_everything(tmp_path):
    assert _messages(_run("quiet", tmp_path)) == ["project warning", "library error"]
    text = (tmp_path / "engine0.log").read_text()
    for message in [*LIBRARY, "project info", "project warning", "library error"]:
        assert message in text, message
    assert "\n\n" not in text  # a captured warning is not followed by a blank line


@pytest.mark.parametrize("logs", [True, False], ids=["verbose", "outside-a-run"])
def test_a_verbose_actor_or_one_outside_a_run_shows_everything(tmp_path, logs):
    shown = "\n".join(_run("verbose" if logs else "quiet", tmp_path if logs else None))
    for message in [*LIBRARY, "project info", "project warning", "library error"]:
        assert message in shown, message
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == (
        ["engine0.log"] if logs else []
    )


def test_the_driver_shows_the_project_s_info_and_logs_the_libraries(tmp_path):
    assert _messages(_run("driver", tmp_path)) == ["project info", "project warning", "library error"]
    text = (tmp_path / "train.log").read_text()
    for message in ["megatron info", "ray notice", "UserWarning: a library warning", "project info"]:
        assert message in text, message
