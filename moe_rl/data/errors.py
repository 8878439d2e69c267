"""The one error type of ``moe_rl.data``: bad trajectory input, named precisely."""

from __future__ import annotations

from typing import Any

_UNSET: Any = object()


class TrajectoryError(ValueError):
    """A trajectory (or an engine output being converted into one) is malformed.

    The message names the field, the sample index and, where relevant, the token index inside
    that sample, the offending value and what would be valid, e.g.::

        rollout_logp (sample 3, token 17): log-prob must be finite and <= 0.0001; got 0.25

    The same pieces are kept as attributes (``field``, ``sample``, ``token``, ``value``) so
    callers can act on them without parsing the message.
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
        self.field = field
        self.sample = sample
        self.token = token
        self.value = None if value is _UNSET else value
        where = []
        if sample is not None:
            where.append(f"sample {sample}")
        if token is not None:
            where.append(f"token {token}")
        message = field + (f" ({', '.join(where)})" if where else "") + f": {problem}"
        if value is not _UNSET:
            message += f"; got {value!r}"
        if expected is not None:
            message += f"; expected {expected}"
        super().__init__(message)
