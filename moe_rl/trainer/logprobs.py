"""Log-probability passes of the trainer on one packed micro-batch.

The micro-batch runs as one packed sequence (Megatron ``thd`` layout: tokens ``[1, T]``,
``position_ids`` restarting per sample, ``PackedSeqParams`` with ``cu_seqlens``); attention
stays inside each sample. On GPU the transformer-engine attention handles ``thd``; on CPU the
local spec's `attention.SDPACoreAttention` does, with a block-diagonal causal mask, so no
per-sample loop and no padding is needed (padding is added only where ranks must agree on the
token count: `pad_micro_batch`).

Per response token ``r`` at packed position ``p = response_positions[r]`` (formulas in
docs/algorithms.md, "Log-probabilities"):

* ``logp_r = z_{p-1}[y_p]/T − logsumexp(z_{p-1}/T)`` (`moe_rl.algo.logprobs.token_logprobs`);
* with keep-sampling-mask (DeepSeek-V3.2 §3.1) the logsumexp runs over the kept set S_r only
  (`masked_token_logprobs`);
* ``entropy_r = −Σ_v p_v log p_v`` over the full vocabulary (`token_entropy`, for ESPO).

Only the ``R`` rows of the logits that predict response tokens enter the vocabulary
reductions, which run in chunks of ``chunk_size`` rows, so no fp32 ``[T, V]`` copy is made
(the model's own ``[T, V]`` logits of the micro-batch are the only full-vocabulary tensor).
Routing replay and the sampling mask are applied in both passes or in neither (docs/algorithms.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor

from moe_rl.algo.logprobs import masked_token_logprobs, token_entropy, token_logprobs
from moe_rl.data.packing import MicroBatch
from moe_rl.megatron.forward import forward_logits
from moe_rl.megatron.replay import RoutingReplay


@dataclass
class LogprobOutput:
    """The result of one pass over a micro-batch."""

    logp: Tensor
    """float32 ``[R]`` (with grad in the ``logp`` pass)."""
    entropy: Tensor | None = None
    """float32 ``[R]`` full-vocabulary entropy (detached), when asked for."""
    recorded_routing: Tensor | None = None
    """int64 ``[T, local MoE layers, k]`` the routers chose, when recording."""
    natural_routing: Tensor | None = None
    """int64 ``[T, local MoE layers, k]`` the routers would choose on their own, under replay."""


def response_logprobs(
    logits: Tensor,
    micro: MicroBatch,
    temperature: float,
    chunk_size: int,
    keep_sampling_mask: bool = False,
    validate_mask: bool = True,
) -> Tensor:
    """``[R]`` log-probs of the response tokens; over the kept sets when `keep_sampling_mask`
    (the sets are checked unless ``validate_mask`` is False: the data was checked before)."""
    positions = micro.response_positions
    rows = logits.index_select(0, positions - 1)
    targets = micro.input_ids.index_select(0, positions)
    if not keep_sampling_mask:
        return token_logprobs(rows, targets, temperature, chunk_size)
    if micro.sampling_mask_ids is None or micro.sampling_mask_offsets is None:
        raise ValueError(
            "algo.corrections.keep_sampling_mask=true but the micro-batch has no sampling mask "
            f"(samples {micro.sample_indices.tolist()}); the engine must return sampling masks"
        )
    return masked_token_logprobs(
        rows,
        targets,
        micro.sampling_mask_ids.to(torch.int64),
        micro.sampling_mask_offsets.to(torch.int64),
        temperature,
        validate=validate_mask,
    )


def response_entropy(logits: Tensor, micro: MicroBatch, temperature: float, chunk_size: int) -> Tensor:
    """``[R]`` full-vocabulary entropy (detached) at the rows predicting response tokens."""
    positions = micro.response_positions
    with torch.no_grad():
        return token_entropy(logits.index_select(0, positions - 1), temperature, chunk_size)


@dataclass
class PassOptions:
    """How one log-prob pass runs."""

    temperature: float = 1.0
    chunk_size: int = 1024
    keep_sampling_mask: bool = False
    entropy: bool = False
    validate_mask: bool = True
    """Check the kept sets (offsets, ids, sampled id inside); off once a pass has checked them."""


@contextmanager
def routing_mode(
    replay: RoutingReplay | None,
    trace: Tensor | None,
    num_tokens: int,
    record: bool = False,
    natural: bool = False,
    sample_of_token: Tensor | None = None,
    local: bool = False,
) -> Iterator[dict]:
    """Replay ``trace`` (when given; this stage's layers only if ``local``), record, and/or
    capture natural routing around a forward (and the backward, for the ``logp`` pass)."""
    out: dict = {}
    if replay is None:
        if trace is not None or record:
            raise ValueError(
                "routing replay is off (no RoutingReplay) but a trace or recording was asked for"
            )
        yield out
        return
    replay_ctx = (
        replay.replay(trace, num_tokens, sample_of_token, local) if trace is not None else nullcontext()
    )
    record_ctx = replay.record() if record and trace is None else nullcontext()
    natural_ctx = replay.natural_routing() if natural else nullcontext()
    with replay_ctx, record_ctx as recording, natural_ctx as captured:
        yield out
    if recording is not None:
        out["recorded"] = recording.topk_idx_TLK
    if captured is not None:
        out["natural"] = captured.topk_idx_TLK


def logprob_pass(
    model: torch.nn.Module, micro: MicroBatch, options: PassOptions, pad_to: int | None = None
) -> LogprobOutput:
    """One forward over ``micro`` and its response log-probs; grad follows the caller's mode.

    Routing is whatever the routers are set to: wrap the call (and, for the ``logp`` pass, the
    backward too) in `routing_mode` to replay or record.
    """
    logits = forward_logits(model, micro, pad_to)
    logp = response_logprobs(
        logits, micro, options.temperature, options.chunk_size, options.keep_sampling_mask
    )
    entropy = (
        response_entropy(logits, micro, options.temperature, options.chunk_size) if options.entropy else None
    )
    return LogprobOutput(logp=logp, entropy=entropy)


@torch.no_grad()
def old_logprobs(
    model: torch.nn.Module,
    micro: MicroBatch,
    options: PassOptions,
    replay: RoutingReplay | None = None,
    trace: Tensor | None = None,
    record: bool = False,
    natural: bool = False,
    sample_of_token: Tensor | None = None,
    pad_to: int | None = None,
    local: bool = False,
) -> LogprobOutput:
    """The ``old_logp`` pass (no grad; call with the model in eval mode).

    Replays ``trace`` (``[T, all MoE layers, k]``; this stage's layers only if ``local``) when
    given, records the routers' own choice when ``record`` (R2), captures it under replay when
    ``natural`` (routing agreement). Recorded and captured routing cover the micro-batch's own
    ``T`` tokens (not the padding).
    """
    num_tokens = pad_to or micro.num_tokens
    with routing_mode(replay, trace, num_tokens, record, natural, sample_of_token, local) as routing:
        out = logprob_pass(model, micro, options, pad_to)
    recorded, natural_ids = routing.get("recorded"), routing.get("natural")
    out.recorded_routing = None if recorded is None else recorded[: micro.num_tokens]
    out.natural_routing = None if natural_ids is None else natural_ids[: micro.num_tokens]
    return out
