"""Weight sync from the trainer group to the rollout engines, as a stream of buckets.

* `wire`: the rollout quantization recipe applied on the sending side: each HF-named tensor
  becomes what travels (FP8 e4m3 data + fp32 scales for the FP8 recipes, the tensor itself
  otherwise) and is decoded on the receiving side into the values a quantized engine holds.
* `buckets`: whole Megatron tensors (all HF pieces of one) packed into flat byte buffers of about
  ``rollout.sync_bucket_mb`` each: one object per bucket, published once for every replica.
* `sender`: which trainer rank sends which tensor (TP/ETP shards gathered first; each EP / PP
  owner sends its own), and the bucket stream of one rank.
* `receiver`: loading buckets into a Megatron model as they arrive, and the completeness check
  when the last one has landed (the policy version is set then, not before).

Nothing here holds the whole model: a sender has at most the bucket being filled and the one
being published; a receiver loads each bucket into its model and drops it.
"""
