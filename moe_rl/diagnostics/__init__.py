"""Training–inference mismatch diagnostics beyond the per-step metrics of the trainer.

* `zero_update`: `moe-rl diagnose`, the zero-update test (the survey's "Identifying mismatch — a
  diagnostic toolkit": same weights, same prompts, engine vs trainer) for each rollout
  quantization recipe, with and without R3 and keep-sampling-mask;
* `measure`: the comparison of one engine batch with the trainer's recomputation;
* `verdicts`: the survey's decision tree as rules over those numbers (pure Python);
* `probe`: the same measurement as a periodic in-training probe (``logging.diagnose_every``);
* `budget`: the mismatch budget, the KL split into routing, truncation, precision and staleness;
* `render`: the terminal table and JSON; `report`: `moe-rl report`, plots of a run directory.

The survey is Chris Yuhao Liu, "Off-Policy Drift in LLM RL" (blog post, 2026),
https://chrisliu298.ai/posts/off-policy-drift-in-llm-rl/. What the numbers mean:
docs/algorithms.md ("Diagnostics") and docs/diagnostics.md (the mismatch budget).

`results`, `verdicts` and `budget` import nothing heavy; the rest import torch (and Megatron when
run).
"""
