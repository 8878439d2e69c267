"""What the two-process gloo tests share: a free port and the starting weights of the tiny MoE."""

from __future__ import annotations

import socket


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
