"""What a run carries from one step to the next, in one place (`RunState`), and its form in a
checkpoint (``driver.json``, beside the trainer's state)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RunState:
    """The run's state between steps; a checkpoint stores it (`to_json`) and a resume reads it back
    (`from_json`)."""

    step_done: int = -1
    """The last finished step (-1: none yet)."""
    version: int = 0
    """The policy version the engines hold."""
    stale_rejected: int = 0
    """Samples rejected so far as too stale to train on (`run.max_staleness`)."""
    flat_steps: int = 0
    """Steps in a row whose groups' rewards had no variance."""
    launched: dict[int, dict] = field(default_factory=dict)
    """Per step whose prompts are drawn but not trained on yet (an async run draws ahead), the
    prompt stream's state before them."""

    def end_step(self, step: int) -> None:
        """``step`` is done: a checkpoint now stores the state after it."""
        self.step_done = step
        for drawn in [s for s in self.launched if s <= step]:  # a checkpoint needs only later ones
            del self.launched[drawn]

    def to_json(self, source_now: dict) -> dict[str, Any]:
        """``driver.json``: this state after `step_done`, with the prompt stream as it was before the
        next step's prompts (``source_now``, its state now, when they are not drawn yet)."""
        return {
            "step": self.step_done,
            "version": self.version,
            "num_stale_rejected": self.stale_rejected,
            "flat_steps": self.flat_steps,
            "source": _jsonable(self.launched.get(self.step_done + 1, source_now)),
        }

    @classmethod
    def from_json(cls, state: dict[str, Any]) -> tuple[RunState, dict]:
        """The state a checkpoint stored, and the prompt stream's state to load (a checkpoint
        written before ``flat_steps`` was stored starts that count at 0)."""
        run = cls(
            step_done=state["step"], version=state["version"], stale_rejected=state["num_stale_rejected"],
            flat_steps=state.get("flat_steps", 0),
        )  # fmt: skip
        return run, state["source"]


def _jsonable(state: dict) -> dict:
    version, internal, gauss = state["rng"]
    return {"rng": [version, list(internal), gauss], "order": state["order"]}
