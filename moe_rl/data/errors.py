"""The error types of ``moe_rl.data``: bad trajectory input, named precisely."""

from __future__ import annotations

import os
from typing import Any

from moe_rl.errors import UserError

_UNSET: Any = object()


def _describe(
    field: str, problem: str, sample: int | None, token: int | None, value: Any, expected: str | None
) -> str:
    where = [f"{name} {index}" for name, index in (("sample", sample), ("token", token)) if index is not None]
    head = field + (f" ({', '.join(where)})" if where else "")
    message = f"{head}: {problem}" if head else problem
    if value is not _UNSET:
        message += f"; got {value!r}"
    if expected is not None:
        message += f"; expected {expected}"
    return message


class TrajectoryError(UserError):
    """A trajectory (or an engine output being converted into one) is malformed.

    The message names the field, the sample index and, where relevant, the token index inside
    that sample, the offending value and what would be valid, e.g.::

        rollout_logp (sample 3, token 17): log-prob must be finite and <= 0.0001; got 0.25

    The same pieces are kept as attributes (``field``, ``problem``, ``sample``, ``token``,
    ``value``, ``expected``) so callers can act on them without parsing the message.
    """

    def __init__(
        self,
        field: str,
        problem: str,
        *,
        sample: int | None = None,
        token: int | None = None,
        value: Any = _UNSET,
        expected: str | None = None,
    ) -> None:
        self.field, self.problem, self.expected = field, problem, expected
        self.sample = sample
        self.token = token
        self.value = None if value is _UNSET else value
        self._value = value
        super().__init__(self._location() + _describe(field, problem, sample, token, value, expected))

    def _location(self) -> str:
        return ""


class ShardError(TrajectoryError):
    """Stored trajectories (a shard file or its manifest) are unreadable or break the contract.

    The message starts with the file; ``path`` keeps it. ``field`` is the trajectory field, the
    Arrow column or the manifest key at fault ("" when the file as a whole is), and ``sample``
    counts samples from the start of that file::

        runs/a/trajectories/step_000003/shard-00000.arrow: rollout_logp (sample 2, token 0):
            log-prob must be finite and <= 0 (processed log-probs); got 5.0; expected finite and <= 0.0001
        runs/a/trajectories/step_000003/manifest.json: not valid JSON: Expecting value: line 1 column 1 (char 0)
    """

    def __init__(self, path: str | os.PathLike[str], field: str, problem: str, **details: Any) -> None:
        self.path = str(path)
        super().__init__(field, problem, **details)

    def _location(self) -> str:
        return f"{self.path}: "

    @classmethod
    def wrap(
        cls, path: str | os.PathLike[str], error: TrajectoryError, *, first_sample: int = 0
    ) -> ShardError:
        """``error`` (from ``validate``) located in file ``path``, whose batch starts at ``first_sample``."""
        sample = None if error.sample is None else error.sample + first_sample
        return cls(
            path, error.field, error.problem,
            sample=sample, token=error.token, value=error._value, expected=error.expected,
        )  # fmt: skip


class ShardNotFoundError(ShardError, FileNotFoundError):
    """A manifest, a shard file it lists, or a trajectory folder does not exist (also a
    ``FileNotFoundError``, so callers that handle missing files keep working)."""
