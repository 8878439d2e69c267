"""Rules: one constraint on a recipe, whether it holds, and the numbers behind it.

Every component states what it needs of a recipe as a list of `Rule`s (the recipe's own
consistency, the trainer's layout, the engine's capabilities, placement, rewards and inputs);
`moe_rl.orchestration.preflight` asks each of them before anything loads (and components check
their own again where they start), so `plan` prints exactly the rules that `config check`, `submit`
and `train` refuse a recipe by. A rule that is not ``fatal`` is a warning: `plan` shows it, nothing
refuses the recipe for it. A rule is data: its values, and apart from them the advice a refusal
gives, so `plan` shows a rule that holds by its values alone.
Imports nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    """One constraint: its name, whether it holds, the values behind it, and what to do when it
    does not hold."""

    name: str
    ok: bool
    values: str
    """The values the rule is about (``key=value``, the numbers it compares): what `plan` shows for
    a rule that holds."""
    fatal: bool = True
    """A broken fatal rule refuses the recipe; a broken non-fatal one is a warning."""
    advice: str = ""
    """Why those values matter and what to change: said after them when the rule does not hold
    (empty where the values say it all)."""

    @property
    def detail(self) -> str:
        """The values and the advice: what a refusal or a warning says."""
        return f"{self.values}: {self.advice}" if self.advice else self.values

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
