"""A rollout's seeds come from one function of (run seed, purpose, step, generation round, engine
replica, turn), and a prompt's from one function of (its batch's seed, its index): a training
step's first round on replica 0 keeps the seed ``run seed · 100003 + step``, and no two responses
of a run share a seed, vLLM's per-response seeds (the prompt's seed + j) and a multi-turn rollout's
later turns included; on CPU, whose generator reads a seed's low 32 bits only, a step's purposes
and its first rounds, replicas and turns still draw apart. (With one stride for rounds and
replicas, round r+1 on replica k took round r's seed on replica k+1; with a prompt's seed the
batch's + its index, prompt 1 of step s drew what prompt 0 of step s+1 drew; with slots 2**32
apart, every slot of a step drew alike on CPU; with a turn's seed the batch's + turn · 104729 +
its length group · the trajectories running, a step's second length group drew what a later
step's first turn drew.)"""

from __future__ import annotations

import itertools

import pytest
import torch

from moe_rl.rollout.engine import (
    LOW_REPLICAS,
    LOW_ROUNDS,
    LOW_TURNS,
    LOW_WORD,
    MAX_PURPOSES,
    MAX_REPLICAS,
    MAX_ROUNDS,
    MAX_SAMPLES,
    MAX_TURNS,
    SEED_LIMIT,
    STEP_SPAN,
    Purpose,
    prompt_seed,
    sampling_seed,
    turn_seed,
)

STEPS = [0, 1, 2, 100_002, 100_003, 500_000, STEP_SPAN - 2, STEP_SPAN - 1]
ROUNDS = [0, 1, 2, LOW_ROUNDS - 1, LOW_ROUNDS, LOW_ROUNDS + 1, MAX_ROUNDS - 1]
REPLICAS = [0, 1, 2, LOW_REPLICAS - 1, LOW_REPLICAS, LOW_REPLICAS + 1, MAX_REPLICAS - 1]
TURNS = [0, 1, 2, LOW_TURNS - 1, LOW_TURNS, LOW_TURNS + 1, MAX_TURNS - 1]


def test_a_training_steps_first_round_on_the_first_replica_keeps_its_seed():
    assert [sampling_seed(3, Purpose.TRAIN, step) for step in (0, 1, 29)] == [300_009, 300_010, 300_038]
    assert sampling_seed(1234, Purpose.TRAIN, STEP_SPAN - 1) == 1234 * 100_003 + STEP_SPAN - 1
    assert [prompt_seed(300_009, i, 8) for i in (0, 1, 3)] == [
        300_009 << 16,
        (300_009 << 16) + 8,
        (300_009 << 16) + 24,
    ]


def test_no_two_keys_of_a_run_share_a_seed():
    keys = list(itertools.product(Purpose, STEPS, ROUNDS, REPLICAS))
    seeds = {sampling_seed(7, *key) for key in keys}
    assert len(seeds) == len(keys)
    # what one stride for rounds and replicas made equal: round 1 on replica 0, round 0 on replica 1
    assert sampling_seed(7, Purpose.TRAIN, 5, 1, 0) != sampling_seed(7, Purpose.TRAIN, 5, 0, 1)


def test_on_cpu_a_steps_purposes_first_rounds_and_replicas_draw_apart():
    """Torch's CPU generator reads a seed's low word only (slots 2**32 apart drew alike on CPU):
    the seeds of a step's purposes and of its first rounds and replicas differ there, and draw
    differently."""

    def draws(seed: int) -> tuple[int, ...]:
        return tuple(torch.randint(1 << 30, (4,), generator=torch.Generator().manual_seed(seed)).tolist())

    assert draws(5) == draws(5 + LOW_WORD)
    keys = list(itertools.product(Purpose, STEPS, range(LOW_ROUNDS), [0, 1, LOW_REPLICAS - 1]))
    assert len({sampling_seed(7, *key) % LOW_WORD for key in keys}) == len(keys)
    slots = [(Purpose.TRAIN, 0, 0), (Purpose.EVAL, 0, 0), (Purpose.TRAIN, 1, 0), (Purpose.TRAIN, 0, 1)]
    assert len({draws(sampling_seed(7, p, 5, r, k)) for p, r, k in slots}) == len(slots)


@pytest.mark.parametrize("run_seed", [7, 1234, SEED_LIMIT // 100_003 + 11])
def test_no_two_responses_of_a_run_share_a_seed(run_seed):
    """Every response seed vLLM draws with (a prompt's seed + j, j < n) over consecutive steps,
    rounds, replicas and every purpose, the first prompts and the last a batch can seed, is
    distinct and an int64 (the last run seed carries the batch seeds past ``SEED_LIMIT``)."""
    n = 4
    prompts = [0, 1, 2, MAX_SAMPLES // n - 1]
    keys = list(itertools.product(Purpose, STEPS[:3] + STEPS[-2:], ROUNDS[:2] + ROUNDS[-1:], REPLICAS[:2]))
    seeds = [
        prompt_seed(sampling_seed(run_seed, *key), i, n) + j
        for key in keys
        for i in prompts
        for j in range(n)
    ]
    assert len(set(seeds)) == len(seeds) == len(keys) * len(prompts) * n
    assert all(0 <= s < SEED_LIMIT for s in seeds)
    step, next_step = sampling_seed(run_seed, Purpose.TRAIN, 5), sampling_seed(run_seed, Purpose.TRAIN, 6)
    assert next_step == (step + 1) % SEED_LIMIT
    # what the batch's seed + the prompt's index made equal: prompt 1 of step s, prompt 0 of step s + 1
    assert prompt_seed(step, 1, n) != prompt_seed(next_step, 0, n)
    # and what a stride for prompts with the step below it would: response 1 of step s, response 0 of s + 1
    assert prompt_seed(step, 0, n) + 1 != prompt_seed(next_step, 0, n)
    # on CPU (the low word): a batch's responses and those of steps up to 2**16 apart
    cpu = [prompt_seed(sampling_seed(run_seed, Purpose.TRAIN, s), i, n) + j
           for s in range(0, 1 << 16, 997) for i in prompts for j in range(n)]  # fmt: skip
    assert len({s % LOW_WORD for s in cpu}) == len(cpu)


def test_the_seed_ranges_fit():
    """What the layout rests on: the step and the low slot digits fill the low word, the high
    digits fit above it, a run's batch seeds times a batch's responses fit an int64."""
    assert len(Purpose) <= MAX_PURPOSES
    assert STEP_SPAN * MAX_PURPOSES * LOW_ROUNDS * LOW_REPLICAS * LOW_TURNS == LOW_WORD
    high = (MAX_ROUNDS // LOW_ROUNDS) * (MAX_REPLICAS // LOW_REPLICAS) * (MAX_TURNS // LOW_TURNS)
    assert LOW_WORD * high * MAX_SAMPLES <= SEED_LIMIT == 1 << 63


def test_a_later_turns_seed_follows_from_the_first_turns_alone():
    """The multi-turn loop knows its batch's seed, not the key: `turn_seed` of it is the key's."""
    for key in itertools.product(Purpose, STEPS[:3] + STEPS[-1:], ROUNDS[:2] + ROUNDS[-1:], REPLICAS[::3]):
        first = sampling_seed(7, *key)
        assert turn_seed(first, 0) == first
        assert [turn_seed(first, t) for t in TURNS] == [sampling_seed(7, *key, turn=t) for t in TURNS]


def test_no_turn_of_a_run_draws_another_keys_seed():
    """Every turn of every key against every other: distinct; and the earlier scheme's collision
    (step s's second length group, 8 trajectories running, seeded step s + 8's first turn) is gone."""
    keys = list(itertools.product(Purpose, STEPS[:4] + STEPS[-2:], ROUNDS[::2], REPLICAS[::2], TURNS))
    seeds = {sampling_seed(7, *key) for key in keys}
    assert len(seeds) == len(keys)
    step = sampling_seed(7, Purpose.TRAIN, 5)
    assert step + 0 * 104_729 + 1 * 8 == sampling_seed(7, Purpose.TRAIN, 13)  # what the earlier scheme did
    assert all(
        turn_seed(step, t) != sampling_seed(7, Purpose.TRAIN, 5 + k) for t in range(1, 9) for k in range(64)
    )


def test_on_cpu_the_first_turns_draw_apart():
    keys = list(itertools.product([Purpose.TRAIN, Purpose.EVAL], STEPS, range(LOW_ROUNDS), [0, LOW_REPLICAS - 1],
                                  range(LOW_TURNS)))  # fmt: skip
    assert len({sampling_seed(7, *key) % LOW_WORD for key in keys}) == len(keys)


def test_no_response_of_a_multi_turn_rollout_shares_a_seed():
    """vLLM's per-response seeds of every turn's call (n = 1, one prompt per trajectory running)."""
    prompts = [0, 1, MAX_SAMPLES - 1]
    keys = list(itertools.product([Purpose.TRAIN], STEPS[:3], ROUNDS[:2], REPLICAS[:2], TURNS))
    seeds = [prompt_seed(sampling_seed(1234, *key), i, 1) for key in keys for i in prompts]
    assert len(set(seeds)) == len(seeds) and all(0 <= s < SEED_LIMIT for s in seeds)


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ((STEP_SPAN, 0, 0), r"step must be in \[0, 1048576\); got 1048576"),
        ((0, MAX_ROUNDS, 0), r"generation round must be in \[0, 256\); got 256"),
        ((0, 0, -1), r"engine replica must be in \[0, 512\); got -1"),
        ((0, 0, 0, MAX_TURNS), r"turn must be in \[0, 128\); got 128"),
    ],
)
def test_a_key_outside_the_seeds_range_is_refused(key, message):
    with pytest.raises(ValueError, match=message):
        sampling_seed(1, Purpose.TRAIN, *key)
    with pytest.raises(ValueError, match=r"turn must be in \[0, 128\); got -1"):
        turn_seed(5, -1)


def test_a_batch_with_more_responses_than_it_can_seed_is_refused():
    assert prompt_seed(1, MAX_SAMPLES // 8 - 1, 8) == MAX_SAMPLES + MAX_SAMPLES - 8
    with pytest.raises(ValueError, match=r"prompt 8192 with n=8 responses: a batch seeds at most 65536"):
        prompt_seed(1, MAX_SAMPLES // 8, 8)
