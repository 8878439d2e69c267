"""Weight sync throughput and memory: the bucketed sync as the runtime does it, against a raw copy and a
raw Ray transfer of the same bytes, measured in one process.

Run: ``python bench/weight_sync.py [--quick]`` (CPU, 2 cores: about 2 min with ``--quick``, about 4-5
min without; most of it is FP8 encoding and decoding, which on CPU run at ~0.9 and ~4 G elements/s,
`quant.fused`). The bench starts itself again under the run's process environment
(`orchestration.placement.PROCESS_ENV`) when it was not started with it, as a run's processes are.

How many times each byte is copied sets the bound. A tensor the sender must compute (quantized
bytes, a gathered or non-contiguous one) or that it does not hold in shared memory is copied twice:
the sender writes it into a slot, each receiver reads it into its weights. A tensor that travels as it
is and lies in the sender's shared arena (a CPU trainer rank's parameters, `weight_sync.sender.
share_parameters`; here the synthetic state and the tiny model are placed there the same way) is
copied once, by each receiver, from where the trainer holds it. On a 2-core CPU machine a copy is
bound by the cores that run it and by memory bandwidth: with the run's non-temporal copy setting
(`moe_rl.device.NON_TEMPORAL_COPY_BYTES`) NumPy's ``memmove`` copies ~11 GB/s on one thread and
~20-25 GB/s on two (``mm`` below), torch's ``copy_`` ~11-16 GB/s on two (the raw copy below, which
that setting does not change). So a one-receiver bf16 sync through the arena, whose receiver copies
on both cores while the sender only hands out entries, can pass a two-thread ``copy_``; two
receivers copy every byte twice between them (each engine loads its own copy), so per sync they get
about half of what one gets (per byte landed in an engine, as much); the ``store`` transport copies
twice (``ray.put`` straight from where the sender holds a tensor, `weight_sync.buckets.Bucket.
arrays`, then the load; a computed tensor a third time, into the pack buffer first) and runs at
about the speed of a raw Ray transfer of the same bytes. FP8 rows are bound by the receiver's
decoding into the float values a fake-quantizing engine holds (receivers decode 67-93 % of the
time), not by the transport: a decode reads each e4m3 byte and writes a 2-byte weight. It runs as
one fused compiled kernel per weight (`quant.fused`, ~4 G elements/s on 2 threads alone, near
what memory allows for 1 byte read and 2 written with ordinary stores), so per byte moved it costs
about three times a copy of the e4m3 bytes. FP8 inline adds the sender's quantization (one fused
kernel too, with the error measure: ~0.9 G elements/s on 2 threads), which shares the 2 cores with
the receivers. Measured on 2 cores, quiet machine (synthetic state, ``%copy``): bf16 ``shm`` one
receiver 84-118 %, two receivers 47-73 % (95-145 % per byte landed); bf16 ``store`` one receiver
31-66 % (62-114 % of the raw Ray transfer), two 26-46 %; FP8 transport 12-24 % (4-9 % with the
torch-operation decode); FP8 inline ~5 % (~1 % with torch operations). The first FP8 sync of each
process compiles the kernels (10-20 s; not timed: the memory pass runs first).

* Sender: this process (the Ray driver, not an actor) does what a trainer rank's sender does: a
  `BucketPacker` kept from sync to sync fills each bucket and `weight_sync.transport.publish` hands it to
  every receiver, then waits for the previous bucket's deliveries (at most two buckets in flight). It
  copies tensors into a bucket on one thread (`moe_rl.device.copy_into`), leaving the other core to
  the receivers, and writes nothing for a tensor of its arena that travels as it is. Ray starts its
  workers at nice 15 and the driver runs at nice 0, so the bench starts the receivers at nice 0
  (``RAY_worker_niceness``; in the runtime sender and engines are all actors, at one priority):
  otherwise any other load on the machine starves the receivers, not the baseline.
* Transports (column ``via``): ``shm``, the sender's two shared-memory slots (what the runtime uses
  when every engine is on the trainer rank's node: the bucket is written once into a slot, in parts
  of up to 128 MB (`weight_sync.buckets.PART_BYTES`) that are handed to the receivers as each is
  written, so they read a bucket's start while the sender writes the rest; receivers read it in place)
  and ``store``, Ray's object store (the bench's `ObjectStore` transport, a reference no route takes:
  what the sender computes is packed into a buffer, then ``ray.put`` copies that buffer and the
  tensors that travel as they are into the store).
* Receivers: 1 or 2 Ray actors (``--recv-threads`` threads each; default: the machine's cores shared
  among the receivers, as engines on a node share it) that, like an engine, decode each bucket
  (`moe_rl.weight_sync.receiver.decoded`) into a preallocated, pre-touched tensor of the state: a
  quantized weight straight into it, as the Megatron engine decodes into its weights, any other copied
  in (`moe_rl.device.copy_into` on their threads, as the Megatron engine loads), so the bytes really
  land in receiver memory. Each times its decoding apart from its copying: the report gives
  the largest share of a sync a receiver spent decoding.
* States:
  - ``tiny``: the model of ``recipes/tiny_moe.yaml`` (Megatron ``GPTModel``, fp32, ~0.9 MB) at the
    recipe's bucket size, iterated with `iter_hf_weight_groups` (views, as the sender does) and encoded
    with ``encoder.lazy_groups`` inside the loop (straight into the bucket; a weight larger than a bucket
    in row chunks), exactly as the runtime does;
  - ``synthetic``: bf16 tensors named and shaped like DeepSeek-V3 / Kimi-K2 MoE layers (experts'
    ``gate_proj`` / ``up_proj`` 2048×7168 travelling together, ``down_proj`` 7168×2048, attention
    ``o_proj`` 7168×7168, router 256×7168, its fp32 expert bias, norms, and a slice of ``embed_tokens``):
    2 layers of 6 experts and 4096 embedding rows, 1,267 MB (``--quick``: 1 layer of 2 experts and
    1024 rows, 284 MB); bucket sizes 64 / 256 / 1024 MB (``--quick``: 16 / 64 MB). MB here are MiB.
    The share of embedding / router / norm bytes (not quantized) sets the FP8 byte ratio: ~5 % here, less
    in a whole DeepSeek-V3.
* Recipes: ``bf16`` (every tensor travels as it is) and ``fp8_block128`` (e4m3 data + fp32 scales per
  128×128 block for 2-D weights; routers, embeddings, norms and 1-D tensors travel as they are).
* Modes (column ``mode``: what the time covers):
  - ``inline``: everything the runtime does per sync: encode straight into the bucket (FP8 block
    quantization in torch on CPU, a few row blocks at a time), publish, deliver, decode, copy into the
    receiver's state;
  - ``transport``: the synthetic state encoded once up front (timed and printed separately), then
    timed: pack (a copy into the bucket), publish, deliver, decode, copy into the receiver's state.
    For a bucket size smaller than a weight, the state is encoded up front once more as the
    runtime's sender sends it there: that weight in row chunks (`WireEncoder.lazy_groups`), each a
    group of its own, so no bucket exceeds its capacity.

Per configuration: one untimed pass first (the memory pass, also the warm-up; it also checks that every
tensor arrived once with the decoded values), then ``--repeat`` timed passes; ``s`` is their median.
Throughput is bytes moved (sum of the bucket sizes: what is published once, whatever the number of
receivers) over seconds. Baselines on the same number of bytes, run right after each timed pass (paired,
so that both see the same machine load; ``%copy`` / ``%ray`` are medians of the per-pass ratios):
(i) raw copy: ``dst.copy_(src)`` of flat uint8 tensors in this process (default torch threads, best of 3);
(i') raw memmove: the same bytes copied by NumPy's ``memmove`` split over all cores (`moe_rl.device.
copy_into` with one thread per core, best of 3; ``mm`` / ``%mm``): the fastest raw copy measured here;
(ii) raw Ray transfer: one ``ray.put`` of one flat buffer, and every receiver copying it into a
preallocated flat tensor (so the bytes land as in the sync). The object store's pages are touched once
up front (a store warm-up), because a run's later syncs reuse them; a first sync pays the page faults.
On the tiny state the raw copy takes microseconds and the raw Ray transfer a few milliseconds: its
ratios compare fixed per-sync costs (task round trips), not bandwidth.

Memory (memory pass; ``/proc/self/status`` sampled every 2 ms in a thread, after ``malloc_trim(0)`` so
that reused heap memory counts; ``VmHWM`` reset through ``/proc/self/clear_refs``):
  - ``sender+ MB``: the sender's peak private memory (``RssAnon``) above what it held before the sync
    (the state and, in transport mode, its encoded copy): pack buffer, encoding temporaries;
  - ``slots MB``: the sender's shared-memory slots (``shm``: shared memory, not in ``RssAnon``). The
    memory target counts ``sender+MB`` + ``slots MB``. The object store is shared memory too and is
    NOT counted in it (a store is there for Ray anyway); it is reported apart:
  - ``store MB``: peak bytes in use in Ray's object store during the sync (raylet's store stats, polled),
    i.e. published buckets, including released ones Ray has not freed yet: Ray frees in batches every
    ``free_objects_period_milliseconds`` (the run's 50 ms, `orchestration.placement.PROCESS_ENV`;
    ``--free-objects-ms`` sets it), so the store may hold a few more buckets than the two in flight;
  - ``recv RSS``: largest receiver peak RSS in MB (``VmHWM``: its preallocated state, its private
    memory, and the object store pages or slots it has mapped, ``(shm)``, which are shared, not its own);
  - ``recv+MB``: largest receiver peak private memory above its state (decode temporaries).

Not a test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import gc
import logging
import math
import os
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import ray
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository root, for moe_rl

from moe_rl.weight_sync.shm import tensor_nbytes  # noqa: E402
from moe_rl.weight_sync.transport import BucketTransport  # noqa: E402

log = logging.getLogger("bench.weight_sync")

MB = 1 << 20
RECIPES = ("bf16", "fp8_block128")
HIDDEN, EXPERT_FFN, ROUTED_EXPERTS = 7168, 2048, 256
SYNTH_NUM_LAYERS = 61  # what the encoder is told (DeepSeek-V3): no layer is excluded by position
SYNTH_FIRST_LAYER = 3  # DeepSeek-V3's first MoE layer
THROUGHPUT_TARGET = 0.5  # of the raw copy
MEMORY_TARGET = 2.0  # buckets
RATIO_TARGET = 0.55  # fp8_block128 bytes / bf16 bytes

Group = list[tuple[str, torch.Tensor]]
Encoded = list[tuple[str, torch.Tensor, dict]]


# ---------------------------------------------------------------------------------------- memory
_FIELDS = ("VmHWM", "RssAnon", "RssShmem")


def proc_status() -> dict[str, int]:
    """``VmHWM``, ``RssAnon``, ``RssShmem`` of this process, in bytes."""
    out = dict.fromkeys(_FIELDS, 0)
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in out:
                out[key] = int(rest.split()[0]) * 1024
    return out


def reset_peak() -> None:
    """Give free heap memory back to the OS (so that reusing it shows as RSS growth) and reset ``VmHWM``
    to the current RSS (Linux ``clear_refs``)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class StoreUsage:
    """Bytes in use in the local Ray object store, asked of the raylet (Ray internals: None when the
    call is not available in this Ray version)."""

    def __init__(self):
        self._stub = None
        try:
            from ray._private.grpc_utils import init_grpc_channel
            from ray.core.generated import node_manager_pb2, node_manager_pb2_grpc

            node = next(n for n in ray.nodes() if n["Alive"])
            channel = init_grpc_channel(f"{node['NodeManagerAddress']}:{node['NodeManagerPort']}")
            self._stub = node_manager_pb2_grpc.NodeManagerServiceStub(channel)
            self._request = node_manager_pb2.FormatGlobalMemoryInfoRequest(include_memory_info=False)
            self.used()
        except Exception as exc:  # internal API
            log.warning("object store usage not available (%s): store MB not measured", exc)
            self._stub = None

    def used(self) -> int | None:
        if self._stub is None:
            return None
        return int(
            self._stub.FormatGlobalMemoryInfo(self._request, timeout=10).store_stats.object_store_bytes_used
        )

    def drain(self, timeout: float = 5.0) -> None:
        """Wait until the store is empty (Ray frees released objects in batches, every second)."""
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            used = self.used()
            if used is None:
                time.sleep(1.2)
                return
            if used == 0:
                return
            time.sleep(0.05)


class PeakSampler:
    """Peak ``RssAnon`` / ``RssShmem`` above their values at ``__enter__`` (and the object store's peak
    bytes when given ``store``), sampled in a thread; ``VmHWM`` at ``__exit__`` after a reset."""

    def __init__(self, interval: float = 0.002, store: StoreUsage | None = None):
        self.interval, self.store = interval, store
        self.result: dict[str, float] = {}

    def __enter__(self) -> PeakSampler:
        reset_peak()
        self.start = proc_status()
        self.peak = dict(self.start)
        self.store_peak = self.store.used() if self.store else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        now = proc_status()
        for key in ("RssAnon", "RssShmem"):
            self.peak[key] = max(self.peak[key], now[key])
        if self.store_peak is not None:
            self.store_peak = max(self.store_peak, self.store.used() or 0)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        self.result = {
            "anon": self.peak["RssAnon"] - self.start["RssAnon"],
            "anon_start": self.start["RssAnon"],
            "shmem": self.peak["RssShmem"] - self.start["RssShmem"],
            "shm": self.peak["RssShmem"],
            "hwm": proc_status()["VmHWM"],
            "store": self.store_peak,
        }


# ------------------------------------------------------------------------------------- receivers
class Receiver:
    """A rollout engine's side of the sync (a Ray actor): decodes each bucket and copies every tensor
    into its preallocated state; also the receiving side of the raw Ray transfer."""

    def __init__(self):
        self.state: dict[str, torch.Tensor] = {}
        self.flat: torch.Tensor | None = None
        self.loaded: list[str] = []
        self.sampler: PeakSampler | None = None

    def niceness(self) -> int:
        return os.nice(0)

    def allocate(self, spec: list[tuple[str, tuple[int, ...], str]]) -> int:
        """Preallocate (and touch) the state: ``[(name, shape, dtype name)]``; returns its bytes."""
        self.state = {}
        gc.collect()
        for name, shape, dtype in spec:
            self.state[name] = torch.empty(shape, dtype=getattr(torch, dtype)).zero_()
        return sum(t.numel() * t.element_size() for t in self.state.values())

    def allocate_flat(self, nbytes: int) -> None:
        self.flat = None
        gc.collect()
        if nbytes:
            self.flat = torch.empty(nbytes, dtype=torch.uint8).zero_()

    def begin(self, sample: bool, threads: int) -> None:
        """Start a sync on ``threads`` threads; ``sample`` (the memory pass): zero the state first (so the
        checksums see only what arrives), then sample memory until `end`."""
        torch.set_num_threads(threads)
        from moe_rl.weight_sync.wire import Rejoin

        if sample:
            for t in self.state.values():
                t.zero_()
        gc.collect()
        self.loaded = []
        self.rejoin = Rejoin()  # a weight larger than a bucket travels in row chunks
        self.busy = self.copying = 0.0
        self.sampler = PeakSampler() if sample else None
        if self.sampler:
            self.sampler.__enter__()

    @torch.no_grad()
    def receive(self, bucket) -> int:
        from moe_rl.device import copy_into
        from moe_rl.weight_sync.receiver import decoded

        start = time.perf_counter()
        # (decoding happens as the iteration asks for a value) as the Megatron engine receives: a
        # quantized weight is decoded straight into the state (`ModelReceiver.place`), any other is
        # copied in as `hf_weights.load_hf_subset` copies, on this actor's threads
        for name, value in decoded(bucket, into=self.state.get, rejoin=self.rejoin):
            if value is not self.state[name]:
                copying = time.perf_counter()
                copy_into(self.state[name], value, threads=torch.get_num_threads())
                self.copying += time.perf_counter() - copying
            self.loaded.append(name)
        self.busy += time.perf_counter() - start
        return bucket.nbytes

    def receive_raw(self, buffer: np.ndarray) -> int:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # a published buffer is read-only; only read
            self.flat.copy_(torch.from_numpy(buffer))
        return buffer.nbytes

    def end(self, checksums: bool) -> dict:
        self.rejoin.finish()
        out: dict = {"loaded": len(self.loaded), "unique": len(set(self.loaded)), "busy": self.busy,
                     "copying": self.copying}  # fmt: skip
        if self.sampler:
            self.sampler.__exit__()
            out.update(self.sampler.result)
        if checksums:
            out["sums"] = {name: float(t.sum(dtype=torch.float64)) for name, t in self.state.items()}
        self.loaded, self.sampler = [], None
        return out


# ---------------------------------------------------------------------------------------- states
def synthetic_groups(layers: int, experts: int, vocab_rows: int, seed: int = 0) -> list[Group]:
    """bf16 tensors named and shaped like DeepSeek-V3 / Kimi-K2 MoE layers, grouped as Megatron's
    tensors are (an expert's gate_proj and up_proj are one fused tensor: they travel together)."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.bfloat16).normal_(0.0, 0.02, generator=g)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    groups: list[Group] = [[("model.embed_tokens.weight", w(vocab_rows, HIDDEN))]]
    for layer in range(SYNTH_FIRST_LAYER, SYNTH_FIRST_LAYER + layers):
        p = f"model.layers.{layer}"
        groups += [
            [(f"{p}.input_layernorm.weight", ones(HIDDEN))],
            [(f"{p}.self_attn.o_proj.weight", w(HIDDEN, HIDDEN))],
            [(f"{p}.post_attention_layernorm.weight", ones(HIDDEN))],
            [(f"{p}.mlp.gate.weight", w(ROUTED_EXPERTS, HIDDEN))],
            [(f"{p}.mlp.gate.e_score_correction_bias", torch.zeros(ROUTED_EXPERTS))],
        ]
        for e in range(experts):
            x = f"{p}.mlp.experts.{e}"
            groups.append(
                [
                    (f"{x}.gate_proj.weight", w(EXPERT_FFN, HIDDEN)),
                    (f"{x}.up_proj.weight", w(EXPERT_FFN, HIDDEN)),
                ]
            )
            groups.append([(f"{x}.down_proj.weight", w(HIDDEN, EXPERT_FFN))])
    groups.append([("model.norm.weight", ones(HIDDEN))])
    return groups


RECV_THREADS: int | None = None
"""Threads per receiver (``--recv-threads``); None: the machine's cores shared among the receivers."""
_TRANSPORTS: dict[tuple[int, str], BucketTransport] = {}
TRANSPORTS = ("shm", "store")


class ObjectStore(BucketTransport):
    """The ``store`` transport: each bucket packed into one buffer and put once in Ray's object store
    (``ray.put`` copies the buffer and each tensor that travels as the sender holds it,
    `weight_sync.buckets.Bucket.arrays`), read there by every receiver. No route of a run takes it:
    it is this bench's reference for a transport through Ray."""

    name = "object_store"

    def message(self, bucket):
        return ray.put(bucket)


def transport_for(capacity: int, transport: str, arena=None) -> BucketTransport:
    """The sender's transport of this bucket size, kept from sync to sync (as a trainer rank keeps
    its): ``shm`` is the runtime's `weight_sync.transport.SharedMemory` (two shared-memory slots; the
    tensors that travel as they are read in the state's shared arena), ``store`` is `ObjectStore`."""
    from moe_rl.weight_sync.transport import SharedMemory

    key = (capacity, transport)
    if key not in _TRANSPORTS:
        made = SharedMemory(capacity, arena=arena) if transport == "shm" else ObjectStore(capacity)
        _TRANSPORTS[key] = made
    return _TRANSPORTS[key]


def close_transports() -> None:
    for transport in _TRANSPORTS.values():
        transport.close()
    _TRANSPORTS.clear()


@dataclass
class State:
    """A state to sync: how to iterate its groups as the runtime does, and what a receiver holds."""

    name: str
    groups: Callable[[], Iterator[Group]]
    """``(hf_name, tensor)`` groups, views of what the trainer holds (as the sender iterates them)."""
    spec: list[tuple[str, tuple[int, ...], str]]
    num_layers: int
    bucket_mbs: list[int]
    modes: dict[str, list[tuple[int, int, str]]]
    """mode -> [(bucket MB, receivers, transport)]."""
    encoded: dict[str, list[Encoded]] = field(default_factory=dict)
    """recipe -> the state encoded once (transport mode)."""
    held: list[Group] = field(default_factory=list)
    """The synthetic state's tensors (what a trainer holds)."""
    arena: object = None
    """The shared arena holding the state, as a CPU trainer rank holds its parameters
    (`weight_sync.sender.share_parameters`): the ``shm`` transport reads what travels as it is there."""

    @property
    def nbytes(self) -> int:
        return sum(math.prod(shape) * getattr(torch, dtype).itemsize for _, shape, dtype in self.spec)


def spec_of(groups: Iterator[Group]) -> list[tuple[str, tuple[int, ...], str]]:
    return [(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for g in groups for n, t in g]


def tiny_state() -> State:
    from moe_rl.megatron.hf_weights import iter_hf_weight_groups
    from moe_rl.megatron.model import build_gpt_model
    from moe_rl.megatron.parallel import init_parallel
    from moe_rl.orchestration.preflight import load_checked
    from moe_rl.weight_sync.sender import share_parameters

    config = load_checked(ROOT / "recipes" / "tiny_moe.yaml")
    init_parallel(config.parallel)
    model = build_gpt_model(config.model, config.parallel, config.trainer, seed=config.run.seed)

    def groups() -> Iterator[Group]:
        return (group for _, group in iter_hf_weight_groups(model, copy=False))  # as the sender does

    mb = config.rollout.sync_bucket_mb
    modes = {"inline": [(mb, n, t) for t in TRANSPORTS for n in (1, 2)]}
    arena = share_parameters(model)  # as `RankSender` does before its first sync through shared slots
    return State("tiny", groups, spec_of(groups()), config.model.num_layers, [mb], modes, arena=arena)


def synthetic_state(quick: bool) -> State:
    from moe_rl.weight_sync.shm import SharedArena

    layers, experts = (1, 2) if quick else (2, 6)
    held = synthetic_groups(layers, experts, vocab_rows=4096 if not quick else 1024)
    arena = SharedArena(SharedArena.size_for(t for g in held for _, t in g))
    held = [[(name, arena.place(t)) for name, t in g] for g in held]  # where a CPU trainer holds them

    def groups() -> Iterator[Group]:  # the sender packs views of the parameters (no copy of its own)
        return iter(held)

    sizes = [16, 64] if quick else [64, 256, 1024]
    mid = sizes[len(sizes) // 2]
    modes = {
        "transport": [(s, r, t) for t in TRANSPORTS for s in sizes for r in (1, 2)],
        "inline": [(mid, 1, t) for t in TRANSPORTS],
    }
    return State(
        "synthetic", groups, spec_of(iter(held)), SYNTH_NUM_LAYERS, sizes, modes, held=held, arena=arena
    )


@functools.cache
def quant_config(recipe: str):
    from moe_rl.orchestration.preflight import load_checked

    return load_checked(ROOT / "recipes" / "tiny_moe.yaml", [f"rollout.quant={recipe}"]).quant


def encoder_for(state: State, recipe: str):
    from moe_rl.weight_sync.wire import WireEncoder

    return WireEncoder(quant_config(recipe), state.num_layers, quantized_wire=True)


def encoded_for(state: State, recipe: str, capacity: int, cache: dict[int, list[Encoded]]) -> list[Encoded]:
    """The state encoded up front (transport mode) for buckets of ``capacity``: the whole groups,
    or, when a group is larger than a bucket, encoded again as the runtime's sender sends it there
    (a weight larger than a bucket in row chunks, each a group of its own; kept in ``cache``)."""
    whole = state.encoded[recipe]
    if all(sum(tensor_nbytes(t) for _, t, _ in group) <= capacity for group in whole):
        return whole
    if capacity not in cache:
        encoder, chunked = encoder_for(state, recipe), []
        for group in state.groups():
            for lazy in encoder.lazy_groups(group, capacity):
                made = [
                    torch.empty(p.shape, dtype=p.dtype) if p.source is None else None for p in lazy.pieces
                ]
                lazy.fill(made)  # what travels as it is stays where the state holds it
                chunked.append(
                    [
                        (p.name, p.source if t is None else t, p.meta)
                        for p, t in zip(lazy.pieces, made, strict=True)
                    ]
                )
        cache[capacity] = chunked
    return cache[capacity]


def as_lazy(encoded: list[Encoded]) -> Iterator:
    """The state encoded up front as the `weight_sync.wire.LazyGroup` a packer takes: each tensor
    copied into the bucket (the transport mode's pack), or carried as it lies where the packer may."""
    from moe_rl.device import copy_into
    from moe_rl.weight_sync.wire import LazyGroup, Piece

    def one(items: Encoded):
        def fill(views) -> None:
            for (_, tensor, _), view in zip(items, views, strict=True):
                if view is not None:
                    copy_into(view, tensor)

        return LazyGroup([Piece(name, t.dtype, tuple(t.shape), meta, t) for name, t, meta in items], fill)

    return (one(items) for items in encoded)


# ------------------------------------------------------------------------------------------ sync
@dataclass
class Run:
    seconds: float
    nbytes: int
    buckets: int
    largest: int
    sender: dict = field(default_factory=dict)
    receivers: list[dict] = field(default_factory=list)


def run_sync(
    make_groups: Callable[[], Iterator],
    capacity: int,
    transport: str,
    receivers: list,
    store: StoreUsage | None,
    arena=None,
) -> Run:
    """One sync: a trainer rank's packer and `publish` loop (at most two buckets in
    flight). With ``store`` (the memory pass) the sender and the receivers sample their memory and the
    receivers checksum."""
    from moe_rl.weight_sync.transport import publish

    memory = store is not None
    threads = RECV_THREADS or max(1, (os.cpu_count() or 1) // len(receivers))  # the node's cores, shared
    ray.get([r.begin.remote(memory, threads) for r in receivers])
    sampler = PeakSampler(store=store) if memory else contextlib.nullcontext()
    sender = transport_for(capacity, transport, arena)
    packer = sender.packer
    with sampler:
        start = time.perf_counter()
        handing = {i: r.receive.remote for i, r in enumerate(receivers)}
        sizes: dict[int, int] = {}  # bucket index -> its bytes (its parts' together)
        out = publish(sized(packer.pack(make_groups()), sizes), handing, 600, sender)
        seconds = time.perf_counter() - start
    ends = ray.get([r.end.remote(memory) for r in receivers])
    slots = packer.slots.nbytes() if packer.slots is not None else 0
    peaks = {**sampler.result, "slots": slots} if memory else {}
    return Run(seconds, out.bytes, out.buckets, max(sizes.values(), default=0), peaks, ends)


def sized(buckets: Iterator, sizes: dict[int, int]) -> Iterator:
    """``buckets`` as they come, each one's bytes added to ``sizes`` under its index."""
    for bucket in buckets:
        sizes[bucket.index] = sizes.get(bucket.index, 0) + bucket.nbytes
        yield bucket


def check(run: Run, expected: dict[str, float], label: str) -> None:
    """Every tensor arrived exactly once and holds the decoded values (float64 sums)."""
    for i, end in enumerate(run.receivers):
        if end["loaded"] != len(expected) or end["unique"] != len(expected):
            raise AssertionError(f"{label} receiver {i}: {end['loaded']} tensors loaded, {end['unique']} "
                                 f"distinct, {len(expected)} expected")  # fmt: skip
        bad = [
            n for n, s in expected.items() if not math.isclose(end["sums"][n], s, rel_tol=1e-6, abs_tol=1e-6)
        ]
        if bad:
            raise AssertionError(f"{label} receiver {i}: values differ from the decoded ones, e.g. {bad[:3]}")


def expected_sums(encoded: Iterator[Encoded], spec) -> dict[str, float]:
    """What a receiver's state sums to after the sync (decoded values cast to the state's dtype)."""
    from moe_rl.weight_sync.wire import decode

    dtypes = {name: getattr(torch, dtype) for name, _, dtype in spec}
    return {
        name: float(value.to(dtypes[name]).sum(dtype=torch.float64))
        for items in encoded
        for name, value in decode(items)
    }


# ------------------------------------------------------------------------------------- baselines
class Baselines:
    """The raw transfers of ``nbytes``, run between the sync's timed passes (paired: neighbouring
    measurements share the machine's load): raw copy ``dst.copy_(src)`` of flat uint8 in this process
    (best of 3 copies: the copy bandwidth available at that moment), and raw Ray transfer: one ``ray.put`` of ``src`` + every receiver copying it
    into its own preallocated flat tensor."""

    def __init__(self, nbytes: int, receivers: list):
        self.nbytes, self.receivers = nbytes, receivers
        self.src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
        self.dst = torch.empty_like(self.src).zero_()
        ray.get([r.allocate_flat.remote(nbytes) for r in receivers])
        self.copy_seconds(), self.memmove_seconds(), self.ray_seconds(len(receivers))  # warm-up

    def copy_seconds(self) -> float:
        return self._best(lambda: self.dst.copy_(self.src))

    def memmove_seconds(self) -> float:
        from moe_rl.device import copy_into

        return self._best(lambda: copy_into(self.dst, self.src, threads=os.cpu_count() or 1))

    @staticmethod
    def _best(copy: Callable[[], object]) -> float:
        times = []
        for _ in range(3):
            start = time.perf_counter()
            copy()
            times.append(time.perf_counter() - start)
        return min(times)

    def ray_seconds(self, n: int) -> float:
        start = time.perf_counter()
        ref = ray.put(self.src.numpy())
        ray.get([r.receive_raw.remote(ref) for r in self.receivers[:n]], timeout=600)
        return time.perf_counter() - start

    def close(self) -> None:
        ray.get([r.allocate_flat.remote(0) for r in self.receivers])
        self.src = self.dst = None


def warm_store(nbytes: int) -> None:
    """Touch ``nbytes`` of the object store's pages once (a run's later syncs reuse them)."""
    chunk = np.ones(min(nbytes, 256 * MB), dtype=np.uint8)
    refs = [ray.put(chunk) for _ in range(max(1, nbytes // chunk.nbytes))]
    del refs


# ------------------------------------------------------------------------------------------ main
@dataclass
class Row:
    state: str
    recipe: str
    mode: str
    bucket_mb: int
    recv: int
    transport: str
    memory: Run
    passes: list[tuple[float, float, float, float]] = field(default_factory=list)
    """(sync, raw copy, raw Ray, raw memmove) seconds of each timed pass."""
    decoding: list[float] = field(default_factory=list)
    """Per timed pass: the largest share of the sync a receiver spent decoding (in `decoded`, not
    copying into its state)."""

    @property
    def label(self) -> str:
        return f"{self.state}/{self.recipe}/{self.mode}/{self.transport}/{self.bucket_mb}MB/{self.recv}recv"

    @property
    def seconds(self) -> float:
        return statistics.median(p[0] for p in self.passes)

    def gbs(self, which: int) -> float:
        """GB/s of the sync (0), the raw copy (1), the raw Ray transfer (2), the raw memmove (3): median
        over passes."""
        return statistics.median(self.memory.nbytes / p[which] for p in self.passes) / 1e9

    def of(self, which: int) -> float:
        """The sync's throughput as a share of baseline ``which``: median of the per-pass ratios."""
        return statistics.median(p[which] / p[0] for p in self.passes)


def encoded_group(encoder, group) -> list:
    """What travels for ``group``, ``[(name, tensor, meta)]``: the recipe's lazy group written into a
    bucket of its own, as the sender writes it (views of that bucket, or of a tensor sent as it lies)."""
    from moe_rl.weight_sync.buckets import BucketPacker

    lazy = encoder.lazy_group(group)
    return [
        (e.name, t, e.meta)
        for b in BucketPacker(max(lazy.nbytes, 1)).pack(iter([lazy]))
        for e, t in b.tensors()
    ]


def fp8_encode_cost(state: State) -> str:
    """Encode of one o_proj-shaped weight into its place in a bucket (`codec.quantize_into`, what the
    sender's lazy group runs: quantization + the QuantReport's error measure) through the fused kernel
    and through torch operations, and quantizing alone."""
    from moe_rl.quant import fused
    from moe_rl.quant.codec import block_of, quantize_fp8, quantize_into, scale_shape

    cfg = quant_config("fp8_block128")
    weight = next(t for g in state.held for n, t in g if n.endswith("o_proj.weight"))
    data = torch.empty(weight.shape, dtype=torch.float8_e4m3fn)
    scale = torch.empty(scale_shape(weight.shape, block_of(cfg, weight.shape)), dtype=torch.float32)
    quantize_into(weight, cfg, data, scale)  # warm-up (compiles the fused kernel if this process has not yet)
    start = time.perf_counter()
    quantize_fp8(weight, cfg)
    quantize_s = time.perf_counter() - start
    with PeakSampler() as sampler:
        start = time.perf_counter()
        quantize_into(weight, cfg, data, scale)
        encode_s = time.perf_counter() - start
    extra = sampler.result["anon"]
    fused_on = fused.usable(weight.shape, (cfg.block_size, cfg.block_size), weight.device)
    with fused.turned_off():
        start = time.perf_counter()
        quantize_into(weight, cfg, data, scale)
        torch_ops_s = time.perf_counter() - start
    elements = weight.numel() / 1e9
    return (
        f"fp8 encode of one {tuple(weight.shape)} bf16 weight ({tensor_nbytes(weight) / MB:.0f} MB): "
        f"quantize_into (quantize + error measure) {encode_s:.2f} s = {elements / encode_s:.2f} G elements/s "
        f"{'fused' if fused_on else '(fused kernel off)'}, {torch_ops_s:.2f} s = {elements / torch_ops_s:.2f} "
        f"G elements/s in torch operations; quantize_fp8 alone (torch operations) {quantize_s:.2f} s; "
        f"encode peak extra memory {extra / MB:.0f} MB = {extra / tensor_nbytes(weight):.1f}x the weight"
    )


# ------------------------------------------------------------------------------ process group
def pg_worker(rank: int, size: int, port: int, quick: bool, capacities: list[int], repeat: int, out) -> None:
    """One process of the process-group rows: rank 0 sends, the others receive (see `pg_rows`)."""
    from moe_rl.config.schema import QuantConfig
    from moe_rl.device import copy_into
    from moe_rl.weight_sync.broadcast import GroupSpec, StreamReceiver, open_group, send_stream
    from moe_rl.weight_sync.receiver import decoded
    from moe_rl.weight_sync.transport import ProcessGroup
    from moe_rl.weight_sync.wire import Rejoin, WireEncoder

    torch.set_num_threads(1 if rank == 0 else max(1, (os.cpu_count() or 2) // max(1, size - 1)))
    groups = synthetic_groups(*((1, 2, 1024) if quick else (2, 6, 4096)))
    nbytes = sum(tensor_nbytes(t) for g in groups for _, t in g)
    spec = GroupSpec("127.0.0.1", port, size, f"bench/{port}/")
    group = open_group(spec, 0) if rank == 0 else None
    receiver = None if rank == 0 else StreamReceiver(spec, rank)
    if receiver is not None:
        receiver.join()
        group = receiver.group
        state = {name: torch.empty_like(t).fill_(0) for g in groups for name, t in g}  # pre-touched
    flat = torch.zeros(nbytes, dtype=torch.uint8)  # the raw broadcast's buffer (the sender's: the bytes)
    # the sender's packers, as the process-group transport makes them (kept from sync to sync)
    packers = {c: ProcessGroup(c, host="127.0.0.1").packer for c in capacities} if rank == 0 else {}

    def sync(capacity: int, sample: bool = False) -> tuple[float, dict]:
        with PeakSampler() if sample else contextlib.nullcontext() as peak:
            start = time.perf_counter()
            if rank == 0:
                encoder = WireEncoder(QuantConfig(), num_layers=1, quantized_wire=True)
                lazy = (lg for g in groups for lg in encoder.lazy_groups(g, capacity))
                send_stream(group, packers[capacity].pack(lazy))
            else:
                rejoin = Rejoin()

                def land(bucket) -> None:  # as an engine: each tensor copied into its weight (`Receiver`)
                    for name, value in decoded(bucket, into=state.get, rejoin=rejoin):
                        if value is not state[name]:
                            copy_into(state[name], value, threads=torch.get_num_threads())

                receiver.receive(land)
            group.barrier().wait()  # the last receiver has landed the last bucket
            seconds = time.perf_counter() - start
        return seconds, peak.result if sample else {}

    def raw() -> float:
        from torch.distributed import BroadcastOptions

        options = BroadcastOptions()
        options.rootRank = 0
        start = time.perf_counter()
        group.broadcast([flat], options).wait()
        group.barrier().wait()
        return time.perf_counter() - start

    raw()  # warm-up: the group's connections, the buffers' pages
    for capacity in capacities:
        sync(capacity)  # warm-up (the slabs, the group's connections at this size)
        if receiver is not None:  # every weight landed as sent
            bad = [name for g in groups for name, t in g if not torch.equal(state[name], t)]
            assert not bad, f"receiver {rank}: {len(bad)} weights differ from what was sent, e.g. {bad[0]}"
        _, memory = sync(capacity, sample=True)  # the memory pass
        timed = []
        for _ in range(repeat):
            seconds, _ = sync(capacity)
            timed.append((seconds, raw()))
        if receiver is None:  # what each side holds from sync to sync: the packer's buffers, the slabs
            held = sum(b.nbytes for b in packers[capacity].buffers)
        else:
            held = sum(int(t.numel()) for t in receiver.slabs)
        out.put((rank, capacity, nbytes, timed, memory["anon"], held))


def pg_rows(args: argparse.Namespace, repeat: int) -> None:
    """The process-group transport (`weight_sync.broadcast`: what a trainer rank uses for engines on
    other nodes) against a raw gloo broadcast of the same bytes in the same group: one sender process
    and 1 or 2 receiver processes on this machine (loopback TCP), the synthetic bf16 state, the bucket
    sizes of the other rows. A receiver lands every tensor in its preallocated state, as an engine
    does (and the first sync's weights are checked equal to those sent). Memory: ``sender+MB`` and
    ``recv+MB``, anonymous memory a sync adds (as above); ``buffers MB``, the sender packer's two
    buffers, and ``slabs MB``, a receiver's two slabs, held from sync to sync; ``x bucket``, the
    larger of the two in buckets (at most two)."""
    import socket

    import torch.multiprocessing as mp

    capacities = [c * MB for c in ((16, 64) if args.quick else (64, 256, 1024))]
    print(
        "\nprocess group (gloo, loopback): sender and receivers are processes of their own; bf16, synthetic state"
    )
    print(f"{'bucket':>8} {'recv':>4} {'s':>7} {'raw s':>7} {'%raw':>6} {'GB/s':>6} {'sender+MB':>9} "
          f"{'buffers MB':>10} {'recv+MB':>7} {'slabs MB':>8} {'x bucket':>8}")  # fmt: skip
    for receivers in (1, 2):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        ctx = mp.get_context("spawn")
        out = ctx.SimpleQueue()
        size = receivers + 1
        mp.start_processes(
            pg_worker,
            args=(size, port, args.quick, capacities, repeat, out),
            nprocs=size,
            start_method="spawn",
        )
        results: dict[int, dict[int, tuple]] = {}
        while not out.empty():
            rank, capacity, nbytes, timed, anon, held = out.get()
            results.setdefault(capacity, {})[rank] = (nbytes, timed, anon, held)
        for capacity in capacities:
            nbytes, timed, sender_anon, buffers = results[capacity][0]
            recv = [results[capacity][r] for r in range(1, size)]
            sync_s = statistics.median(t for t, _ in timed)
            raw_s = statistics.median(r for _, r in timed)
            ratio = statistics.median(r / t for t, r in timed)
            slabs = max(r[3] for r in recv)
            recv_anon = max(r[2] for r in recv)
            print(f"{capacity // MB:>6}MB {receivers:>4} {sync_s:>7.3f} {raw_s:>7.3f} {ratio:>6.0%} "
                  f"{nbytes / sync_s / 1e9:>6.2f} {sender_anon / MB:>9.1f} {buffers / MB:>10.1f} "
                  f"{recv_anon / MB:>7.1f} {slabs / MB:>8.1f} {max(buffers, slabs) / capacity:>7.2f}x")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="~0.3 GB synthetic state, 16/64 MB buckets")
    parser.add_argument("--repeat", type=int, default=None, help="timed passes per config (default 2)")
    parser.add_argument(
        "--recv-threads", type=int, default=None,
        help="threads per receiver actor (default: the cores shared among the receivers)",
    )  # fmt: skip
    parser.add_argument(
        "--free-objects-ms", type=int, default=None,
        help="Ray's free_objects_period_milliseconds (default: the run's, 50 ms)",
    )  # fmt: skip
    parser.add_argument(
        "--only", choices=("all", "ray", "process-group", "lora"), default="all",
        help="the Ray transports' rows, the process-group rows, both (default), or LoRA's full against "
        "adapter-only syncs",
    )  # fmt: skip
    args = parser.parse_args()
    from moe_rl.orchestration.placement import PROCESS_ENV

    missing = {key: value for key, value in PROCESS_ENV.items() if key not in os.environ}
    if missing:  # start again as a run's processes start: glibc reads its copy setting at start-up
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **missing})
    repeat = args.repeat or 2
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    warnings.filterwarnings("ignore", category=UserWarning, module=r"(megatron|modelopt)")
    wall = time.perf_counter()

    # Ray starts its workers at nice 15. In the runtime sender and receivers are all Ray actors (one
    # priority); here the sender and the raw copy run in the driver (nice 0): the receivers run at its
    # priority too, or any other load on the node starves them and not the baseline.
    os.environ.setdefault("RAY_worker_niceness", "0")
    init: dict = {"num_cpus": 4, "include_dashboard": False}
    if args.free_objects_ms is not None:
        init["_system_config"] = {"free_objects_period_milliseconds": args.free_objects_ms}
    if args.only in ("all", "lora"):
        lora_rows(args, repeat)
    if args.only in ("all", "process-group"):
        pg_rows(args, repeat)
    if args.only in ("all", "ray"):
        ray.init(**init)
        try:
            run_all(args, repeat)
        finally:
            ray.shutdown()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"\nbench wall time {time.perf_counter() - wall:.0f} s; load average at the end {load}")


LORA_MODEL = [
    "model.num_layers=4", "model.hidden_size=512", "model.num_attention_heads=8", "model.num_key_value_heads=4",
    "model.head_dim=64", "model.ffn_hidden_size=1024", "model.moe_ffn_hidden_size=512", "model.num_experts=16",
    "model.moe_router_topk=2", "model.vocab_size=8192",
]  # fmt: skip
"""The tiny recipe's model scaled up (~0.14 G parameters with the output layer), so a full sync moves
hundreds of MB."""


def lora_rows(args: argparse.Namespace, repeat: int) -> None:
    """A LoRA run's syncs with ``lora.sync=adapters`` (rank 8 on attention and every expert), each
    through the runtime's code in this process: the trainer rank's `RankSender` (the one-process
    loop's route) into a Megatron engine's receiver. ``full``: what an engine that holds no base takes
    (its first sync, or after a restart): the frozen weights and the adapters; ``adapters``: what
    every later sync carries. Bytes are the sender's count; seconds from the engine's begin to its
    finish. Both recipes: bf16 (tensors as the trainer holds them, fp32 here) and fp8_block128 (the
    base quantized on the wire, the adapters as they are)."""
    from moe_rl.config.sync_plan import sync_plan
    from moe_rl.orchestration.preflight import load_checked
    from moe_rl.rollout.megatron_engine import MegatronEngine
    from moe_rl.trainer.worker import TrainerWorker
    from moe_rl.weight_sync.sender import RankSender
    from moe_rl.weight_sync.transport import Receiver as SyncReceiver

    print(
        "\nLoRA rank 8, lora.sync=adapters: a full sync (an engine without the base) against an adapter-only one"
    )
    print(f"{'recipe':<14}{'sync':<10}{'bytes':>14}{'seconds':>10}{'bytes %full':>13}{'time %full':>12}")
    for recipe in ("bf16", "fp8_block128"):
        overrides = [*LORA_MODEL, "lora.rank=8", "lora.targets=[attention,experts]", "lora.sync=adapters",
                     f"rollout.quant={recipe}"]  # fmt: skip
        config = load_checked(ROOT / "recipes" / "tiny_moe.yaml", overrides)
        worker = TrainerWorker(config, diagnostics=False)
        plan = sync_plan(config, "cpu", in_process=True)
        sender = RankSender(worker.model, config.quant, config.model.num_layers, plan, lora=config.lora)
        engine = MegatronEngine(config)
        best = {}
        for version, whole in enumerate([True, False] * repeat, start=1):
            start = time.perf_counter()
            engine.begin_weight_update(version)
            sent = sender.send({0: SyncReceiver(engine.receive_bucket)}, whole=whole)
            engine.finish_weight_update(version)
            seconds = time.perf_counter() - start
            kind = "full" if whole else "adapters"
            if kind not in best or seconds < best[kind][1]:
                best[kind] = (sent.bytes, seconds)
        full_bytes, full_s = best["full"]
        for kind, (nbytes, seconds) in best.items():
            print(
                f"{recipe:<14}{kind:<10}{nbytes:>14,}{seconds:>10.3f}{100 * nbytes / full_bytes:>12.2f}%"
                f"{100 * seconds / full_s:>11.1f}%"
            )
        sender.close()
        del worker, engine


def run_all(args: argparse.Namespace, repeat: int) -> None:
    store = StoreUsage()
    actor = ray.remote(num_cpus=1)(Receiver)
    global RECV_THREADS
    RECV_THREADS = args.recv_threads
    receivers = [actor.remote() for _ in range(2)]  # threads are set per sync (`begin`)
    states = [tiny_state(), synthetic_state(args.quick)]
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    free = args.free_objects_ms or os.environ.get("RAY_free_objects_period_milliseconds")  # noqa: SIM112
    print(f"CPU: {os.cpu_count()} cores, load average {load}; sender = the Ray driver (torch threads "
          f"{torch.get_num_threads()}); 2 receiver actors ({args.recv_threads or 'cores / receivers'} thread(s) each, nice "
          f"{ray.get(receivers[0].niceness.remote())}, driver {os.nice(0)}); free_objects_period_milliseconds "
          f"{free}; GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '')} (driver and receivers)")  # fmt: skip
    print(f"timed: median of {repeat} passes after one untimed memory pass; each pass followed by the raw "
          f"copy and the raw Ray transfer of the same bytes (paired ratios)")  # fmt: skip

    rows: list[Row] = []
    sizes: dict[tuple[str, str], int] = {}
    for state in states:
        print(f"\nstate {state.name}: {len(state.spec)} tensors, {state.nbytes / MB:,.1f} MB "
              f"({', '.join(sorted({d for _, _, d in state.spec}))}); receivers hold it preallocated")  # fmt: skip
        expected = {}
        for recipe in RECIPES:
            encoder = encoder_for(state, recipe)
            start = time.perf_counter()
            encoded = [
                encoded_group(encoder, g) for g in state.groups()
            ]  # the first fp8 one imports ModelOpt
            seconds = time.perf_counter() - start
            sizes[state.name, recipe] = sent = sum(tensor_nbytes(t) for g in encoded for _, t, _ in g)
            what = f"{recipe}: {sent / MB:,.1f} MB travel"
            if encoder.active:
                r = encoder.report
                e4m3 = sum(tensor_nbytes(t) for g in encoded for n, t, _ in g if n in r.per_tensor)
                what += (f" ({r.num_quantized} tensors quantized: {e4m3 / MB:,.1f} MB e4m3 + scales; {r.num_kept} "
                         f"as they are; rel. error {r.rel_err:.4f})")  # fmt: skip
            first = " (includes importing ModelOpt)" if encoder.active and state.name == "tiny" else ""
            print(f"  {what}; encode once (piece copies + WireEncoder): {seconds:.2f} s "
                  f"= {state.nbytes / seconds / 1e9:.2f} GB/s of input{first}")  # fmt: skip
            expected[recipe] = expected_sums(encoded, state.spec)
            if "transport" in state.modes:
                state.encoded[recipe] = encoded
            del encoded
        if state.held:
            print("  " + fp8_encode_cost(state))

        warm_store(2 * state.nbytes + 2 * max(state.bucket_mbs) * MB)
        ray.get([r.allocate.remote(state.spec) for r in receivers])
        for recipe in RECIPES:
            gc.collect()
            baselines = Baselines(sizes[state.name, recipe], receivers)
            chunked: dict[int, list[Encoded]] = {}  # bucket bytes -> the state encoded in chunks
            for mode, configs in state.modes.items():
                for bucket_mb, n, transport in configs:
                    if mode == "transport":
                        encoded = encoded_for(state, recipe, bucket_mb * MB, chunked)

                        def make_groups(encoded=encoded) -> Iterator:
                            return as_lazy(encoded)
                    else:

                        def make_groups(
                            recipe=recipe, state=state, capacity=bucket_mb * MB
                        ) -> Iterator[Encoded]:
                            encoder = encoder_for(state, recipe)  # one per sync, as stream_weights
                            return (lazy for g in state.groups() for lazy in encoder.lazy_groups(g, capacity))

                    store.drain()
                    memory = run_sync(
                        make_groups, bucket_mb * MB, transport, receivers[:n], store, state.arena
                    )
                    row = Row(state.name, recipe, mode, bucket_mb, n, transport, memory)
                    check(memory, expected[recipe], row.label)
                    for _ in range(repeat):
                        timed = run_sync(
                            make_groups, bucket_mb * MB, transport, receivers[:n], None, state.arena
                        )
                        sync = timed.seconds
                        row.decoding.append(max((e["busy"] - e["copying"]) / sync for e in timed.receivers))
                        row.passes.append(
                            (
                                sync,
                                baselines.copy_seconds(),
                                baselines.ray_seconds(n),
                                baselines.memmove_seconds(),
                            )
                        )
                    rows.append(row)
                    print(f"  done {row.label}: {row.seconds:.2f} s", flush=True)
            baselines.close()
            state.encoded.pop(recipe, None)
        ray.get([r.allocate.remote([]) for r in receivers])
        close_transports()
        gc.collect()
    report(rows, sizes)


def report(rows: list[Row], sizes: dict) -> None:
    print("\nsync: GB/s = bytes moved / median seconds. Baselines on the same bytes, run right after each "
          "timed pass: copy = dst.copy_(src) of flat uint8 in the driver; ray = one ray.put + every receiver "
          "copies it into a preallocated flat tensor; mm = memmove on all cores; %copy, %ray, %mm = median of the "
          "per-pass ratios. via: shm = "
          "the sender's two shared-memory slots (buckets handed over in parts), store = Ray's object store; "
          "bkts counts buckets, not parts")  # fmt: skip
    print(f"  {'state':9s} {'recipe':12s} {'mode':9s} {'via':5s} {'bucket':>6s} {'recv':>4s} {'bkts':>4s} "
          f"{'MB moved':>9s} {'s':>7s} {'GB/s':>6s} {'copy':>6s} {'ray':>6s} {'mm':>6s} {'%copy':>6s} {'%ray':>6s} {'%mm':>6s} "
          f"{'sender+MB':>9s} {'slots MB':>8s} {'store MB':>8s} {'recv RSS':>8s} {'(shm)':>7s} {'recv+MB':>7s}")  # fmt: skip
    for row in rows:
        m = row.memory
        store = "n/a" if m.sender["store"] is None else f"{m.sender['store'] / MB:.0f}"
        rss = max(m.receivers, key=lambda e: e["hwm"])
        print(f"  {row.state:9s} {row.recipe:12s} {row.mode:9s} {row.transport:5s} {row.bucket_mb:6d} {row.recv:4d} "
              f"{m.buckets:4d} {m.nbytes / MB:9.1f} {row.seconds:7.3f} {row.gbs(0):6.2f} {row.gbs(1):6.2f} "
              f"{row.gbs(2):6.2f} {row.gbs(3):6.2f} {row.of(1):6.1%} {row.of(2):6.1%} {row.of(3):6.1%} {m.sender['anon'] / MB:9.1f} "
              f"{m.sender['slots'] / MB:8.0f} {store:>8s} {rss['hwm'] / MB:8.0f} {rss['shm'] / MB:7.0f} "
              f"{max(e['anon'] for e in m.receivers) / MB:7.1f}")  # fmt: skip

    print()
    for row in rows:
        publish = "pack into a slot" if row.transport == "shm" else "pack+put"
        what = ("encode+" if row.mode == "inline" else "") + publish + "+deliver+decode+copy"
        delivered = (
            f"; {row.recv} engines load {row.recv}x the bytes: {row.recv * row.of(1):.1%} of raw copy per byte landed"
            if row.recv > 1
            else ""
        )
        print(f"sync throughput {row.label} ({what}): {row.gbs(0):.2f} GB/s = {row.of(1):.1%} of raw copy "
              f"(target >= {THROUGHPUT_TARGET:.0%}); = {row.of(2):.1%} of raw Ray transfer; = {row.of(3):.1%} of raw "
              f"memmove on all cores{delivered}; receivers decoding {statistics.median(row.decoding):.0%} of the time")  # fmt: skip
    for row in rows:
        m = row.memory
        unit = row.bucket_mb * MB
        held = m.sender["anon"] + m.sender["slots"]
        over = (
            f"; largest bucket {m.largest / MB:.0f} MB: {held / m.largest:.2f} of it"
            if m.largest > unit
            else ""
        )
        store = "" if m.sender["store"] is None or row.transport == "shm" else (
            f"; object store (shared, not counted) peak {m.sender['store'] / MB:.0f} MB = {m.sender['store'] / unit:.2f} buckets"
        )  # fmt: skip
        print(f"sender peak extra memory {row.label}: {held / MB:.1f} MB = {held / unit:.2f} buckets "
              f"(target <= {MEMORY_TARGET:g} buckets; private RSS {m.sender['anon'] / MB:.1f} MB + shared slots "
              f"{m.sender['slots'] / MB:.0f} MB{over}){store}")  # fmt: skip
    for state in dict.fromkeys(s for s, _ in sizes):
        ratio = sizes[state, "fp8_block128"] / sizes[state, "bf16"]
        note = (
            ""
            if state == "synthetic"
            else " [tiny: its weights are fp32, so 'bf16 bytes' are fp32 bytes here]"
        )
        print(f"fp8_block128 bytes / bf16 bytes ({state}) = {ratio:.3f} (target <= {RATIO_TARGET}){note}")


if __name__ == "__main__":
    main()
