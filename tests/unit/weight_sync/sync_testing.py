"""Helpers of the weight-sync tests."""

from __future__ import annotations

import pickle
import subprocess
import sys


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
