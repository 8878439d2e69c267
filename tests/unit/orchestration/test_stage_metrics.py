"""What the stages return, from what the workers answer: the memory phases' metrics in GiB from the
trainer's and engines' byte counts (an engine that reports no peak, as vLLM's sleep does, reads 0),
and a rollout's rounds bookkeeping (the reward worker's time apart from the generation's, the
prompts generated again), merged by the loop in the stages' order. The workers here are stand-ins
that answer as the handles of `moe_rl.orchestration.handles` do; the stages and the loop are the
library's."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from moe_rl.config import load_recipe
from moe_rl.config.run_plan import run_plan
from moe_rl.offload import GIB
from moe_rl.orchestration.handles import Workers
from moe_rl.orchestration.loop import rollout
from moe_rl.orchestration.preflight import RunInputs
from moe_rl.orchestration.replicas import Answers
from moe_rl.orchestration.sampling import Purpose
from moe_rl.orchestration.stages import Rollout, Rounds, Stages
from moe_rl.rewards.registry import build_prompt_source

TINY = Path(__file__).resolve().parents[3] / "recipes" / "tiny_moe.yaml"


class Trainer:
    """Answers `release_memory` / `restore_memory` with byte counts, as a trainer rank does."""

    dp_size = world_size = 1

    def __init__(self) -> None:
        self.restored = 0

    def release_memory(self, params: bool) -> dict[str, float]:
        return {"released_bytes": 3.0 * GIB, "resident_bytes": 2.0 * GIB, "weights_bytes": 1.0 * GIB}

    def restore_memory(self) -> dict[str, float]:
        self.restored += 1
        return {"resident_bytes": 6.0 * GIB}


class Engines:
    """Replicas that wake with nothing to say and sleep with ``asleep``'s answer."""

    restarts = 0

    def __init__(self, asleep: dict[str, float]) -> None:
        self.asleep, self.replicas = asleep, []

    def wake_up(self) -> Answers:
        return Answers({})

    def sleep(self, replicas=None) -> Answers:
        return Answers(dict(self.asleep))


def _stages(asleep: dict[str, float], overrides: list[str]) -> tuple[Stages, Trainer]:
    config = load_recipe(TINY, overrides)
    trainer = Trainer()
    workers = Workers(trainer, Engines(asleep), None, run_plan(config, "cpu"))
    return Stages(config, None, workers, RunInputs(build_prompt_source(config))), trainer


def test_the_memory_phases_report_gib_of_what_the_workers_answer():
    stages, trainer = _stages(
        {"peak_bytes": 4.0 * GIB, "resident_bytes": 0.5 * GIB}, ["cluster.release_memory=on"]
    )
    assert stages.wake_engines() == {
        "memory/trainer_released_gib": 3.0,
        "memory/trainer_generate_gib": 2.0,
        "memory/trainer_weights_gib": 1.0,
        "memory/trainer_releases": 1,
    }
    assert stages.sleep_engines() == {
        "memory/engine_generate_gib": 4.0,
        "memory/engine_asleep_gib": 0.5,
        "memory/engine_sleeps": 1,
    }
    assert trainer.restored == 1


def test_an_engine_that_reports_no_memory_when_it_sleeps_reads_zero_and_no_release_reports_nothing():
    stages, trainer = _stages({}, ["cluster.release_memory=on"])  # vLLM's sleep answers nothing
    assert stages.sleep_engines() == {
        "memory/engine_generate_gib": 0.0,
        "memory/engine_asleep_gib": 0.0,
        "memory/engine_sleeps": 1,
    }
    still, trainer = _stages({"peak_bytes": 1.0}, ["cluster.release_memory=off"])
    assert still.wake_engines() == {} and still.sleep_engines() == {} and trainer.restored == 0


class RoundsStages:
    """The rollout stages' side of the loop: two rounds, the first not trainable (dynamic
    sampling), each scored in ``reward_s`` seconds as the reward worker's clock would count them."""

    reward_s = 5.0

    def __init__(self) -> None:
        self.rounds = 0
        self.next_rounds = 0

    def wake_engines(self) -> dict:
        return {"memory/trainer_releases": 1}

    def generate(self, step: int, purpose: Purpose = Purpose.TRAIN) -> Rounds:
        return Rounds(purpose, step, generation=None, prompts=[])

    def collect(self, rounds: Rounds) -> list:
        rounds.regenerated += 2
        return []

    def reward(self, rounds: Rounds, batches: list) -> Rollout:
        rounds.reward_s += self.reward_s
        self.rounds += 1
        trainable = self.rounds == 2
        metrics = {"reward/mean": 0.5} if trainable else {}
        return Rollout([], SimpleNamespace(trainable=trainable), metrics)

    def next_round(self, rounds: Rounds, batch: Rollout) -> None:
        self.next_rounds += 1
        rounds.round += 1

    def sleep_engines(self) -> dict:
        return {"memory/engine_sleeps": 1}


def test_a_rollouts_metrics_count_its_rounds_and_keep_the_reward_workers_time_apart():
    stages = RoundsStages()
    before = time.perf_counter()
    batch, metrics = rollout(stages, 3)
    elapsed = time.perf_counter() - before
    assert batch.trainable and (stages.rounds, stages.next_rounds) == (2, 1)
    assert metrics["time/reward_s"] == 2 * RoundsStages.reward_s
    assert metrics["rollout/regenerated_prompts"] == 4
    assert metrics["time/rollout_s"] + metrics["time/reward_s"] <= elapsed  # the parts of the whole
    assert list(metrics) == [
        "memory/trainer_releases", "rollout/regenerated_prompts", "time/reward_s", "reward/mean",
        "memory/engine_sleeps", "time/rollout_s",
    ]  # fmt: skip


class Ends:
    """A worker that says when it was shut down (and may fail doing so)."""

    def __init__(self, name: str, ended: list[str], fails: bool = False) -> None:
        self.name, self.ended, self.fails = name, ended, fails

    def shutdown(self) -> None:
        self.ended.append(self.name)
        if self.fails:
            raise RuntimeError(f"{self.name} failed to end")


def test_workers_shut_down_engines_first_and_every_one_even_when_one_fails():
    config = load_recipe(TINY)
    ended: list[str] = []
    workers = Workers(
        Ends("trainer", ended), Ends("engines", ended), Ends("rewarder", ended), run_plan(config, "cpu")
    )
    workers.shutdown()
    assert ended == ["engines", "trainer", "rewarder"]
    ended.clear()
    failing = Workers(
        Ends("trainer", ended, fails=True),
        Ends("engines", ended),
        Ends("rewarder", ended),
        run_plan(config, "cpu"),
    )
    with pytest.raises(RuntimeError, match="trainer failed to end"):
        failing.shutdown()
    assert ended == ["engines", "trainer", "rewarder"]


def test_stored_offline_data_is_cut_into_whole_batches_and_the_rest_left_out():
    import torch

    from moe_rl.data.trajectory import Sample, TrajectoryBatch
    from moe_rl.orchestration.offline import OfflineData

    config = load_recipe(TINY, ["rollout.batch_size=8"])
    samples = [
        Sample(
            prompt_ids=torch.tensor([1, 2], dtype=torch.int32), response_ids=torch.tensor([3], dtype=torch.int32),
            rollout_logp=torch.zeros(1), reward=float(i), group_id=i, finish_reason="stop", version_spans=[(0, 0)],
        )
        for i in range(23)
    ]  # fmt: skip
    stored = TrajectoryBatch.from_samples(samples, engine="stored", quant_recipe="bf16", policy_version=0)
    slices = OfflineData(config, None, stored, rewarder=None).dataset()
    assert [s.rewards.tolist() for s in slices] == [[float(i) for i in range(k, k + 8)] for k in (0, 8)]
