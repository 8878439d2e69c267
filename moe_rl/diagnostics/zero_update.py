"""`moe-rl diagnose`: the zero-update test for each rollout quantization recipe.

Same weights, same prompts (Chris Yuhao Liu, "Off-Policy Drift in LLM RL", blog post, 2026,
https://chrisliu298.ai/posts/off-policy-drift-in-llm-rl/: "Treating kl as policy learning before
checking same-weight rollout/train agreement" is its anti-pattern 1):

1. one trainer model at full precision (`build_gpt_model` with the recipe's seed, then its
   ``model.hf_path`` or ``model.init_from``) — the reference π_old;
2. per quantization recipe, an engine of ``rollout.engine`` that receives the trainer's weights
   through that recipe: the Megatron engine by `update_weights` (ModelOpt fake quantization), vLLM
   from the trainer's Hugging Face folder (online quantization on the CUDA build);
3. the engine samples the same prompts with the same seed; the trainer recomputes the batch
   with and without R3 replay, with and without keep-sampling-mask (`measure`);
4. verdicts from the decision tree (`verdicts`).

A recipe an engine cannot run (e.g. int4_awq on vLLM) is reported as not available, with the
engine's own refusal as the reason.
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from moe_rl.config.modes import Engine
from moe_rl.config.schema import RecipeConfig
from moe_rl.diagnostics import binding
from moe_rl.diagnostics.budget import kl_by_mode, mismatch_budget, truncation_applies
from moe_rl.diagnostics.measure import MeasureParams, measure
from moe_rl.diagnostics.results import DiagnoseReport, NotAvailable, RecipeResult
from moe_rl.diagnostics.verdicts import zero_update_verdicts

log = logging.getLogger(__name__)


def build_trainer(config: RecipeConfig):
    """The reference model: the recipe's trainer model at its starting weights (``model.hf_path``,
    ``model.init_from``: a trained policy's routers are peaked, where a routing flip costs more), in
    eval mode."""
    from moe_rl.megatron.model import build_gpt_model
    from moe_rl.megatron.parallel import init_parallel
    from moe_rl.trainer.checkpoint import load_start_weights

    init_parallel(config.parallel)
    model = build_gpt_model(config.model, config.parallel, config.trainer, seed=config.run.seed)
    load_start_weights(model, config)
    return model.eval()


class EngineFactory:
    """Engines holding the trainer's weights through a recipe's quantization."""

    def __init__(self, trainer, workdir: Path):
        self.trainer, self.workdir = trainer, workdir
        self._hf_folder: Path | None = None

    def open(self, config: RecipeConfig):
        if config.rollout.engine == Engine.MEGATRON:
            return self._megatron(config)
        if config.rollout.engine == Engine.VLLM:
            return self._vllm(config)
        raise ValueError(f"rollout.engine='{config.rollout.engine}'; valid: megatron, vllm")

    def _megatron(self, config: RecipeConfig):
        from moe_rl.megatron.hf_weights import iter_hf_weights
        from moe_rl.rollout.megatron_engine import MegatronEngine

        engine = MegatronEngine(config)
        engine.update_weights(iter_hf_weights(self.trainer), version=1)
        return engine

    def _vllm(self, config: RecipeConfig):
        from moe_rl.megatron.hf_weights import save_hf_checkpoint
        from moe_rl.megatron.model import model_config_to_hf_config
        from moe_rl.rollout.vllm_engine import VLLMEngine

        if self._hf_folder is None:
            self._hf_folder = self.workdir / "trainer_hf"
            save_hf_checkpoint(self.trainer, self._hf_folder, model_config_to_hf_config(config.model))
        return VLLMEngine.from_recipe(binding.without_requests(config), self._hf_folder)


def diagnose_recipe(
    quant: str, config: RecipeConfig, trainer, prompts: Sequence, engines: EngineFactory
) -> RecipeResult:
    """The zero-update test of one quantization recipe (see the module docstring)."""
    from moe_rl.rollout.capabilities import check_recipe

    result = RecipeResult(quant, engine=config.rollout.engine)
    params = MeasureParams.from_config(config)
    try:
        caps = check_recipe(binding.without_requests(config))
    except ValueError as exc:
        result.unavailable = NotAvailable(str(exc))
        log.warning("rollout.quant=%s: %s", quant, result.unavailable)
        return result
    result.device = caps.device
    start = time.perf_counter()
    engine = engines.open(config)
    try:
        result.seconds["engine_start_s"] = time.perf_counter() - start
        batch = engine.generate([list(p.ids) for p in prompts], binding.sampling_spec(config))
        result.seconds["generate_s"] = time.perf_counter() - start - result.seconds["engine_start_s"]
        report = getattr(engine, "last_quant_report", None)
        result.weights = report.summary() if report is not None else {}
    finally:
        engine.shutdown()
    start = time.perf_counter()
    result.modes = measure(trainer, batch, caps, params, binding.advantages(config, prompts, batch))
    result.seconds["measure_s"] = time.perf_counter() - start
    result.counts = {"responses": batch.num_samples, "response_tokens": batch.num_response_tokens}
    result.configured_mode = binding.configured_mode(config, result.modes)
    result.verdicts = zero_update_verdicts(result.modes, result.configured_mode, binding.setup_of(config))
    result.budget = mismatch_budget(kl_by_mode(result.modes), truncation_applies(params.top_k, params.top_p))
    return result


def diagnose(
    configs: Mapping[str, RecipeConfig | NotAvailable], num_prompts: int, recipe: str = ""
) -> DiagnoseReport:
    """Run the zero-update test for every ``{quant name: resolved recipe}`` (same model, seed,
    prompts and sampling in all of them: only ``rollout.quant`` may differ); a `NotAvailable`
    in place of a recipe is reported as such."""
    from moe_rl.rewards.registry import build_prompt_source

    if num_prompts < 1:
        raise ValueError(f"num_prompts={num_prompts}: need at least one prompt")
    runnable = [c for c in configs.values() if isinstance(c, RecipeConfig)]
    if not runnable:
        raise ValueError(f"none of the recipes {list(configs)} can run: {list(configs.values())}")
    base = runnable[0]
    start = time.perf_counter()
    trainer = build_trainer(base)
    prompts = build_prompt_source(base).next_batch(num_prompts)
    report = DiagnoseReport(recipe, base.rollout.engine, num_prompts, base.rollout.group_size, base.run.seed)
    with tempfile.TemporaryDirectory(prefix="moe_rl_diagnose_") as workdir:
        engines = EngineFactory(trainer, Path(workdir))
        for quant, config in configs.items():
            if isinstance(config, NotAvailable):
                report.results.append(RecipeResult(quant, engine=base.rollout.engine, unavailable=config))
                continue
            log.info("diagnose: rollout.quant=%s on rollout.engine=%s", quant, config.rollout.engine)
            report.results.append(diagnose_recipe(quant, config, trainer, prompts, engines))
    report.seconds = time.perf_counter() - start
    return report
