"""`data.reward` → a scorer of (prompt, response ids) in one place.

A synthetic task's checker scores inline; every other reward scores decoded text through the
scoring pool (`moe_rl.rewards.pool`): a function (built in, or the user's `module:function`, plain
or `async def`) one call per response, the HTTP service (`moe_rl.rewards.http`) one request per
`data.reward_batch_size` responses, `data.reward_workers` calls at a time, each within
`data.reward_timeout_s`. A call that fails stops the run with one line naming the function, the
prompt and the cause, or scores 0 and is counted (`data.reward_on_failure`).
"""

from __future__ import annotations

import logging
import math
import numbers
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from moe_rl.config.modes import RewardFailure, RewardPool, TaskKind
from moe_rl.config.schema import DataConfig
from moe_rl.errors import ConfigError, RewardFunctionError, UserError
from moe_rl.rewards.datasets import ByteTokenizer, ChatFormat, HFTokenizer, PromptSource, Tokenizer
from moe_rl.rewards.functions import exact_match, load_user_function, math_answer
from moe_rl.rewards.http import HttpReward
from moe_rl.rewards.pool import CallFailed, Outcome, Progress, ScoringPool
from moe_rl.rewards.tasks import Prompt, SyntheticTask, check_task_vocab, get_task
from moe_rl.rules import Rule

log = logging.getLogger("moe_rl.rewards")

TEXT_REWARDS = {"exact_match": exact_match, "math": math_answer}
SYNTHETIC, HTTP = "synthetic", "http"
"""The names of `data.reward` that are neither a text function nor `module:function`."""


@dataclass
class Scores:
    """A batch's rewards, one per response, and how many are 0 because their call failed; with
    `data.reward_on_failure=zero` they are ``counted`` (the step's `reward/failed`)."""

    values: list[float]
    failed: int = 0
    counted: bool = False


@dataclass(frozen=True)
class _Call:
    """One call of the reward: the responses it scores (their sample indices) and its arguments."""

    samples: range
    args: tuple


def _answered(value: Any) -> None:
    """The HTTP service's rewards, checked as they come (`moe_rl.rewards.http`)."""


def _finite(value: Any) -> str | None:
    """Why a function's value is not a reward (None: it is one)."""
    if isinstance(value, numbers.Real) and math.isfinite(value):
        return None
    return f"returned {value!r} ({type(value).__name__}); it must return a finite number"


class RewardScorer:
    """Scores responses: the synthetic task's own checker, or a text reward on decoded responses
    (``data`` gives the `data.reward_*` keys of the pool; their defaults when not given)."""

    def __init__(
        self, reward: str, task: SyntheticTask | None = None, tokenizer: Tokenizer | None = None,
        data: DataConfig | None = None,
    ):  # fmt: skip
        self.task, self.tokenizer, self.reward = task, tokenizer, reward
        self.options = data if data is not None else DataConfig(reward=reward)
        self.text_fn = self.http = None
        if reward == SYNTHETIC:
            if task is None:
                raise ConfigError("data.reward=synthetic needs data.task=synthetic:<task>")
        elif reward == HTTP:
            o = self.options
            if not o.reward_url:
                raise ConfigError("data.reward=http needs data.reward_url=http(s)://HOST[:PORT]/PATH")
            self.http = HttpReward(o.reward_url, o.reward_timeout_s, o.reward_retries, o.reward_backoff_s)
        else:
            self.text_fn = TEXT_REWARDS.get(reward) or load_user_function(reward)
        if reward != SYNTHETIC and tokenizer is None:
            raise ConfigError(f"data.reward={reward} scores text: the model needs a tokenizer")
        self._pool: ScoringPool | None = None
        self._current: tuple[list[_Call], int] = ([], 1)
        """The calls of the scoring in progress and its responses per prompt (for progress lines)."""

    def __getstate__(self) -> dict:
        """Sent to the reward worker without its pool (threads and processes are made there)."""
        return {**self.__dict__, "_pool": None, "_current": ([], 1)}

    @property
    def pool(self) -> ScoringPool:
        """The scoring pool, made at the first scoring: the HTTP service's requests in threads, a
        function's calls where `data.reward_pool` says."""
        if self._pool is None:
            o = self.options
            if self.http is not None:
                longest = self.http.longest_s()
                cause = f"did not answer within {longest} s (each try within data.reward_timeout_s={o.reward_timeout_s} s)"
                self._pool = ScoringPool(self.http, None, RewardPool.THREAD, o.reward_workers, longest, cause)
            else:
                fn = self.text_fn
                spec = f"{fn.__module__}:{fn.__name__}" if self.reward in TEXT_REWARDS else self.reward
                cause = f"did not return within data.reward_timeout_s={o.reward_timeout_s} s"
                self._pool = ScoringPool(fn, spec, o.reward_pool, o.reward_workers, o.reward_timeout_s, cause)
        return self._pool

    def score(self, prompt: Prompt, response: Sequence[int]) -> float:
        """The reward of one response."""
        return self.score_batch([prompt], [response]).values[0]

    def score_all(self, prompts: Sequence[Prompt], responses: Sequence[Sequence[int]]) -> list[float]:
        """The rewards of ``responses``, each of the prompt at its place in ``prompts``."""
        return self.score_batch(prompts, responses).values

    def score_batch(
        self, prompts: Sequence[Prompt], responses: Sequence[Sequence[int]], group_size: int = 1
    ) -> Scores:
        """The rewards of ``responses`` (response i answers ``prompts[i]``, prompt number
        i // ``group_size`` of the batch, which is how a failure names it)."""
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        if self.reward == SYNTHETIC:
            return Scores([float(self.task.score(p, r)) for p, r in zip(prompts, responses)])
        calls = self._calls(prompts, [self.tokenizer.decode_response(r) for r in responses])
        self._current = (calls, group_size)
        stop = self.options.reward_on_failure == RewardFailure.STOP
        check = _finite if self.http is None else _answered  # the service's answer is checked as it comes
        try:
            outcomes = self.pool.run([c.args for c in calls], check, stop, self._report)
        except CallFailed as failed:
            raise RewardFunctionError(self._failure(calls[failed.index], failed.cause)) from None
        return self._scores(calls, outcomes, len(responses))

    def _calls(self, prompts: Sequence[Prompt], texts: list[str]) -> list[_Call]:
        if self.http is None:
            return [
                _Call(range(i, i + 1), (text, str(p.answer)))
                for i, (p, text) in enumerate(zip(prompts, texts))
            ]
        size = self.options.reward_batch_size
        items = [
            {"prompt": self.tokenizer.decode(p.ids), "response": text, "answer": str(p.answer)}
            for p, text in zip(prompts, texts)
        ]
        return [
            _Call(range(a, min(a + size, len(items))), (items[a : a + size],))
            for a in range(0, len(items), size)
        ]

    def _scores(self, calls: list[_Call], outcomes: list[Outcome], count: int) -> Scores:
        values, failures = [0.0] * count, []
        for call, outcome in zip(calls, outcomes):
            if outcome.cause is not None:
                failures.append(self._failure(call, outcome.cause))
                continue
            for i, value in zip(call.samples, outcome.value if self.http is not None else [outcome.value]):
                values[i] = float(value)
        failed = sum(len(call.samples) for call, outcome in zip(calls, outcomes) if outcome.cause is not None)
        if failures:
            log.warning(
                "%d of %d responses scored 0, their reward call failed (data.reward_on_failure=zero); "
                "%d call(s), the first: %s", failed, count, len(failures), failures[0],
            )  # fmt: skip
        return Scores(values, failed, counted=self.options.reward_on_failure == RewardFailure.ZERO)

    def _failure(self, call: _Call, cause: str) -> str:
        """One line naming the reward, the prompt and the cause of a failed call."""
        group_size = self._current[1]
        first, last = call.samples[0], call.samples[-1]
        if self.http is not None:
            where = f"prompts {first // group_size}-{last // group_size}, responses {first}-{last}"
            return f"reward service data.reward=http at {self.options.reward_url} {cause} ({where})"
        text, answer = call.args
        return (
            f"reward function data.reward={self.reward} {cause} "
            f"(prompt {first // group_size}, response {text[:80]!r}, answer {answer!r})"
        )

    def progress_line(self) -> str | None:
        """Where the scoring in progress stands (None: none is)."""
        progress = None if self._pool is None else self._pool.progress
        if progress is None or progress.done >= progress.total:
            return None
        return self._describe(progress)

    def _describe(self, progress: Progress) -> str:
        calls, group_size = self._current
        line = f"data.reward={self.reward}: {progress.done}/{progress.total} calls done"
        longest = progress.longest()
        if longest is not None:
            index, seconds = longest
            first = calls[index].samples[0] // group_size if index < len(calls) else index
            line += f", {len(progress.running)} running, the longest for {seconds:.0f} s (prompt {first})"
        return f"{line}; {time.monotonic() - progress.started:.0f} s so far"

    def _report(self, progress: Progress) -> None:
        log.info("scoring with %s", self._describe(progress))

    def close(self) -> None:
        """End the pool's worker processes, if any."""
        if self._pool is not None:
            self._pool.close()


def build_tokenizer(config) -> Tokenizer | None:
    """The model's own tokenizer (a local HF folder), a byte tokenizer for text data on a model
    without one, or None for synthetic tasks (their prompts are token ids)."""
    if config.model.hf_path and (Path(config.model.hf_path) / "tokenizer_config.json").exists():
        return HFTokenizer(config.model.hf_path, eos_token_id=config.model.eos_token_id)
    if config.data.source.kind == TaskKind.SYNTHETIC:
        return None
    tokenizer = ByteTokenizer()
    if config.model.vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"data.task={config.data.task} on a model without a tokenizer uses bytes (vocabulary "
            f"{tokenizer.vocab_size}); model.vocab_size={config.model.vocab_size} is too small"
        )
    return tokenizer


def reward_rules(config) -> list[Rule]:
    """The rewards' rules on a recipe, checked before anything loads: a synthetic task
    (``data.task=synthetic:<name>``) exists and fits the model's vocabulary; the HTTP service's
    keys. What needs the data or the reward function itself is checked when they are built
    (`moe_rl.orchestration.preflight`, the run's inputs)."""
    source = config.data.source
    rules = _service_rules(config.data)
    if source.kind != TaskKind.SYNTHETIC:
        return rules
    name = source.name
    try:
        check_task_vocab(name, config.model.vocab_size)  # an unknown task is named there too
    except UserError as exc:
        return [Rule("synthetic task", False, str(exc)), *rules]
    return [Rule("synthetic task", True, f"{name} fits model.vocab_size={config.model.vocab_size}"), *rules]


def _service_rules(d: DataConfig) -> list[Rule]:
    """`data.reward=http` has an http(s) `data.reward_url` and runs in threads; a URL is not set
    for another reward (where it would be ignored)."""
    if d.reward != HTTP:
        if d.reward_url is None:
            return []
        return [Rule("reward service", False, f"data.reward_url={d.reward_url}, data.reward={d.reward}",
                     advice="the URL is read by data.reward=http only: set that, or remove data.reward_url")]  # fmt: skip
    values = f"data.reward_url={d.reward_url}"
    if urlparse(d.reward_url or "").scheme not in ("http", "https") or not urlparse(d.reward_url).netloc:
        return [
            Rule(
                "reward service",
                False,
                values,
                advice="data.reward=http needs an http(s)://HOST[:PORT]/PATH URL",
            )
        ]
    if d.reward_pool == RewardPool.PROCESS:
        return [Rule("reward service", False, f"{values}, data.reward_pool={d.reward_pool}",
                     advice="requests wait on the network in threads: set data.reward_pool=thread")]  # fmt: skip
    return [Rule("reward service", True, f"{values}, {d.reward_batch_size} responses a request, "
                 f"{d.reward_workers} request(s) at a time")]  # fmt: skip


def build_scorer(config) -> RewardScorer:
    """The scorer of `data.reward` for `data.task` (config meets rewards here)."""
    source = config.data.source
    task = get_task(source.name) if source.kind == TaskKind.SYNTHETIC else None
    return RewardScorer(config.data.reward, task=task, tokenizer=build_tokenizer(config), data=config.data)


def build_prompt_source(config) -> PromptSource:
    """The seeded prompt stream of `data.task`, formatted by the `data.*` template keys."""
    d = config.data
    return PromptSource(
        d.source,
        seed=config.run.seed,
        tokenizer=build_tokenizer(config),
        prompt_key=d.prompt_key,
        answer_key=d.answer_key,
        max_prompt_len=d.max_prompt_len,
        prompt_template=d.prompt_template,
        chat=ChatFormat(d.system_prompt, dict(d.chat_template_kwargs)) if d.chat_template else None,
    )
