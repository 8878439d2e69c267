"""A tiny chat tokenizer made locally with the `tokenizers` library (no download).

One token per printable ASCII character (and newline) after six special tokens, and a Qwen3-style
chat template (`<|im_start|>role\\n...<|im_end|>\\n` turns; `enable_thinking=false` writes an empty
thinking block after the assistant's opening). `write_chat_tokenizer` saves `tokenizer.json` and a
`tokenizer_config.json` carrying the template, the folder layout `transformers.AutoTokenizer` loads.
`moe-rl make-model` writes it beside a toy checkpoint, so a chat-formatted recipe runs on a CPU.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

SPECIAL = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
THINK = ["<think>", "</think>"]
CHARS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
VOCAB = [*SPECIAL, *THINK, *CHARS]
IM_END = VOCAB.index("<|im_end|>")
"""The end of a turn: the model's `eos_token_id` (3, not the synthetic tasks' EOS 2)."""

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)


def write_chat_tokenizer(folder: Path, chat_template: str | None = CHAT_TEMPLATE) -> Path:
    """Save the tokenizer into ``folder`` (with ``chat_template=None``: a tokenizer without one)."""
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import WordLevel

    tokenizer = Tokenizer(WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(SPECIAL)
    tokenizer.add_tokens(THINK)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "model_max_length": 256,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return folder
