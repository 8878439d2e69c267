"""A multi-turn rollout on the Megatron engine (the tiny tool recipe's model, CPU) makes one
``generate`` call per turn, seeded by the run's seed function (`turn_seed` of its batch's seed:
no turn draws what another turn, step or replica draws), over every trajectory still running, as
long as the longest turn left; a response past its own trajectory's budget is cut there, and the
batch stays valid (kept sets, the stitched routing trace). Before, a turn made one call per budget
length, seeded ``seed + turn · 104729 + group · trajectories running``: a step's second length
group drew what a later step's first turn drew."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_rl.data.trajectory import TrajectoryBatch
from moe_rl.data.validate import validate
from moe_rl.envs.base import Environment, StepResult
from moe_rl.envs.rollout import MultiTurnRollout, TurnLimits, _cut
from moe_rl.orchestration.preflight import load_checked
from moe_rl.orchestration.sampling import Draw, replica_spec
from moe_rl.rewards.tasks import Prompt
from moe_rl.rollout.engine import Purpose, turn_seed
from moe_rl.rollout.megatron_engine import MegatronEngine

TOOLS = Path(__file__).resolve().parents[3] / "recipes" / "tiny_moe_tools.yaml"
BUDGET = 14


@pytest.fixture(scope="module")
def config():
    return load_checked(TOOLS, ["rollout.quant=bf16", f"env.max_tokens={BUDGET}"])


@pytest.fixture(scope="module")
def engine(config):
    return MegatronEngine(config)


class _Calls:
    """The engine, with the sampling of each ``generate`` call written down."""

    def __init__(self, engine: MegatronEngine):
        self.engine, self.specs = engine, []

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    def generate(self, contexts, spec):
        self.specs.append(spec)
        return self.engine.generate(contexts, spec)


class _Answers(Environment):
    """Answers the first turn with 1 to 8 tokens (one more per environment made), ends at the
    third: the trajectories' budgets left differ at the second turn."""

    made = 0

    def __init__(self):
        _Answers.made += 1
        self.length, self.steps = _Answers.made % 8 + 1, 0

    def step(self, turn: list[int]) -> StepResult:
        self.steps += 1
        return StepResult([10] * self.length if self.steps == 1 else [], done=self.steps == 3)


def test_one_call_per_turn_seeded_by_the_seed_function_and_cut_to_each_budget(config, engine):
    calls = _Calls(engine)
    loop = MultiTurnRollout(calls, _Answers, TurnLimits.of(config), config.model.vocab_size, "answers")
    spec = replica_spec(config, Draw(Purpose.TRAIN, step=3), replica=0)
    prompts = [Prompt((1, 4, 5, 6, 7, 8, 9), ()) for _ in range(8)]
    batch, _ = loop.generate(prompts, spec)
    validate(batch, vocab_size=config.model.vocab_size)  # kept sets and the stitched trace included
    turns = len(calls.specs)
    assert 2 <= turns <= config.env.max_turns and all(s.n == 1 for s in calls.specs)
    assert [s.seed for s in calls.specs] == [turn_seed(spec.seed, t) for t in range(turns)]
    lengths = batch.response_lengths()
    assert bool((lengths <= BUDGET).all())
    cut = [
        i
        for i in range(batch.num_samples)
        if int(lengths[i]) == BUDGET and batch.finish_reasons[i] == "length"
    ]
    assert cut, "no trajectory reached its budget in a turn: nothing was cut"


def test_a_cut_response_is_a_valid_sample_of_its_first_tokens(config, engine):
    spec = replica_spec(config, Draw(Purpose.TRAIN, step=0), replica=0)
    batch = engine.generate([[1, 4, 5, 6, 2]] * 4, spec)
    longest = max(range(4), key=lambda i: int(batch.response_lengths()[i]))
    whole = batch.sample(longest)
    length = whole.response_ids.numel() - 2
    cut = _cut(whole, length)
    assert cut.response_ids.tolist() == whole.response_ids[:length].tolist() and cut.finish_reason == "length"
    assert torch.equal(cut.rollout_logp, whole.rollout_logp[:length])
    assert cut.routed_experts.shape[0] == whole.prompt_ids.numel() + length
    validate(TrajectoryBatch.from_samples([cut], engine="megatron", quant_recipe="bf16", policy_version=0,
                                          num_experts=config.model.num_experts), vocab_size=config.model.vocab_size)  # fmt: skip
    assert _cut(whole, whole.response_ids.numel()) is whole
