"""What the two-process gloo tests share: a free port, the starting weights of the tiny MoE and the
comparison of a critic's outputs with the one-process run's."""

from __future__ import annotations

import socket

import torch


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on (for ``MASTER_PORT``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_trainer_weights(folder: str) -> str:
    """One HF folder with the starting weights of every layout, written by this process."""
    import trainer_dp_worker

    from moe_rl.config.schema import ParallelConfig
    from moe_rl.megatron.parallel import init_parallel

    init_parallel(ParallelConfig())
    trainer_dp_worker.write_weights(folder)
    return folder


def assert_critic_matches(ranks: list[dict[str, torch.Tensor]], reference: dict[str, torch.Tensor]) -> None:
    """What each rank's `trainer_dp_worker.critic_outputs` saved equals the one-process run's:
    every rank has the batch's statistics and step metrics; the per-micro-batch values, returns and
    advantages, the gradients and the updated weights are found, all together, across the ranks.
    Each within rtol 1e-5 and an atol of 1e-7 or 1e-5 of the tensor's largest entry (the layouts sum
    float32 gradients in other orders; the critic's are larger than the policy's)."""
    shared = {k for k in reference if k.startswith(("__old__/", "__train__/"))}
    assert shared, "no statistics"
    assert reference.get("__train__/critic/update_ok", 1.0) == 1.0
    found: set[str] = set()
    for got in ranks:
        assert shared <= set(got) <= set(reference), sorted(set(got) ^ set(reference))[:4]
        found |= set(got)
        for name, value in got.items():
            atol = max(1e-7, 1e-5 * float(reference[name].abs().max()))
            torch.testing.assert_close(value, reference[name], rtol=1e-5, atol=atol, msg=name)
    assert found == set(reference), sorted(set(reference) - found)[:4]
