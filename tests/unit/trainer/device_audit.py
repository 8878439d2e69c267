"""Checks of device discipline that also mean something on a CPU-only machine.

On a machine without CUDA every tensor is on the CPU, so a tensor created on the wrong device
cannot show itself by failing. What can be checked is the discipline that makes the code right on
any device: inside a pass, every tensor the project creates names its device (or derives it from
another tensor: ``*_like``, ``new_*``), and every tensor that enters the model is on the model's
device. `FactoryAudit` records the factory calls made from the project's own code without a
``device=``; `ModelInputAudit` records the devices of everything handed to a model's forward.

``moe_rl/data`` is left out of the factory audit on purpose: it is the CPU side of the contract
(trajectories are CPU tensors on the wire and on disk, and are packed there before a worker moves
them to its device).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

import moe_rl

PACKAGE = Path(moe_rl.__file__).resolve().parent
CPU_SIDE = PACKAGE / "data"
TORCH = Path(torch.__file__).resolve().parent
FACTORIES = {
    torch.arange, torch.zeros, torch.ones, torch.empty, torch.full, torch.tensor, torch.as_tensor,
    torch.randn, torch.rand, torch.randint, torch.randperm, torch.linspace, torch.eye,
}  # fmt: skip


def _caller() -> Path | None:
    """The file of the first frame outside torch and this module (who called the factory)."""
    frame = sys._getframe(2)
    here = Path(__file__).resolve()
    while frame is not None:
        path = Path(frame.f_code.co_filename).resolve()
        if path != here and not path.is_relative_to(TORCH):
            return path
        frame = frame.f_back
    return None


@dataclass
class FactoryAudit(TorchFunctionMode):
    """Records ``file:line factory`` for each factory call from ``moe_rl`` without ``device=``."""

    violations: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            caller = _caller()
            if caller is not None and caller.is_relative_to(PACKAGE) and not caller.is_relative_to(CPU_SIDE):
                frame = sys._getframe(1)
                while frame is not None and Path(frame.f_code.co_filename).resolve() != caller:
                    frame = frame.f_back
                line = frame.f_lineno if frame is not None else 0
                self.violations.append(f"{caller.relative_to(PACKAGE.parent)}:{line} torch.{func.__name__}")
        return func(*args, **kwargs)


class ModelInputAudit:
    """Forward pre-hook on a model: the devices of every tensor (and packed-sequence tensor) it got."""

    def __init__(self, model: torch.nn.Module):
        self.devices: set[torch.device] = set()
        self.calls = 0
        self._handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs) -> None:
        self.calls += 1
        for value in [*args, *kwargs.values()]:
            for tensor in _tensors(value):
                self.devices.add(tensor.device)

    def remove(self) -> None:
        self._handle.remove()


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if hasattr(value, "__dataclass_fields__") or hasattr(value, "__dict__"):
        return [v for v in vars(value).values() if isinstance(v, torch.Tensor)]
    return []


def tensors_of(obj, seen: set[int] | None = None) -> list[tuple[str, torch.Tensor]]:
    """Every tensor reachable through an object's attributes (dataclasses, nested), with its path."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    found = []
    for name, value in vars(obj).items():
        if isinstance(value, torch.Tensor):
            found.append((name, value))
        elif hasattr(value, "__dataclass_fields__"):
            found += [(f"{name}.{inner}", t) for inner, t in tensors_of(value, seen)]
    return found
