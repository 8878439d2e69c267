"""The Megatron engine's KV-cache budget: the size of a batch's cache, and the refusal that names it."""

from __future__ import annotations

import pytest

from moe_rl.megatron.decoding import KVCacheSize


def test_cache_size_is_rows_times_slots_times_bytes_per_slot():
    size = KVCacheSize(rows=64, slots=1027, bytes_per_slot=1024)
    assert size.nbytes == 64 * 1027 * 1024
    size.check(limit_gib=1.0, max_new_tokens=1024)  # 64 MiB fits in 1 GiB


def test_a_cache_over_the_limit_is_refused_with_its_numbers():
    size = KVCacheSize(rows=64, slots=1027, bytes_per_slot=1024)
    expected = (
        r"needs 0\.063 GiB: 64 sequences x 1027 slots \(longest prompt 4 \+ max_new_tokens=1024 - 1\) "
        r"x 1024 bytes per slot, more than rollout\.megatron_kv_cache_gib=0\.01"
    )
    with pytest.raises(ValueError, match=expected):
        size.check(limit_gib=0.01, max_new_tokens=1024)
