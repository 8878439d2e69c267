"""What a trainer pass computes from a packed micro-batch's logits: the response tokens'
log-probs and entropy, the options of a pass, and `routing_mode` for a forward that replays a
trace or captures the natural routing on its own (the diagnostics' measurement). The passes
themselves (π_old, π_ref, the update) run in `moe_rl.trainer.passes`, through one schedule.

The micro-batch runs as one packed sequence (Megatron ``thd`` layout: tokens ``[1, T]``,
``position_ids`` restarting per sample, ``PackedSeqParams`` with ``cu_seqlens``); attention
stays inside each sample, so no per-sample loop and no padding is needed (padding is added only
where ranks must agree on the token count: `pad_micro_batch`).

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
from moe_rl.megatron.replay import RoutingReplay


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


@contextmanager
def routing_mode(
    replay: RoutingReplay | None,
    trace: Tensor | None,
    num_tokens: int,
    natural: bool = False,
) -> Iterator[dict]:
    """Replay ``trace`` (when given) and/or capture natural routing around a forward."""
    out: dict = {}
    if replay is None:
        if trace is not None:
            raise ValueError("routing replay is off (no RoutingReplay) but a trace was given")
        yield out
        return
    replay_ctx = replay.replay(trace, num_tokens) if trace is not None else nullcontext()
    natural_ctx = replay.natural_routing() if natural else nullcontext()
    with replay_ctx, natural_ctx as captured:
        yield out
    if captured is not None:
        out["natural"] = captured.topk_idx_TLK
