"""Helpers of the weight-sync tests."""

from __future__ import annotations

import pickle
import subprocess
import sys
from dataclasses import replace

import numpy as np
import torch


def in_another_process(code: str, sent: object) -> float:
    """Run ``code`` in a fresh Python process with ``sent`` pickled on its standard input (as
    ``sent = pickle.loads(...)``); the float it prints."""
    program = f"import pickle, sys, torch\nsent = pickle.loads(sys.stdin.buffer.read())\n{code}"
    out = subprocess.run(
        [sys.executable, "-c", program], input=pickle.dumps(sent), capture_output=True, check=True
    )
    return float(out.stdout)


def encode(encoder, name: str, tensor):
    """What travels for HF tensor ``name``: the encoder's group written into a bucket as a sender's
    packer writes it, read back as ``[(name, tensor, meta)]`` (a tensor that travels as it lies is a
    view of ``tensor`` itself)."""
    from moe_rl.weight_sync.buckets import BucketPacker

    group = encoder.lazy_group([(name, tensor)])
    (bucket,) = BucketPacker(max(group.nbytes, 1)).pack(iter([group]))
    return [(entry.name, value, entry.meta) for entry, value in bucket.tensors()]


def detach(bucket):
    """``bucket`` with its own copy of the bytes, those read in an arena included (to keep it past
    the next one the packer yields)."""
    from moe_rl.weight_sync.buckets import Bucket
    from moe_rl.weight_sync.shm import aligned, read_slot

    buffer = np.zeros(sum(aligned(entry.nbytes) for entry in bucket.entries), dtype=np.uint8)
    entries, at = [], 0
    for entry in bucket.entries:
        if entry.source is not None:
            raw = read_slot(entry.source)
        elif entry.array is not None:
            raw = bucket.arrays[entry.array]
        else:
            raw = bucket.data[entry.offset :][: entry.nbytes]
        if isinstance(raw, torch.Tensor):  # copied by torch: no NumPy view of the sender's tensor
            torch.from_numpy(buffer[at : at + entry.nbytes]).copy_(raw.reshape(-1).view(torch.uint8))
        else:
            buffer[at : at + entry.nbytes] = raw
        entries.append(replace(entry, offset=at, source=None, array=None))
        at += aligned(entry.nbytes)
    return Bucket(entries, buffer, bucket.index, bucket.sender, part=bucket.part, last=bucket.last)


def bucket_items(bucket) -> list:
    """The ``(name, tensor, meta)`` a bucket carries (views into its buffer), as `wire.decode` takes them."""
    return [(entry.name, tensor, entry.meta) for entry, tensor in bucket.tensors()]


def lazy(groups):
    """Groups of ``(name, tensor, meta)`` as the `wire.LazyGroup` a packer takes: each tensor copied
    into the bucket as it is (or, where the packer may, carried as it lies)."""
    from moe_rl.device import copy_into
    from moe_rl.weight_sync.wire import LazyGroup, Piece

    def one(items):
        def fill(views):
            for (_, tensor, _), view in zip(items, views, strict=True):
                if view is not None:
                    copy_into(view, tensor)

        return LazyGroup([Piece(name, t.dtype, tuple(t.shape), meta, t) for name, t, meta in items], fill)

    return (one(items) for items in groups)
