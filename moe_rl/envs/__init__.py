"""Multi-turn, tool-using rollouts: the environment interface (`base`), the built-in `calculator`
environment, `env.name` → environments (`registry`), and the rollout loop over turns (`rollout`)."""

from moe_rl.envs.base import Environment, StepResult, check_step_result
from moe_rl.envs.calculator import CalculatorEnv, CalculatorError, evaluate
from moe_rl.envs.registry import ENVIRONMENTS, build_env_factory

__all__ = [
    "ENVIRONMENTS",
    "CalculatorEnv",
    "CalculatorError",
    "Environment",
    "StepResult",
    "build_env_factory",
    "check_step_result",
    "evaluate",
]
