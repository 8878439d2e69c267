"""Fault injection's one interface (`moe_rl.orchestration.faults`): the plan read from the
environment, a restarted process without faults, and a process that exits at exactly the planned
call of the planned point (checked in a process of its own, which the fault ends)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from moe_rl.orchestration.faults import FAULTS_ENV, Fault, FaultPoint, Faults, parse_faults


def test_the_plan_reads_every_fault_and_refuses_one_that_does_not_read():
    assert parse_faults("die_in_generate=1@3,,die_in_sync=0@12") == [
        Fault(FaultPoint.GENERATE, 1, 3),
        Fault(FaultPoint.SYNC, 0, 12),
    ]
    assert parse_faults("") == []
    for bad in ("die_in_train=1@3", "die_in_sync=1", "die_in_sync=x@2", "die_in_sync=1@-2"):
        with pytest.raises(ValueError) as err:
            parse_faults(f"die_in_sync=0@1,{bad}")
        assert str(err.value) == (
            f"{FAULTS_ENV}='die_in_sync=0@1,{bad}': '{bad}' is not "
            "<die_in_generate or die_in_sync>=<replica>@<call>"
        )


def test_a_replica_gets_its_own_faults_from_the_environment_and_a_restarted_one_none(monkeypatch):
    monkeypatch.setenv(FAULTS_ENV, "die_in_generate=1@3,die_in_sync=0@2,die_in_sync=1@5")
    assert Faults(1, restarts=0).planned == {Fault(FaultPoint.GENERATE, 1, 3), Fault(FaultPoint.SYNC, 1, 5)}
    assert Faults(1, restarts=1).planned == set()
    assert Faults(1, restarts=0, spec="").planned == set()
    quiet = Faults(2, restarts=0)
    quiet.reached(FaultPoint.SYNC)  # nothing planned for it: nothing counted
    assert quiet.planned == set() and not quiet.calls


def test_a_process_exits_at_the_planned_call_of_the_planned_point():
    script = textwrap.dedent(
        """
        from moe_rl.orchestration.faults import FaultPoint, Faults

        faults = Faults(1, 0, spec="die_in_sync=1@3,die_in_generate=0@1")
        for point in [FaultPoint.GENERATE, FaultPoint.SYNC, FaultPoint.GENERATE, FaultPoint.SYNC,
                      FaultPoint.SYNC, FaultPoint.SYNC]:
            print(point.value, flush=True)
            faults.reached(point)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert done.stdout.split() == [
        "die_in_generate",
        "die_in_sync",
        "die_in_generate",
        "die_in_sync",
        "die_in_sync",
    ]
    assert "fault injection (MOE_RL_FAULTS=die_in_sync=1@3,die_in_generate=0@1): engine replica 1 exits" in (
        done.stderr
    )
