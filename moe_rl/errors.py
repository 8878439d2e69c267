"""The project's base error for problems with what a user gave it: a recipe value, a dataset row,
stored trajectories, a reward function. `moe-rl` reports one of these as one line that names the
field / file / row / function and the value (the traceback goes to the run's log file), wherever
it was raised: in the driver or, through Ray, in a worker."""

from __future__ import annotations

import errno
import reprlib
from typing import Any

BRIEF_CHARS = 120
"""The most characters of a value a one-line error shows (`brief`, `clip`)."""


def brief(value: Any) -> str:
    """``repr(value)`` for an error line, cut to `BRIEF_CHARS` characters (a string's length said):
    a long value must not make the line long, nor slow to build (a long list is cut before it is
    printed whole)."""
    text = clip(_REPR.repr(value))
    return (
        f"{text} ({len(value)} characters)" if isinstance(value, str) and len(value) > BRIEF_CHARS else text
    )


def clip(text: str, limit: int = BRIEF_CHARS) -> str:
    """``text`` cut to ``limit`` characters for an error line."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = BRIEF_CHARS
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 8


class UserError(ValueError):
    """Bad input from the user; the message says what, where, and what would be valid."""


class ConfigError(UserError):
    """A recipe or override that cannot be used, with the offending key and what would be valid."""


class RewardFunctionError(UserError):
    """A reward function raised, or returned something that is not a finite number."""


class EnvError(UserError):
    """A multi-turn environment (`env.name`) cannot be loaded or built, or answered a turn with
    something that is not a valid `moe_rl.envs.StepResult`."""


class EnvironmentFault(UserError):
    """The machine refused a file operation: a full disk, a read-only file system, a path it may not
    write or read. Said as such, with the path."""


FAULTS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
}
"""The operating system's refusals that are the machine's state, not a bug: said in one line."""


def fault_of(exc: OSError) -> EnvironmentFault | None:
    """``exc`` as one line naming the path and the cause, when it is one of `FAULTS`."""
    cause = FAULTS.get(exc.errno)
    if cause is None:
        return None
    return EnvironmentFault(f"{exc.filename or 'a file'}: {cause}")


def user_error_of(exc: BaseException) -> UserError | None:
    """The `UserError` behind ``exc``: itself, or the cause Ray wrapped it in (a task's error
    reaches the driver as a ``RayTaskError`` whose ``cause`` is the worker's exception); an
    operating-system refusal of `FAULTS` becomes an `EnvironmentFault`."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, UserError) and type(exc).__module__.split(".")[0] != "ray":
            return exc
        if isinstance(exc, OSError) and fault_of(exc) is not None:
            return fault_of(exc)
        exc = getattr(exc, "cause", None) or exc.__cause__
        seen += 1
    return None
