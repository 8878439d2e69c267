"""The Megatron compatibility shims are chosen by what the process lacks (transformer-engine,
CUDA), applied once at process setup; the SDPA core attention computes Megatron's attention."""

from __future__ import annotations

import math

import pytest
import torch

from moe_rl.megatron import compat as megatron_compat
from moe_rl.megatron.attention import PackedLayout, SDPACoreAttention
from moe_rl.megatron.compat import SHIMS, apply_process_shims, shims_for

TE_SHIMS = {"moe_utils.te_general_gemm", "multi_latent_attention.HAVE_TE"}
CUDA_SHIMS = {shim.name for shim in SHIMS} - TE_SHIMS


@pytest.mark.parametrize(
    ("cuda", "te", "expected"),
    [
        (False, False, TE_SHIMS | CUDA_SHIMS),  # a CPU machine
        (True, False, TE_SHIMS),  # CUDA without transformer-engine: the router / MLA fixes still apply
        (True, True, set()),  # a full GPU node: nothing is patched
        (False, True, CUDA_SHIMS),
    ],
)
def test_shims_are_chosen_by_what_is_missing(cuda, te, expected):
    assert {shim.name for shim in shims_for(cuda=cuda, transformer_engine=te)} == expected


def test_process_setup_applies_the_choice_once(monkeypatch):
    chosen = shims_for(megatron_compat.cuda_available(), megatron_compat.transformer_engine_importable())
    apply_process_shims()  # the session's init_parallel has run it already: nothing new
    assert apply_process_shims() == []
    from megatron.core.transformer.moe import moe_utils

    if not megatron_compat.transformer_engine_importable():
        assert moe_utils.te_general_gemm is None
        from megatron.core.transformer import multi_latent_attention

        assert multi_latent_attention.HAVE_TE is False
    if not torch.cuda.is_available():
        from megatron.core.tensor_parallel import random as mrandom

        assert torch.cuda.current_device() == "cpu"
        torch.cuda.synchronize()  # a no-op without CUDA
        assert mrandom._get_cuda_rng_state().numel() == 0
    else:  # CUDA present: its functions stay Megatron's and torch's own
        assert torch.cuda.current_device is not megatron_compat._cpu_current_device
        assert not any(shim.missing == "cuda" for shim in chosen)


def test_building_a_model_requires_process_setup(monkeypatch):
    from trainer_testing import tiny_qwen

    from moe_rl.megatron.model import build_gpt_model

    monkeypatch.setattr(megatron_compat, "_setup_done", False)
    with pytest.raises(RuntimeError, match="call moe_rl.megatron.parallel.init_parallel"):
        build_gpt_model(tiny_qwen())


class _Config:
    context_parallel_size = 1
    kv_channels = 8
    attention_dropout = 0.0


class _Causal:
    name = "causal"


class _Packed:
    qkv_format = "thd"
    cu_seqlens_q_padded = None

    def __init__(self, cu):
        self.cu_seqlens_q = cu


def _reference(q, k, v, scale):
    """Plain causal attention with GQA, q [s, h, d], k/v [s, g, d] -> [s, h*dv]."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.einsum("shd,thd->hst", q, k) * scale
    s = q.shape[0]
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), -math.inf)
    return torch.einsum("hst,thd->shd", scores.softmax(-1), v).reshape(s, -1)


def test_sdpa_matches_reference_causal_gqa():
    torch.manual_seed(0)
    attn = SDPACoreAttention(_Config(), 1, _Causal(), "self")
    q, k, v = torch.randn(7, 2, 4, 8), torch.randn(7, 2, 2, 8), torch.randn(7, 2, 2, 8)
    out = attn(q, k, v, None)
    assert out.shape == (7, 2, 32)
    for b in range(2):
        ref = _reference(q[:, b], k[:, b], v[:, b], 1 / math.sqrt(8))
        torch.testing.assert_close(out[:, b], ref, atol=1e-6, rtol=1e-5)


def test_sdpa_packed_sequences_attend_only_inside_themselves():
    torch.manual_seed(1)
    attn = SDPACoreAttention(_Config(), 1, _Causal(), "self", softmax_scale=0.3)
    lengths = [3, 5, 2]
    q, k, v = torch.randn(10, 4, 8), torch.randn(10, 2, 8), torch.randn(10, 2, 6)
    cu = torch.tensor([0, 3, 8, 10], dtype=torch.int32)
    out = attn(q, k, v, None, packed_seq_params=_Packed(cu))
    start = 0
    for length in lengths:
        sl = slice(start, start + length)
        torch.testing.assert_close(out[sl], _reference(q[sl], k[sl], v[sl], 0.3), atol=1e-6, rtol=1e-5)
        start += length


def test_packed_layout_keeps_trailing_padding_apart():
    layout = PackedLayout.build(torch.tensor([0, 2, 5], dtype=torch.int32), 7, torch.device("cpu"))
    assert layout.seq_id.tolist() == [0, 0, 1, 1, 1, 2, 2]
    assert layout.pos.tolist() == [0, 1, 0, 1, 2, 0, 1]
    x = torch.randn(7, 2, 3)
    assert torch.equal(layout.unpad(layout.pad(x)), x.flatten(1))
    assert layout.mask.shape == (3, 1, 3, 3) and not layout.mask[0, 0, 1, 2]  # key 2 is past length 2


def test_dispatcher_is_alltoall_only_with_cuda():
    expected = "alltoall" if torch.cuda.is_available() else "allgather"
    assert megatron_compat.token_dispatcher("alltoall") == expected
    assert megatron_compat.token_dispatcher("allgather") == "allgather"
