"""What the tiny chat tokenizer's template (`moe_rl.rollout.tiny_tokenizer.CHAT_TEMPLATE`) renders,
written out by hand: the text a chat-formatted prompt must decode to."""

from __future__ import annotations


def chat_text(user: str, system: str | None = None, thinking_off: bool = False) -> str:
    """One user turn (after a system turn when given) and the generation prompt; with
    ``thinking_off`` (``enable_thinking=false``) the empty thinking block after it."""
    turns = ([f"<|im_start|>system\n{system}<|im_end|>\n"] if system is not None else []) + [
        f"<|im_start|>user\n{user}<|im_end|>\n"
    ]
    return "".join(turns) + "<|im_start|>assistant\n" + ("<think>\n\n</think>\n\n" if thinking_off else "")
