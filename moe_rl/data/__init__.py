"""The trajectory format: the contract between rollout engines and trainers.

``TrajectoryBatch`` (``trajectory``) holds ragged token ids, processed rollout log-probs,
sampling masks, compact routing traces and weight-version spans; ``validate`` checks it;
``routing`` and ``sampling_mask`` are its codecs; ``shards`` writes it to disk and streams it
back validated (a bad file is a ``ShardError`` naming it); ``packing`` turns it into
token-budgeted micro-batches; ``vllm_convert`` builds it from vLLM outputs; ``ragged`` holds the
flat + offsets helpers and ``synthetic`` makes valid random batches for tests and benchmarks.
Imports torch, numpy and pyarrow; never vLLM. Tensors live on the CPU.
"""

from moe_rl.data.errors import ShardError, ShardNotFoundError, TrajectoryError
from moe_rl.data.trajectory import FINISH_REASONS, SCHEMA_VERSION, Sample, TrajectoryBatch, first_difference
from moe_rl.data.validate import check_staleness, validate

__all__ = [
    "FINISH_REASONS",
    "SCHEMA_VERSION",
    "Sample",
    "ShardError",
    "ShardNotFoundError",
    "TrajectoryBatch",
    "TrajectoryError",
    "check_staleness",
    "first_difference",
    "validate",
]
