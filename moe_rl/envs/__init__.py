"""Multi-turn, tool-using rollouts: the environment interface (`base`), the built-in `calculator`
environment, and the rollout loop over turns (`rollout`)."""

from moe_rl.envs.base import ENVIRONMENTS, Environment, StepResult, build_env_factory, check_step_result
from moe_rl.envs.calculator import CalculatorEnv, CalculatorError, evaluate

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
