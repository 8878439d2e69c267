"""Weight sync from the trainer group to the rollout engines, by the route of the run's sync plan
(`moe_rl.config.sync_plan`). A sender holds at most the bucket being filled and the one being
delivered; a receiver loads each whole tensor as it completes and drops it.
"""
