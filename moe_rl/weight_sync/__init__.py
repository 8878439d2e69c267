"""Weight sync from the trainer group to the rollout engines, by the route of the run's sync plan
(`moe_rl.config.sync_plan`).

* `outgoing`: which trainer rank sends which tensor (TP/ETP shards gathered first; each EP / PP
  owner sends its own, or every rank the whole model), and a sync's `Outgoing`;
* `wire`: the rollout quantization recipe on the sending side (FP8 / INT8 data and fp32 scales, or
  the tensor itself) and its decoding on the receiving side;
* `buckets`: whole Megatron tensors packed into flat byte buffers of about ``rollout.sync_bucket_mb``;
* `transport`: one interface, one class per way buckets travel (`shm` shared memory, `broadcast` a
  process group, `ipc` device memory; `vllm_transfer` vLLM's own transfer);
* `sender`: one rank's side of every sync (`RankSender`); `receiver`: the receiver protocol and the
  receiving side into a Megatron model; `report`: what a sync did.

Nothing here holds the whole model: a sender has at most the bucket being filled and the one
being delivered; a receiver loads each whole tensor as it completes and drops it.
"""
