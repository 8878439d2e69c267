"""`moe-rl make-model RECIPE [key=value ...] [--out DIR]`: a random-init Hugging Face checkpoint of
the recipe's model shape, so a recipe that names `model.hf_path` runs on a machine without the real
weights (a CPU, a test, a first try of a new recipe).

The folder is `--out`, or the recipe's `model.hf_path`. It gets `config.json` and safetensors made
by `transformers` from the recipe's `model` section (family qwen3_moe with GQA attention, the one
family a checkpoint can be made for from config alone), and, when the recipe renders prompts with
a chat template (`data.chat_template`), a character-level chat tokenizer beside them. The weights
are random: a run on them checks the whole data path (template, tokenizer, engine, reward), and
its rewards stay where chance puts them.

Everything is checked before torch loads: the recipe, the model family, the tokenizer's needs
(the vocabulary must hold its 102 tokens; `model.eos_token_id` must be its end-of-turn token) and
the folder (absent or empty unless `--force`).
"""

from __future__ import annotations

import logging
from pathlib import Path

from moe_rl.errors import UserError
from moe_rl.orchestration.preflight import load_checked

log = logging.getLogger("moe_rl.make_model")


def make_model_command(recipe: str, overrides: list[str], out: str | None = None, force: bool = False) -> int:
    """Write the checkpoint; returns the exit code."""
    from moe_rl.config.modes import Attention, Family
    from moe_rl.rollout.tiny_tokenizer import IM_END, VOCAB

    config = load_checked(recipe, overrides, paths=False)  # the folder is what this command makes
    model = config.model
    if model.family != Family.QWEN3_MOE or model.attention != Attention.GQA:
        raise UserError(
            f"model.family={model.family} (attention {model.attention}): a checkpoint can be "
            "made from the recipe alone only for family qwen3_moe with attention gqa"
        )
    target = out if out is not None else model.hf_path
    if target is None:
        raise UserError("model.hf_path=null and no --out: say where the checkpoint goes")
    folder = Path(target)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())) and not force:
        raise UserError(f"{folder} exists and is not an empty folder; pass --force to write into it")
    chat = config.data.chat_template
    if chat and model.vocab_size < len(VOCAB):
        raise UserError(
            f"model.vocab_size={model.vocab_size}: the character-level chat tokenizer has {len(VOCAB)} tokens; "
            f"set model.vocab_size >= {len(VOCAB)}"
        )
    if chat and model.eos_token_id != IM_END:
        raise UserError(
            f"model.eos_token_id={model.eos_token_id}: the character-level chat tokenizer ends a turn with "
            f"<|im_end|> = {IM_END}; set model.eos_token_id={IM_END}"
        )

    from moe_rl.rollout.tiny_hf import make_tiny_qwen3_moe, qwen3_moe_kwargs
    from moe_rl.rollout.tiny_tokenizer import write_chat_tokenizer

    make_tiny_qwen3_moe(
        folder, seed=config.run.seed, eos_token_id=model.eos_token_id, **qwen3_moe_kwargs(model)
    )
    if chat:
        write_chat_tokenizer(folder)
    what = "a random-init checkpoint" + (" and a character-level chat tokenizer" if chat else "")
    log.info("%s of %s's model written to %s", what, recipe, folder)
    return 0
