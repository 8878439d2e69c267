"""The scoring phase seen from the driver: its time on the step line when it is the step's longest
stage (`metrics.summary_line`), and a Ctrl-C while the driver waits for it (`driver.StopRequest`):
the step is let finish, but a scoring that has not ended `STOP_GRACE_S` later is given up, saying
what the driver waited for. The whole command is in tests/e2e/test_reward_faults.py."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from moe_rl.orchestration import driver
from moe_rl.orchestration.metrics import summary_line
from moe_rl.orchestration.stages import Waiting

STAGES = {"time/rollout_s": 1.0, "time/old_logp_s": 0.2, "time/train_s": 0.5, "time/sync_s": 0.1}


def test_the_scoring_time_is_on_the_step_line_when_it_is_the_longest_stage():
    slow = {"reward/mean": 0.5, **STAGES, "time/reward_s": 4.0, "time/step_s": 5.9}
    assert summary_line(slow) == "reward 0.500 | scoring 4.0s | 5.9s"
    quick = {**slow, "time/reward_s": 0.01, "time/step_s": 1.9}
    assert summary_line(quick) == "reward 0.500 | 1.9s"


@pytest.fixture
def stop(monkeypatch):
    """A `StopRequest` installed in this process (its handlers put back after the test), with a
    short grace."""
    monkeypatch.setattr(driver, "STOP_GRACE_S", 0.2)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    request = driver.StopRequest()
    request.install()
    yield request
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


def _wait_for_interrupt(seconds: float) -> bool:
    """Whether a KeyboardInterrupt reaches this (main) thread within ``seconds``."""
    try:
        threading.Event().wait(seconds)
    except KeyboardInterrupt:
        return True
    return False


def test_ctrl_c_while_a_scoring_hangs_gives_it_up_saying_what_it_waited_for(stop):
    phase = Waiting("the reward worker to score 16 responses of step 3 (data.reward=m:f)")
    stop.waiting = lambda: phase
    os.kill(os.getpid(), signal.SIGINT)
    assert _wait_for_interrupt(60.0), "the stop request never gave up waiting"
    assert stop.requested
    assert stop.given_up.startswith(
        "the reward worker to score 16 responses of step 3 (data.reward=m:f), for "
    )


def test_a_scoring_that_ends_after_ctrl_c_lets_the_step_finish(stop):
    phase: list[Waiting] = [Waiting("the reward worker to score 16 responses of step 3 (data.reward=m:f)")]
    stop.waiting = lambda: phase[0] if phase else None
    os.kill(os.getpid(), signal.SIGINT)
    phase.clear()  # the scoring ended before the grace
    assert not _wait_for_interrupt(2.0)
    assert stop.requested and stop.given_up is None


def test_ctrl_c_outside_a_scoring_lets_the_step_finish(stop):
    os.kill(os.getpid(), signal.SIGINT)
    assert not _wait_for_interrupt(2.0)
    assert stop.requested and stop.given_up is None


def test_sigterm_is_taken_as_ctrl_c_the_step_finishes_and_a_second_stops_at_once(stop):
    """`scancel` and preemption send SIGTERM: the run stops as after a Ctrl-C (the whole command,
    interrupted and resumed, is in tests/e2e/test_rl_loop.py)."""
    os.kill(os.getpid(), signal.SIGTERM)
    assert not _wait_for_interrupt(1.0)
    assert stop.requested and stop.given_up is None
    with pytest.raises(KeyboardInterrupt, match="again"):
        os.kill(os.getpid(), signal.SIGTERM)
        threading.Event().wait(60.0)
