"""Keys rotated once, at their slot, for the Megatron engine's KV cache: the torch stand-in for
flash-attn's rotary kernel computes Megatron's own unfused RoPE, bit for bit."""

from __future__ import annotations

import pytest
import torch

from moe_rl.megatron.compat import apply_decoding_shims, rotary_with_cos_sin


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [8, 4])  # whole head, and a partial rotary width
def test_rotary_with_cos_sin_is_megatrons_unfused_rope(interleaved, rotary_dim):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    seq, batch, heads, dim = 5, 3, 2, 8
    x = torch.randn(seq, batch, heads, dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), torch.rand(rotary_dim // 2) * 3)
    if interleaved:
        emb = torch.stack((angles.view(-1, 1), angles.view(-1, 1)), dim=-1).view(seq, -1)
    else:
        emb = torch.cat((angles, angles), dim=-1)
    megatron = _apply_rotary_pos_emb_bshd(x, emb[:, None, None, :], rotary_interleaved=interleaved)
    ours = rotary_with_cos_sin(x.permute(1, 0, 2, 3), angles.cos(), angles.sin(), interleaved)
    assert torch.equal(ours.permute(1, 0, 2, 3), megatron)


def test_the_shim_stands_in_for_the_missing_kernel_once():
    from megatron.core.models.common.embeddings import rope_utils

    apply_decoding_shims()
    assert rope_utils.apply_rotary_emb_flash is not None
    assert apply_decoding_shims() == []
