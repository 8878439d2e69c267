"""The rollout loop over turns: the model writes, the environment answers, the model goes on.

Engine-agnostic: it drives any `moe_rl.rollout.engine.RolloutEngine` (the Megatron engine, vLLM)
through its ordinary ``generate`` call, one call per turn for every trajectory still running, each
with its whole context so far as the prompt (vLLM's prefix cache keeps the shared prefix from being
recomputed; the Megatron engine prefills it again), seeded for its turn (`turn_seed`: no turn draws
what another turn, step or replica of the run draws). A model turn ends at EOS, at one of the
environment's stop tokens (e.g. the end of a tool call) or after ``rollout.max_new_tokens``, or
where the trajectory's budget ends (the call runs as long as the longest turn left, and a response
past its own trajectory's budget is cut there). Then
every environment of the turn steps at once (coroutines are awaited together), and what each
answers is appended to its context.

A trajectory ends when its environment says ``done`` (finish reason ``stop``), or when it reaches
``env.max_turns`` model turns or the token budget ``env.max_tokens`` of its response (``length``).
An answer is written when a model turn follows it (which computes its positions: the routing trace
covers them), so not after the last model turn nor when the budget is spent. An answer longer than
what is left of the budget but one token is what ``env.overflow`` says: ``truncate`` writes the
tokens that fit, the model then writes the budget's last token (counted in
``env/truncated_share``); ``refuse`` stops the run with one line. Its reward is the sum of its
environment's step rewards.

The result is one `TrajectoryBatch` (``moe_rl.data.trajectory``, "Multi-turn trajectories"): the
first context is the prompt, the rest the response, with ``sampled`` False on environment tokens
(rollout log-prob NaN, empty kept set, the version of the turn before). The routing trace of a
trajectory is stitched from its turns: each position keeps the routing of the call that computed
it first, the one the next token was sampled with; environment tokens are routed by the call that
prefilled them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from moe_rl.config.modes import EnvOverflow
from moe_rl.data import ragged
from moe_rl.data.trajectory import Sample, TrajectoryBatch
from moe_rl.envs.base import Environment, StepResult, check_step_result
from moe_rl.errors import EnvError
from moe_rl.rewards.tasks import Prompt
from moe_rl.rollout.engine import SamplingSpec, turn_seed


@dataclass(frozen=True)
class TurnLimits:
    """How long a trajectory may run (`env.max_turns`, `env.max_tokens`), what an answer longer
    than what is left becomes (`env.overflow`), and the longest first context
    (`data.max_prompt_len`: the engines and the trainer are sized for it)."""

    max_turns: int
    max_tokens: int
    max_prompt_len: int
    overflow: EnvOverflow = EnvOverflow.TRUNCATE

    @classmethod
    def of(cls, config: Any) -> TurnLimits:
        """The limits of a recipe."""
        env = config.env
        return cls(env.max_turns, env.max_tokens, config.data.max_prompt_len, env.overflow)


@dataclass
class _Episode:
    """One trajectory under way: its environment, context and what each response token carries."""

    env: Environment
    group_id: int
    prompt: list[int]
    context: list[int]
    index: int
    """The trajectory's place in the rollout's batch."""
    tokens: list[Tensor] = field(default_factory=list)
    sampled: list[Tensor] = field(default_factory=list)
    logp: list[Tensor] = field(default_factory=list)
    kept_ids: list[Tensor] = field(default_factory=list)
    kept_lengths: list[Tensor] = field(default_factory=list)
    versions: list[Tensor] = field(default_factory=list)
    trace: Tensor | None = None
    has_kept: bool = False
    reward: float = 0.0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    truncated: bool = False
    finish: str | None = None

    @property
    def used(self) -> int:
        return len(self.context) - len(self.prompt)

    def add_turn(self, sample: Sample, versions: Tensor) -> None:
        self.tokens.append(sample.response_ids)
        self.sampled.append(torch.ones(sample.response_ids.numel(), dtype=torch.bool))
        self.logp.append(sample.rollout_logp)
        if sample.sampling_mask_ids is not None and sample.sampling_mask_offsets is not None:
            self.has_kept = True
            self.kept_ids.append(sample.sampling_mask_ids)
            self.kept_lengths.append(sample.sampling_mask_offsets[1:] - sample.sampling_mask_offsets[:-1])
        self.versions.append(versions)
        if sample.routed_experts is not None:  # the rows this call computed first
            known = 0 if self.trace is None else self.trace.shape[0]
            new = sample.routed_experts[known:]
            self.trace = new if self.trace is None else torch.cat([self.trace, new])
        self.context += sample.response_ids.tolist()
        self.turns += 1

    def add_observation(self, observation: list[int]) -> None:
        size = len(observation)
        self.tokens.append(torch.tensor(observation, dtype=torch.int32))
        self.sampled.append(torch.zeros(size, dtype=torch.bool))
        self.logp.append(torch.full((size,), float("nan")))
        self.kept_ids.append(torch.zeros(0, dtype=torch.int32))
        self.kept_lengths.append(torch.zeros(size, dtype=torch.int64))
        self.versions.append(self.versions[-1][-1:].expand(size))
        self.context += observation

    def to_sample(self) -> Sample:
        versions = torch.cat(self.versions)
        change = torch.ones(versions.numel(), dtype=torch.bool)
        change[1:] = versions[1:] != versions[:-1]
        starts = change.nonzero().flatten()
        out = Sample(
            prompt_ids=torch.tensor(self.prompt, dtype=torch.int32),
            response_ids=torch.cat(self.tokens),
            rollout_logp=torch.cat(self.logp),
            reward=self.reward,
            group_id=self.group_id,
            finish_reason=self.finish or "length",
            version_spans=list(zip(starts.tolist(), versions[starts].tolist(), strict=True)),
            routed_experts=self.trace,
            sampled=torch.cat(self.sampled),
        )
        if self.has_kept:
            out.sampling_mask_ids = torch.cat(self.kept_ids)
            out.sampling_mask_offsets = ragged.offsets_from_lengths(torch.cat(self.kept_lengths))
        return out


class MultiTurnRollout:
    """Multi-turn rollouts on ``engine`` with one ``make_env()`` environment per trajectory (see the
    module docstring). ``generate`` returns the batch and the environment metrics of `env_metrics`."""

    def __init__(
        self, engine: Any, make_env: Callable[[], Environment], limits: TurnLimits, vocab_size: int,
        env_name: str = "environment",
    ):  # fmt: skip
        self.engine, self.make_env, self.limits = engine, make_env, limits
        self.vocab_size, self.env_name = vocab_size, env_name
        self._last: TrajectoryBatch | None = None  # the last call's batch: engine, recipe, MoE shape

    def generate(
        self, prompts: Sequence[Prompt], sampling: SamplingSpec, group_ids: Sequence[int] | None = None
    ) -> tuple[TrajectoryBatch, dict[str, float]]:
        """``sampling.n`` trajectories per prompt, prompt by prompt."""
        groups = range(len(prompts)) if group_ids is None else group_ids
        if len(groups) != len(prompts):
            raise ValueError(
                f"group_ids: {len(groups)} given for {len(prompts)} prompts; expected one per prompt"
            )
        episodes, env_seconds = self._reset(prompts, groups, sampling.n)
        stop = tuple(dict.fromkeys((*sampling.stop_token_ids, *episodes[0].env.stop_token_ids)))
        version = self.engine.policy_version
        for turn in range(self.limits.max_turns):
            live = [e for e in episodes if e.finish is None]
            if not live:
                break
            version = max(version, self._model_turn(live, sampling, stop, turn))
            start = time.perf_counter()
            results = _run_all([e.env.step(list(e.tokens[-1].tolist())) for e in live])
            env_seconds += time.perf_counter() - start
            for episode, result in zip(live, results, strict=True):
                self._answer(episode, result)
        for episode in episodes:
            episode.finish = episode.finish or "length"
        assert self._last is not None  # max_turns >= 1: one call at least
        batch = TrajectoryBatch.from_samples(
            [e.to_sample() for e in episodes], engine=self._last.engine, quant_recipe=self._last.quant_recipe,
            policy_version=version, num_experts=self._last.num_experts,
        )  # fmt: skip
        return batch, _stats(episodes, env_seconds)

    def _reset(
        self, prompts: Sequence[Prompt], groups: Sequence[int], n: int
    ) -> tuple[list[_Episode], float]:
        start = time.perf_counter()
        envs = [self.make_env() for _ in range(len(prompts) * n)]
        contexts = _run_all([env.reset(p) for env, p in zip(envs, (p for p in prompts for _ in range(n)))])
        episodes = []
        for i, (env, context) in enumerate(zip(envs, contexts, strict=True)):
            ids = [int(t) for t in context]
            where = f"env {self.env_name}: reset returned a context of {len(ids)} tokens (trajectory {i})"
            if not ids or len(ids) > self.limits.max_prompt_len:
                raise EnvError(
                    f"{where}; expected 1 to data.max_prompt_len={self.limits.max_prompt_len} tokens"
                )
            if min(ids) < 0 or max(ids) >= self.vocab_size:
                raise EnvError(
                    f"{where} with ids outside [0, {self.vocab_size}) (model.vocab_size): {ids[:16]}"
                )
            episodes.append(_Episode(env, int(groups[i // n]), ids, list(ids), i))
        return episodes, time.perf_counter() - start

    def _model_turn(
        self, live: list[_Episode], sampling: SamplingSpec, stop: tuple[int, ...], turn: int
    ) -> int:
        """One ``generate`` call for every trajectory still running, seeded for the rollout's turn
        ``turn`` (`turn_seed` of its batch's seed) and as long as the longest turn left to them
        (``rollout.max_new_tokens``, or less where every budget is nearly spent); a response past
        its own trajectory's budget is cut there (`_cut`). Returns the weight version that sampled."""
        lengths = [min(sampling.max_new_tokens, self.limits.max_tokens - e.used) for e in live]
        seed = None if sampling.seed is None else turn_seed(sampling.seed, turn)
        spec = dataclasses.replace(sampling, n=1, max_new_tokens=max(lengths), seed=seed, stop_token_ids=stop)
        batch = self.engine.generate([e.context for e in live], spec)
        self._last = batch
        versions = batch.token_versions()
        for i, (e, length) in enumerate(zip(live, lengths, strict=True)):
            sample, start = _cut(batch.sample(i), length), int(batch.response_offsets[i])
            e.add_turn(sample, versions[start : start + sample.response_ids.numel()])
        return batch.policy_version

    def _answer(self, episode: _Episode, result: StepResult) -> None:
        """The environment's answer to the episode's last turn: reward, done, or its observation,
        written whole if it leaves a token of the budget for the model's next turn (which routes it,
        `routed_experts`), else as `TurnLimits.overflow` says."""
        check_step_result(result, self.vocab_size, f"env {self.env_name}")
        episode.reward += float(result.reward)
        episode.tool_calls += result.tool_calls
        episode.tool_errors += result.tool_errors
        observation = [int(t) for t in result.observation]
        room = self.limits.max_tokens - episode.used - 1  # what an answer may take: the model needs a token
        if result.done:
            episode.finish = "stop"
        elif episode.turns >= self.limits.max_turns or room < 0:
            episode.finish = "length"  # no model turn left to read an answer
        elif len(observation) <= room:
            episode.add_observation(observation)
        elif self.limits.overflow == EnvOverflow.REFUSE:
            raise EnvError(
                f"env {self.env_name}: an answer of {len(observation)} tokens (trajectory {episode.index}, after "
                f"model turn {episode.turns}) does not fit env.max_tokens={self.limits.max_tokens} with "
                f"{episode.used} used (at most {room}: the model's next turn needs one); raise env.max_tokens, "
                "make the answers shorter, or set env.overflow=truncate"
            )
        else:  # the tokens that fit, then the model's last token
            episode.truncated = True
            if room == 0:
                episode.finish = "length"
            else:
                episode.add_observation(observation[:room])


def _cut(sample: Sample, length: int) -> Sample:
    """``sample``'s first ``length`` response tokens (itself when it has no more): what an engine
    asked for ``length`` tokens would have sampled, since each token depends on those before it
    only; finish reason ``length``. Its kept sets and routing trace are cut with it (every kept
    position was computed: a later token was sampled from it)."""
    if sample.response_ids.numel() <= length:
        return sample
    masks = {}
    if sample.sampling_mask_ids is not None and sample.sampling_mask_offsets is not None:
        offsets = sample.sampling_mask_offsets[: length + 1]
        masks = {
            "sampling_mask_ids": sample.sampling_mask_ids[: int(offsets[-1])],
            "sampling_mask_offsets": offsets,
        }
    trace = sample.routed_experts
    return dataclasses.replace(
        sample, response_ids=sample.response_ids[:length], rollout_logp=sample.rollout_logp[:length],
        finish_reason="length", version_spans=[(t, v) for t, v in sample.version_spans if t < length],
        routed_experts=None if trace is None else trace[: sample.prompt_ids.numel() + length], **masks,
    )  # fmt: skip


def _run_all(calls: list[Any]) -> list[Any]:
    """The results of environment calls, awaiting the coroutines among them concurrently."""
    if not any(inspect.isawaitable(c) for c in calls):
        return calls

    async def gather() -> list[Any]:
        async def one(call: Any) -> Any:
            return await call if inspect.isawaitable(call) else call

        return await asyncio.gather(*(one(c) for c in calls))

    return asyncio.run(gather())


def _stats(episodes: list[_Episode], env_seconds: float) -> dict[str, float]:
    return {
        "trajectories": float(len(episodes)),
        "turns": float(sum(e.turns for e in episodes)),
        "tool_calls": float(sum(e.tool_calls for e in episodes)),
        "tool_errors": float(sum(e.tool_errors for e in episodes)),
        "done": float(sum(e.finish == "stop" for e in episodes)),
        "truncated": float(sum(e.truncated for e in episodes)),
        "env_seconds": env_seconds,
    }


def env_metrics(parts: Sequence[dict[str, float]]) -> dict[str, float]:
    """The step's environment metrics from each replica's `MultiTurnRollout.generate` counts (the
    sampled and environment token counts are `moe_rl.orchestration.batches.length_metrics`')."""
    parts = [p for p in parts if p]
    if not parts:
        return {}
    total = {k: sum(p[k] for p in parts) for k in parts[0]}
    n = max(total["trajectories"], 1.0)
    return {
        "env/turns_per_trajectory": total["turns"] / n,
        "env/tool_calls_per_trajectory": total["tool_calls"] / n,
        "env/tool_errors": total["tool_errors"],
        "env/tool_error_share": total["tool_errors"] / max(total["tool_calls"], 1.0),
        "env/done_share": total["done"] / n,
        "env/truncated_share": total["truncated"] / n,
        "env/seconds": total["env_seconds"],
    }


class SingleTurn:
    """One prompt, one response: the engine's own ``generate`` behind the multi-turn signature."""

    def __init__(self, engine: Any):
        self.engine = engine

    def generate(
        self, prompts: Sequence[Prompt], sampling: SamplingSpec, group_ids: Sequence[int] | None = None
    ) -> tuple[TrajectoryBatch, dict[str, float]]:
        return self.engine.generate([list(p.ids) for p in prompts], sampling, group_ids), {}


def rollouts_for(config: Any, engine: Any, env_factory: Any = None) -> SingleTurn | MultiTurnRollout:
    """The rollout loop of a recipe: multi-turn with `env.name`'s environment (``env_factory``, or
    one built here), else single-turn."""
    env = config.env
    if not env.name:
        return SingleTurn(engine)
    if env_factory is None:
        from moe_rl.envs.registry import build_env_factory

        env_factory = build_env_factory(env.name, dict(env.kwargs))
    return MultiTurnRollout(engine, env_factory, TurnLimits.of(config), config.model.vocab_size, env.name)
