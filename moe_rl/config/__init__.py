"""Typed recipe configuration. Imports without torch, vLLM or Megatron."""

from moe_rl.config.loader import load_recipe, to_dict, to_yaml
from moe_rl.config.schema import RecipeConfig
from moe_rl.errors import ConfigError

__all__ = ["ConfigError", "RecipeConfig", "load_recipe", "to_dict", "to_yaml"]
