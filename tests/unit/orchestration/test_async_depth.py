"""An async run that generates `run.async_depth` steps ahead: every batch after the first ones is
exactly that many policy versions old when it trains, each token carries the version that
generated it, and the steps draw the same prompts as a synchronous run."""

from __future__ import annotations

import pytest


def test_generation_runs_async_depth_versions_behind_and_draws_the_sync_runs_prompts():
    pytest.importorskip("megatron.core")
    from moe_rl.orchestration.local import LocalRun
    from moe_rl.orchestration.preflight import load_checked
    from tests.unit.trainer.trainer_testing import TINY_MODEL_OVERRIDES, TINY_RECIPE

    base = [*TINY_MODEL_OVERRIDES, "rollout.batch_size=16", "rollout.group_size=4"]
    deep = LocalRun(
        load_checked(TINY_RECIPE, [*base, "run.mode=async", "run.async_depth=3", "run.max_staleness=3"])
    )
    records, drawn = [], []
    for record in deep.run(5):  # the prompt stream's state before each step drawn and not trained yet
        records.append(record)
        drawn.append(sorted(deep.stages.state.launched))
    assert drawn == [[1, 2, 3], [2, 3, 4], [3, 4], [4], []]  # a trained step's is forgotten
    assert [r["policy/staleness"] for r in records] == [0, 1, 2, 3, 3]
    assert [r["policy/batch_min_version"] for r in records] == [0, 0, 0, 0, 1]
    assert all(r["rollout/stale_rejected_samples"] == 0 for r in records)
    sync = LocalRun(load_checked(TINY_RECIPE, base))
    list(sync.run(5))
    assert deep.stages.source.state() == sync.stages.source.state()  # the same prompts, in order
