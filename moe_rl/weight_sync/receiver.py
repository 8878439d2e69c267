"""The receiving side of a weight sync (`protocol.WeightReceiver`): `decoded`, `Assembly`, `ModelReceiver`."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping

import torch
from torch import Tensor

from moe_rl.weight_sync import ipc
from moe_rl.weight_sync.buckets import Bucket
from moe_rl.weight_sync.wire import Rejoin, decode


def decoded(
    bucket: Bucket,
    device: torch.device | str | None = None,
    into: Callable[[str], Tensor | None] | None = None,
    dtypes: Mapping[str, torch.dtype] | None = None,
    rejoin: Rejoin | None = None,
) -> Iterable[tuple[str, Tensor]]:
    """A bucket's weights as an engine computes with them (`wire.decode`), moved to ``device`` first if given
    (the FP8 bytes, not their values). A bucket in a sender's device buffer then waits for that device's work,
    so the buffer is not overwritten while read."""
    items = [(entry.name, tensor, entry.meta) for entry, tensor in bucket.tensors()]
    if device is not None:
        items = [(name, tensor.to(device), meta) for name, tensor, meta in items]
    yield from decode(items, into, dtypes, rejoin)
    if bucket.ipc is not None:
        ipc.ready(bucket.data.device)


class Assembly:
    """Wholes (a Megatron tensor of its HF pieces, a vLLM layer of its tensors) put together over the
    buckets of one sync, each handed on once all its parts arrived. A part still waiting at the end of
    a bucket is copied (the sender reuses the buffer) unless ``owned`` says it is no view of it."""

    def __init__(
        self, wholes: Mapping[str, str], owned: Callable[[str, Tensor], bool] = lambda n, t: False,
        kind: str = "tensors",
    ):  # fmt: skip
        """``wholes``: every part's name -> its whole; ``kind``: what a whole is, in the errors."""
        self.wholes, self.owned, self.kind = dict(wholes), owned, kind
        self.size = Counter(self.wholes.values())
        self.done: set[str] = set()
        self._open: dict[str, dict[str, Tensor]] = {}

    def add(self, named: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, dict[str, Tensor]]]:
        """``(whole, parts)`` of each whole ``named`` (a bucket's parts) completes; a stray part raises."""
        arrived = []
        for name, tensor in named:
            whole = self.wholes.get(name)
            if whole is None:
                raise ValueError(f"weight {name!r} is not one this receiver holds")
            if whole in self.done or name in self._open.get(whole, {}):
                raise ValueError(f"weight {whole!r} arrived twice in one sync")
            parts = self._open.setdefault(whole, {})
            parts[name] = tensor
            arrived.append((whole, name))
            if len(parts) == self.size[whole]:
                del self._open[whole]
                self.done.add(whole)
                yield whole, parts
        for whole, name in arrived:  # a part waiting for a later bucket: its own copy
            parts = self._open.get(whole)
            if parts is not None and name in parts and not self.owned(name, parts[name]):
                parts[name] = parts[name].clone()

    def finish(self, expected: Iterable[str] = ()) -> None:
        """Raise unless every whole that began arrived whole and every one of ``expected`` came."""
        if self._open:
            whole, parts = next(iter(self._open.items()))
            raise ValueError(
                f"weight sync incomplete: {len(self._open)} of {len(self.size)} {self.kind} arrived in part, "
                f"e.g. {whole!r} (got {sorted(parts)[:4]} of {self.size[whole]})"
            )
        missing = set(expected) - self.done
        if missing:
            raise ValueError(
                f"weight sync incomplete: {len(missing)} of {len(set(expected))} {self.kind} never arrived, "
                f"e.g. {sorted(missing)[:3]}"
            )


class ModelReceiver:
    """Loads HF-named weights into a Megatron model as they arrive; `finish` checks every one came once.

    With ``trains`` (a LoRA model whose adapters arrive apart, ``lora.sync=adapters``), a sync after
    one that brought everything may bring only the tensors ``trains(megatron_name)`` accepts: the
    rest, the frozen base, stays as it was (`holds_all`)."""

    def __init__(self, model: torch.nn.Module, trains: Callable[[str], bool] | None = None):
        from moe_rl.megatron.hf_weights import hf_dtypes, hf_index

        adapters = trains is not None
        self.model, self.index, self.adapters = model, hf_index(model, adapters), adapters
        self.dtypes = hf_dtypes(model, adapters)
        """HF name -> the dtype of the Megatron tensor it loads into (what a piece that cannot be
        decoded in place is decoded to: the values it will hold, in half the bytes of float32 for bf16)."""
        self._trains = trains
        self.holds_all = False
        """A sync brought every tensor, and none was dropped since (`forget`)."""
        self._start({})

    def begin(self) -> None:
        from moe_rl.megatron.hf_weights import piece_views

        self._start(piece_views(self.model, self.adapters))

    def _start(self, views: dict[str, Tensor]) -> None:
        self.bytes = 0
        self._views = views
        self.in_place: dict[str, Tensor] = {}
        """HF name -> the view of the model it was decoded into, this sync (`place`)."""
        self.rejoin, self.assembly = Rejoin(), Assembly(self.index, self._owned)

    def place(self, name: str) -> Tensor | None:
        """The model's view HF tensor ``name`` fills, to decode straight into; None: it is loaded by copy."""
        view = self._views.get(name)
        if view is not None:
            self.in_place[name] = view
        return view

    def load(self, named: Iterable[tuple[str, Tensor]]) -> None:
        """Load each Megatron tensor once all its HF pieces came: one tensor's values are held at a time."""
        from moe_rl.megatron.hf_weights import load_hf_subset

        def ours() -> Iterator[tuple[str, Tensor]]:
            for name, tensor in named:
                if name in self.index:
                    yield name, tensor
                else:  # not a tensor of this model: load_hf_subset names it (or ignores it)
                    load_hf_subset(self.model, {name: tensor}, self.index)

        for _, group in self.assembly.add(ours()):
            if not all(self.in_place.get(n) is t for n, t in group.items()):  # else decoded in place
                load_hf_subset(self.model, group, self.index)
            self.bytes += sum(t.numel() * t.element_size() for t in group.values())

    def _owned(self, name: str, tensor: Tensor) -> bool:
        """Whether ``tensor`` is not a view of a bucket: the model's own view, or rejoined."""
        return self.in_place.get(name) is tensor or self.rejoin.owns(name, tensor)

    def finish(self) -> None:
        """Raise unless every tensor of the model arrived in this sync (once it holds them all, with
        ``trains``: every one that trains)."""
        self.rejoin.finish()
        wanted = set(self.index.values())
        if self._trains is not None and self.holds_all:
            wanted = {name for name in wanted if self._trains(name)}
        self.assembly.finish(wanted)
        self.holds_all = self.holds_all or wanted <= self.assembly.done

    def forget(self) -> None:
        """The model's weights were dropped: the next sync must bring every one."""
        self.holds_all = False
