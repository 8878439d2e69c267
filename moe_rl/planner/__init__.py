"""The planner: what a recipe costs, computed from the recipe alone (no torch, no GPU). Parameter
counts and model FLOPs (`flops`), memory per trainer, engine and colocated GPU (`memory`), a step's
time by phase (`step_time`). ``moe-rl plan`` (``launch/plan.py``) adds every component's rules
to them and renders the whole; the trainer's throughput (`moe_rl.trainer.perf`) counts FLOPs here.
"""
