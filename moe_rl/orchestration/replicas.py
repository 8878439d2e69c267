"""Engine replicas as the engine pool and its callers see them: `Replica`, and the pool's answers,
each naming the replicas it restarted on the way. A restarted replica is a new process without
weights; the caller brings it to the engines' weights (`moe_rl.orchestration.weight_sync.
WeightSync.bring_up`) and, where it matters, asks it again. Imports no Ray."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Replica:
    """One engine replica of the pool: its index, its process (an actor, or the engine in this
    process) and how often it was restarted."""

    index: int
    actor: Any = None
    restarts: int = 0


@dataclass
class Begun:
    """The answer to a sync's ``begin``: the replicas told that it begins, and those whose process
    had died (restarted: they take the sync again)."""

    began: list[Replica]
    restarted: list[Replica] = field(default_factory=list)


@dataclass
class Finished:
    """The answer to a sync's ``finish``: what the last replica that took the version reported,
    the replicas whose process died on the way (restarted) and the live ones whose weight stream
    broke (``cut_off``, their weights partly new; ``error``: the last break's cause). Both take the
    sync again."""

    received: dict[str, Any] = field(default_factory=dict)
    restarted: list[Replica] = field(default_factory=list)
    cut_off: list[Replica] = field(default_factory=list)
    error: Exception | None = None


@dataclass
class Answers:
    """The answer to a call on every replica (``sleep``, ``wake_up``): each key's largest value over
    the replicas that answered, and those whose process had died (restarted, awake: they did not
    answer)."""

    most: dict[str, float] = field(default_factory=dict)
    restarted: list[Replica] = field(default_factory=list)

    def merged(self, other: Answers) -> Answers:
        """These answers and ``other``'s (the same call asked again of the restarted replicas)."""
        keys = self.most.keys() | other.most.keys()
        most = {key: max(self.most.get(key, 0.0), other.most.get(key, 0.0)) for key in keys}
        return Answers(most, other.restarted)
