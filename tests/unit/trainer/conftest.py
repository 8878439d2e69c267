"""One Megatron world of size 1 (gloo, CPU shims) for the whole trainer test session."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")


def pytest_configure(config: pytest.Config) -> None:
    # Megatron-core warns at import and construction about optional kernels (Apex, TE) it
    # does not find and about its own deprecations; none of it concerns these tests.
    for line in (
        "ignore::UserWarning:megatron.*",
        "ignore::DeprecationWarning:megatron.*",
        "ignore::FutureWarning:megatron.*",
    ):
        config.addinivalue_line("filterwarnings", line)


@pytest.fixture(scope="session", autouse=True)
def megatron_world():
    from moe_rl.config.schema import ParallelConfig
    from moe_rl.megatron.parallel import init_parallel, teardown_parallel

    info = init_parallel(ParallelConfig())
    yield info
    teardown_parallel()
