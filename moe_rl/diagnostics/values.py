"""A diagnostic value: a number, or why it cannot be had (`NotAvailable`). Imports nothing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class NotAvailable:
    """A metric this engine or model cannot give, and why."""

    reason: str

    def __str__(self) -> str:
        return f"not available: {self.reason}"


Value = float | NotAvailable


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
