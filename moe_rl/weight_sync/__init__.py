"""Weight sync from the trainer group to the rollout engines, by the route of the run's sync plan
(`moe_rl.config.sync_plan`): `outgoing` (what a trainer rank sends), `wire` (the quantization recipe
on the wire), `buckets` (tensors packed into flat buffers), `transport` (one interface, one class per
way: `shm`, `broadcast`, `ipc`, `vllm_transfer`), `sender` and `receiver` (the two sides), `report`
(what a sync did).

Nothing here holds the whole model: a sender has at most the bucket being filled and the one being
delivered; a receiver loads each whole tensor as it completes and drops it.
"""
