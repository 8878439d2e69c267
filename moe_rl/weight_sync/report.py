"""What one weight sync did, typed: `SyncReport`, and the one place its metrics are named."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moe_rl.quant.recipes import QuantReport


@dataclass
class SyncReport:
    """One sync: the senders' totals, what the receivers said when it finished, and how long it took."""

    version: int = 0
    bytes: int = 0
    in_place: int = 0
    """Of ``bytes``, those receivers read where the sender holds them (its shared arena)."""
    buckets: int = 0
    senders: int = 0
    """Trainer ranks that sent something (each pipeline stage, each expert-parallel owner)."""
    shared_memory: bool = True
    """Every sender's buckets travelled through shared memory."""
    quant: QuantReport | None = None
    """The quantization recipe's report of what was sent (quantized on the sending side)."""
    received: dict[str, Any] = field(default_factory=dict)
    """What a receiver reported when it finished (numbers and the recipe's name)."""
    seconds: float = 0.0
    transports: set[str] = field(default_factory=set)
    """How the senders' buckets travelled (`moe_rl.weight_sync.transport.Transport.name`)."""
    dead: set[int] = field(default_factory=set)
    """Receivers whose process died during the sync."""
    adapters_only: bool = False
    """It carried only what trains of a LoRA run (the engines held the base: ``lora.sync=adapters``)."""

    def merge(self, other: SyncReport) -> SyncReport:
        """Add another sender's part of the same sync."""
        self.bytes += other.bytes
        self.in_place += other.in_place
        self.buckets += other.buckets
        self.dead |= other.dead
        self.transports |= other.transports
        self.adapters_only = self.adapters_only or other.adapters_only
        if other.buckets:
            self.senders += other.senders
            self.shared_memory = self.shared_memory and other.shared_memory
        if other.quant is not None:
            base = QuantReport(other.quant.recipe) if self.quant is None else self.quant
            self.quant = base.merge(other.quant)
        return self

    def metrics(self) -> dict[str, float | int | str]:
        """The sync's metrics as a run logs them: the receivers' (``sync/`` unless they name their
        own prefix, as ``quant/``), the recipe's report of what was sent, the streamed totals."""
        out: dict[str, Any] = {}
        for key, value in self.received.items():
            if isinstance(value, (int, float, str)):
                out[key if "/" in key else f"sync/{key}"] = value
        if self.quant is not None:
            out.update(self.quant.summary())
        return out | {
            "sync/bytes": self.bytes,
            "sync/in_place_bytes": self.in_place,
            "sync/buckets": self.buckets,
            "sync/senders": self.senders,
            "sync/shared_memory": int(self.shared_memory),
            "sync/transport": ",".join(sorted(self.transports)) or "none",
            "sync/adapters_only": int(self.adapters_only),
            "sync/seconds": self.seconds,
        }
