"""Weight syncs and decoding taking turns at token boundaries in one engine process (`SyncGate`):
what lets a Megatron engine take a sync while a generation decodes (`rollout.inflight_updates`)."""

from __future__ import annotations

import contextlib
import threading


class SyncGate:
    """Weight syncs and decoding take turns at token boundaries. A sync (`begin` ... `end`) waits
    until no generation decodes or the one that does has parked at its next token boundary
    (`boundary`); a generation that starts during a sync waits for its end (`decoding`). Where
    syncs and generation run in one thread (the one-process loop, or an engine actor whose calls
    run one at a time) a sync never meets a decoding generation and the gate only counts; with
    in-flight updates (`rollout.inflight_updates`) the engine actor runs syncs in a thread of their
    own, and a generation goes on after the sync with the new weights (its KV cache holds the keys
    and values the old ones computed)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._syncing = self._decoding = self._parked = False
        self.inflight = 0
        """Syncs that landed while a generation was decoding (it parked for them)."""

    def begin(self) -> None:
        with self._cond:
            self._syncing = True
            self._cond.wait_for(lambda: not self._decoding or self._parked)
            self.inflight += int(self._decoding)

    def end(self) -> None:
        with self._cond:
            self._syncing = False
            self._cond.notify_all()

    @contextlib.contextmanager
    def decoding(self):
        with self._cond:
            self._cond.wait_for(lambda: not self._syncing)
            self._decoding = True
        try:
            yield
        finally:
            with self._cond:
                self._decoding = False
                self._cond.notify_all()

    def boundary(self) -> bool:
        """Park here while a sync runs; whether one did."""
        with self._cond:
            if not self._syncing:
                return False
            self._parked = True
            self._cond.notify_all()
            self._cond.wait_for(lambda: not self._syncing)
            self._parked = False
            return True
