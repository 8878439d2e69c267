"""Rules: one constraint on a recipe, whether it holds, and the numbers behind it.

Every component states what it needs of a recipe as a list of `Rule`s (the recipe's own
consistency, the trainer's layout, the engine's capabilities, placement, rewards and inputs);
`moe_rl.orchestration.preflight` asks each of them and is the only caller that enforces them, so
`plan` prints exactly the rules that `config check`, `submit` and `train` refuse a recipe by.
A rule that is not ``fatal`` is a warning: `plan` shows it, nothing refuses the recipe for it.
Imports nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    """One constraint: its name, whether it holds, and the values behind it."""

    name: str
    ok: bool
    detail: str
    fatal: bool = True
    """A broken fatal rule refuses the recipe; a broken non-fatal one is a warning."""

    @property
    def broken(self) -> bool:
        """Refuses the recipe: fatal and not holding."""
        return self.fatal and not self.ok

    @property
    def message(self) -> str:
        """``name: detail``, the line an error or warning says."""
        return f"{self.name}: {self.detail}"


def first_broken(rules: Iterable[Rule]) -> None:
    """Raise ``ValueError`` with the message of the first broken (fatal) rule."""
    for rule in rules:
        if rule.broken:
            raise ValueError(rule.message)


def divisible(name: str, value: int, value_name: str, divisor: int, divisor_name: str) -> Rule:
    """``value`` is a multiple of ``divisor`` (a divisor of 0 never divides)."""
    ok = divisor > 0 and value % divisor == 0
    verb = "is" if ok else "is not"
    return Rule(name, ok, f"{value_name}={value} {verb} divisible by {divisor_name}={divisor}")
