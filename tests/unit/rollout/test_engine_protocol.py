"""SamplingSpec validation, prompt checks and group ids of the rollout engine protocol."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moe_rl.config.schema import RolloutConfig
from moe_rl.rollout.engine import SamplingSpec, check_prompts, expand_group_ids


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_k", 0),
        ("top_k", -2),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("max_new_tokens", 0),
        ("n", 0),
        ("seed", -1),
        ("seed", 1 << 63),
        ("stop_token_ids", (3, -1)),
    ],
)
def test_sampling_spec_rejects_bad_values_naming_the_field(field: str, value: object):
    with pytest.raises(ValueError, match=rf"SamplingSpec\.{field}="):
        SamplingSpec(**{field: value})


@given(
    temperature=st.floats(0, 10),
    top_k=st.one_of(st.just(-1), st.integers(1, 1000)),
    top_p=st.floats(1e-6, 1.0),
    max_new_tokens=st.integers(1, 4096),
    n=st.integers(1, 64),
)
def test_sampling_spec_accepts_every_valid_combination(temperature, top_k, top_p, max_new_tokens, n):
    spec = SamplingSpec(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=max_new_tokens, n=n)
    assert spec.greedy == (temperature == 0)
    assert spec.filters == (top_k != -1 or top_p < 1)


def test_sampling_spec_from_rollout_uses_group_size_as_n():
    rollout = RolloutConfig(temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=12, group_size=8)
    spec = SamplingSpec.from_rollout(rollout, seed=5)
    assert spec == SamplingSpec(temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=12, n=8, seed=5)


def test_check_prompts_returns_int_lists():
    assert check_prompts([(1, 2), [3]], max_new_tokens=4, max_model_len=8, vocab_size=4) == [[1, 2], [3]]


@pytest.mark.parametrize(
    ("prompts", "message"),
    [
        ([], "empty batch"),
        ([[1], []], r"prompts\[1\]: empty prompt"),
        ([[1, 64]], r"prompts\[0\]: token id 64 outside the vocabulary \[0, 64\)"),
        ([[1], [-3]], r"prompts\[1\]: token id -3"),
        ([[1] * 13], r"prompts\[0\]: 13 tokens \+ max_new_tokens=4 exceeds the engine's max_model_len=16"),
    ],
)
def test_check_prompts_names_the_bad_prompt(prompts, message):
    with pytest.raises(ValueError, match=message):
        check_prompts(prompts, max_new_tokens=4, max_model_len=16, vocab_size=64)


def test_group_ids_repeat_per_response():
    assert expand_group_ids(None, 2, 3) == [0, 0, 0, 1, 1, 1]
    assert expand_group_ids([7, 9], 2, 2) == [7, 7, 9, 9]
    with pytest.raises(ValueError, match="group_ids: 1 given for 2 prompts"):
        expand_group_ids([7], 2, 2)
