"""Engine replicas as the engine pool and its callers see them: `Replica`, and the pool's answer to a
call on every replica (`Answers`; a sync's answers are the coordinator's, `moe_rl.weight_sync.
coordinator.Begun` and `Finished`), each naming the replicas it restarted on the way. A restarted
replica is a new process without weights; the caller brings it to the engines' weights
(`moe_rl.weight_sync.coordinator.WeightSync.bring_up`) and, where it matters, asks it again.
Imports no Ray."""

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
