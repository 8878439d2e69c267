"""The worker extension against a stand-in model runner (no engine)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save, save_file

pytest.importorskip("vllm")

from moe_rl.rollout.vllm_worker import WeightSyncExtension


class _Runner:
    def __init__(self):
        self.loaded: list[tuple[str, torch.Tensor]] = []
        self.model = torch.nn.Linear(2, 3, bias=False)

    def reload_weights(self, weights_iterator):
        self.loaded = list(weights_iterator)

    def get_model(self):
        return self.model


class _Worker(WeightSyncExtension):
    def __init__(self):
        self.model_runner = _Runner()


STATE = {"a.weight": torch.ones(4, 2), "b.bias": torch.arange(3, dtype=torch.float64)}


def test_load_tensors_goes_through_in_place_reload_and_counts_bytes():
    worker = _Worker()
    stats = worker.moe_rl_load_tensors(list(STATE.items()))
    assert [n for n, _ in worker.model_runner.loaded] == ["a.weight", "b.bias"]
    assert stats["num_tensors"] == 2 and stats["bytes"] == 4 * 2 * 4 + 3 * 8


def test_load_safetensors_file_and_bytes(tmp_path):
    save_file(STATE, tmp_path / "w.safetensors")
    worker = _Worker()
    worker.moe_rl_load_safetensors(str(tmp_path / "w.safetensors"))
    got = dict(worker.model_runner.loaded)
    assert torch.equal(got["a.weight"], STATE["a.weight"]) and torch.equal(got["b.bias"], STATE["b.bias"])
    worker = _Worker()
    worker.moe_rl_load_safetensors_bytes(save(STATE))
    assert torch.equal(dict(worker.model_runner.loaded)["b.bias"], STATE["b.bias"])
