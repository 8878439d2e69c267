"""Training–inference mismatch diagnostics beyond the per-step metrics of the trainer.

* `zero_update`: `moe-rl diagnose`, the zero-update test (survey seed
  ``off-policy-drift-survey.txt``, "Identifying mismatch — a diagnostic toolkit": same weights,
  same prompts, engine vs trainer) for each rollout quantization recipe, with and without R3 and
  keep-sampling-mask;
* `measure`: the comparison of one engine batch with the trainer's recomputation;
* `verdicts`: the survey's decision tree as rules over those numbers (pure Python);
* `probe`: the same measurement as a periodic in-training probe (``logging.diagnose_every``);
* `budget`: the mismatch budget, the KL split into routing, truncation, precision and staleness;
* `render`: the terminal table and JSON; `report`: `moe-rl report`, plots of a run directory.

`results`, `verdicts` and `budget` import nothing heavy; the rest import torch (and Megatron when
run).
"""
