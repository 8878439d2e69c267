"""`moe-rl export RUN_DIR [--step N] OUT`: a run's trainer checkpoint as a Hugging Face folder that
transformers (``from_pretrained``) and vLLM load.

Everything a user can get wrong is checked before torch or Megatron load: the run directory (its
``config.yaml``, the resolved recipe), the checkpoint (``--step N``, or the newest usable one by
the run directory's rules: verified against its manifest, damaged newer ones skipped with a
warning), ``--shard-size`` and OUT (empty or absent unless ``--force``).

Then, in this one process (no Ray; a gloo world of one rank, on the CPU whatever the run's device:
host memory holds what one GPU cannot): the recipe's model is built with a one-rank layout, the checkpoint's model weights are loaded into it through Megatron
``dist_checkpointing`` (which reshards a checkpoint written by any trainer layout: TP, PP, EP, DP),
and `hf_weights.save_hf_checkpoint` writes ``config.json`` and the safetensors shards (with
``model.safetensors.index.json`` when there are several). The optimizer state and a KL penalty's
frozen reference policy (``reference.`` keys) are not read. Next to them: ``generation_config.json``
(the base model's, or one with the recipe's ``model.eos_token_id``) and the tokenizer files of
``model.hf_path`` when it has them.

Of a LoRA run (``lora.rank`` > 0), ``--lora`` picks what is written: ``merged`` (the default) the
model as it computes, each adapter merged into its weight; ``adapter`` a PEFT-style adapter folder
(``adapter_config.json``, ``adapter_model.safetensors``; `moe_rl.megatron.peft_adapter`) that vLLM
loads with a ``LoRARequest`` over the base; ``base`` the frozen weights the adapters apply to. The
adapter folder holds adapters only: a run that also trained its routers or output layer whole
(``lora.train_router``, ``lora.train_output_layer``) is exported merged.

The folder is written under a temporary name next to OUT and renamed when complete, so an export
cut short leaves no half-written OUT.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

from moe_rl import run_dir as rd
from moe_rl.config import RecipeConfig, load_recipe
from moe_rl.config.modes import LoraExport
from moe_rl.errors import UserError
from moe_rl.log import libraries_to_file

log = logging.getLogger("moe_rl.export")

DEFAULT_SHARD_SIZE = "5GB"
TOKENIZER_FILES = (
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "chat_template.*",
    "tiktoken.model",
    "*.tiktoken",
    "tokenization_*.py",
)
"""Files of ``model.hf_path`` copied into the export (the tokenizer and its chat template)."""
GENERATION_CONFIG = "generation_config.json"
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def export_command(
    run_dir: str, out: str, step: int | None = None, shard_size: str = DEFAULT_SHARD_SIZE,
    force: bool = False, lora: LoraExport = LoraExport.MERGED,
) -> int:  # fmt: skip
    """Write the checkpoint of ``step`` (default: the newest usable one) of ``run_dir`` to ``out``
    as a Hugging Face folder (of a LoRA run, what ``lora`` picks); returns the exit code."""
    run, out_dir = Path(run_dir), Path(out)
    config = read_run_config(run)
    lora = check_lora_part(config, run, LoraExport(lora))
    ckpt = pick_checkpoint(run, step)
    max_shard_bytes = parse_size(shard_size)
    check_out(out_dir, run, force)
    what = "" if config.lora.rank == 0 else f" ({lora} LoRA model)"
    log.info("exporting %s (step %d of run %s)%s", ckpt.path, ckpt.step, config.run.name, what)
    with libraries_to_file(_library_log(run)):
        tokenizer = _write_folder(config, ckpt.path / "trainer", out_dir.resolve(), max_shard_bytes, lora)
    log.info("wrote %s: %s", out_dir, ", ".join(sorted(p.name for p in out_dir.iterdir())))
    if lora == LoraExport.ADAPTER:
        base = _adapter_base(config)
        over = base or f"the base (`moe-rl export {run} BASE --lora base`)"
        load = f"vLLM with enable_lora=True and LoRARequest(name, 1, {str(out_dir)!r}) over {over}"
    else:
        load = f"AutoModelForCausalLM.from_pretrained({str(out_dir)!r}) or `vllm serve {out_dir}`"
        if not tokenizer:
            load += " (no tokenizer files: prompts are token ids; vLLM needs skip_tokenizer_init=True)"
    log.info("exported step %d of %s to %s; load it with %s", ckpt.step, run, out_dir, load)
    return 0


def check_lora_part(config: RecipeConfig, run: Path, lora: LoraExport) -> LoraExport:
    """``--lora`` against the run: ``adapter`` and ``base`` need a LoRA run whose trained weights
    are all in its adapters."""
    if lora == LoraExport.MERGED:
        return lora
    if config.lora.rank == 0:
        raise UserError(
            f"--lora {lora}: run {run} trains full weights (lora.rank is 0); export it without --lora"
        )
    whole = [name for name in ("train_router", "train_output_layer") if getattr(config.lora, name)]
    if whole:
        raise UserError(
            f"--lora {lora}: run {run} also trains weights whole (lora.{', lora.'.join(whole)}), which an "
            f"adapter folder does not hold; export the merged model (--lora {LoraExport.MERGED})"
        )
    return lora


def _adapter_base(config: RecipeConfig) -> str | None:
    """The Hugging Face folder the adapters apply to, when the run's base is one (not a run's
    checkpoint or a random start)."""
    return config.model.hf_path if config.model.init_from is None else None


def _library_log(run: Path) -> Path:
    """The run's `logs/export.log`, or a file in the temporary folder when the run is not writable."""
    logs = run / "logs"
    if os.access(logs if logs.is_dir() else run, os.W_OK):
        return logs / "export.log"
    return Path(tempfile.gettempdir()) / f"moe-rl-export-{os.getpid()}.log"


def _write_folder(
    config: RecipeConfig, trainer_dir: Path, target: Path, max_shard_bytes: int, lora: LoraExport
) -> list[str]:
    """Write the folder under a temporary name next to ``target``, then rename it (replacing
    ``target``); returns the tokenizer files copied."""
    staging = target.parent / f".{target.name}.partial"
    if staging.exists():
        shutil.rmtree(staging)  # left by an export killed before it could clean up
    try:
        _write_weights(config, trainer_dir, staging, max_shard_bytes, lora)
        tokenizer = []
        if lora != LoraExport.ADAPTER:
            _write_generation_config(config, staging)
            tokenizer = _copy_tokenizer(config, staging)
        for path in staging.iterdir():  # the umask's file mode (shards are written owner-only)
            path.chmod(staging.stat().st_mode & 0o666)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # a failed export leaves nothing behind
    return tokenizer


# ------------------------------------------------------------------ checks (no torch)
def read_run_config(run: Path) -> RecipeConfig:
    """The resolved recipe a run directory keeps in ``config.yaml``."""
    if not run.is_dir():
        raise UserError(f"run directory {run} does not exist")
    path = run / "config.yaml"
    if not path.is_file():
        raise UserError(f"{run} is not a run directory: it has no config.yaml (the resolved recipe of a run)")
    return load_recipe(path)


def _problem(path: Path) -> str | None:
    """Why the checkpoint ``path`` cannot be exported (None: complete and intact)."""
    problem = rd.verify(path)
    if problem is None and not (path / "trainer").is_dir():
        problem = "it has no trainer/ folder (the trainer's dist_checkpointing state)"
    return problem


def pick_checkpoint(run: Path, step: int | None) -> rd.Usable:
    """The checkpoint of ``step``, which must be complete and intact, or (None) the newest one that
    is: newer ones that fail verification are skipped with a warning, as ``--resume`` does."""
    found = rd.checkpoints(run)
    if not found:
        raise UserError(
            f"{run / 'checkpoints'}: no checkpoint to export (a run saves one at its end, on Ctrl-C and "
            "every run.checkpoint_every steps)"
        )
    if step is not None:
        path = dict(found).get(step)
        if path is None:
            steps = ", ".join(str(s) for s, _ in reversed(found))
            raise UserError(
                f"--step {step}: {run / 'checkpoints'} has no step_{step:06d}; steps saved: {steps}"
            )
        problem = _problem(path)
        if problem is not None:
            raise UserError(f"checkpoint {path} is not usable: {problem}")
        return rd.Usable(path, step)
    skipped = []
    for found_step, path in found:
        problem = _problem(path)
        if problem is None:
            for name, why in skipped:
                log.warning("checkpoint %s is not usable (%s); exporting the older %s", name, why, path.name)
            return rd.Usable(path, found_step)
        skipped.append((path, problem))
    reasons = "; ".join(f"{path}: {why}" for path, why in skipped)
    raise UserError(f"{run}: no usable checkpoint ({reasons})")


def parse_size(text: str) -> int:
    """Bytes in ``5GB``, ``500MB``, ``2GiB`` or ``1000000`` (GB = 10^9 bytes, GiB = 2^30)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if unit not in _UNITS or float(match.group(1)) * _UNITS[unit] < 1:
        raise UserError(
            f"--shard-size {text!r}: expected a positive size such as 5GB, 500MB, 2GiB or a number of bytes"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def check_out(out: Path, run: Path, force: bool) -> None:
    """OUT must be absent or an empty folder (with ``force``: any folder, replaced), neither the
    run directory nor a folder that holds it, and not inside its checkpoints."""
    if out.exists() and not out.is_dir():
        raise UserError(f"OUT {out} is a file; give a folder to write the Hugging Face checkpoint into")
    target, run_abs = out.resolve(), run.resolve()
    if target in (run_abs, *run_abs.parents) or (run_abs / "checkpoints") in (target, *target.parents):
        raise UserError(
            f"OUT {out} would replace the run directory {run} or its checkpoints; export elsewhere"
        )
    if out.is_dir() and any(out.iterdir()) and not force:
        raise UserError(f"OUT {out} is not empty; choose another folder or replace it with --force")


# ------------------------------------------------------------------ the export
def _write_weights(
    config: RecipeConfig, trainer_dir: Path, folder: Path, max_shard_bytes: int, lora: LoraExport
) -> None:
    """The checkpoint's model weights, through a one-rank model, as ``config.json`` + safetensors
    (of a LoRA run: merged, the base alone, or the adapter folder)."""
    from moe_rl.device import hide_cuda_if_cpu

    # On the CPU whatever device the run trained on: host memory holds what one GPU cannot, and a
    # GPU run's checkpoint has the keys a CPU model asks for (Megatron's local layer spec maps its
    # names to transformer-engine's, whose layer norms are fused into the following linears).
    hide_cuda_if_cpu("cpu")
    from moe_rl.config.schema import ParallelConfig
    from moe_rl.megatron.hf_weights import save_hf_checkpoint
    from moe_rl.megatron.model import PRECISIONS, build_gpt_model, model_config_to_hf_config
    from moe_rl.megatron.parallel import init_parallel, teardown_parallel
    from moe_rl.megatron.peft_adapter import drop_adapters, save_adapter
    from moe_rl.trainer.checkpoint import load_model_weights

    one_rank = ParallelConfig()  # dist_checkpointing reshards what any trainer layout wrote
    init_parallel(one_rank)
    try:
        log.info("building the %s model (one rank, %s)", config.model.family, config.trainer.precision)
        model = build_gpt_model(
            config.model, one_rank, config.trainer, seed=config.run.seed, lora=config.lora
        )
        log.info("loading the model weights of %s (not the optimizer state)", trainer_dir)
        load_model_weights(model, trainer_dir)
        if lora == LoraExport.ADAPTER:
            targets = save_adapter(model, config.lora, folder, _adapter_base(config))
            log.info("wrote the adapters of %s to %s", ", ".join(targets), folder)
            return
        if lora == LoraExport.BASE:
            drop_adapters(model)  # the frozen weights alone
        dtype = str(PRECISIONS[config.trainer.precision]).removeprefix("torch.")
        hf_config = model_config_to_hf_config(config.model, dtype)
        if config.model.eos_token_id is not None:
            hf_config["eos_token_id"] = config.model.eos_token_id
        log.info("writing safetensors shards of at most %d bytes to %s", max_shard_bytes, folder)
        save_hf_checkpoint(model, folder, hf_config, max_shard_bytes=max_shard_bytes)
    finally:
        teardown_parallel()


def _write_generation_config(config: RecipeConfig, folder: Path) -> None:
    """The base model's ``generation_config.json``, else one that stops at ``model.eos_token_id``."""
    base = Path(config.model.hf_path) / GENERATION_CONFIG if config.model.hf_path else None
    if base is not None and base.is_file():
        shutil.copy2(base, folder / GENERATION_CONFIG)
    elif config.model.eos_token_id is not None:
        generation = {"eos_token_id": config.model.eos_token_id}
        (folder / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2) + "\n")


def _copy_tokenizer(config: RecipeConfig, folder: Path) -> list[str]:
    """Copy the tokenizer files of ``model.hf_path`` (none for a model made from config)."""
    if not config.model.hf_path:
        return []
    source = Path(config.model.hf_path)
    if not source.is_dir():
        log.warning(
            "model.hf_path %s is not here: the export has no tokenizer files; copy them from it", source
        )
        return []
    files = sorted({p for pattern in TOKENIZER_FILES for p in source.glob(pattern) if p.is_file()})
    for path in files:
        shutil.copy2(path, folder / path.name)
    if files:
        log.info("copied the tokenizer files of %s: %s", source, ", ".join(p.name for p in files))
    return [p.name for p in files]
