"""Verifiable rewards: synthetic tasks, math answers, exact match, user functions."""

from moe_rl.rewards.datasets import ByteTokenizer, PromptSource
from moe_rl.rewards.registry import RewardScorer
from moe_rl.rewards.tasks import TASKS, Prompt, get_task

__all__ = ["TASKS", "ByteTokenizer", "Prompt", "PromptSource", "RewardScorer", "get_task"]
