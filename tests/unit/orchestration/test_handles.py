"""A run's workers behind typed interfaces (`moe_rl.orchestration.handles`): the Ray backend and the
one-process backend implement every verb of each interface with the interface's parameters, and the
code that runs a step calls no verb the interfaces do not declare. A verb added to one backend and
not the other, or called by a stage and declared nowhere, fails here."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from moe_rl.orchestration import handles
from moe_rl.orchestration.batches import Rewarder
from moe_rl.orchestration.engine_pool import EnginePool
from moe_rl.orchestration.local import LocalEngines, LocalTrainer
from moe_rl.orchestration.trainer_group import TrainerGroup
from moe_rl.orchestration.workers import RayRewarder
from moe_rl.weight_sync import coordinator

BACKENDS = {
    handles.TrainerHandle: (TrainerGroup, LocalTrainer),
    handles.EnginesHandle: (EnginePool, LocalEngines),
    handles.RewarderHandle: (RayRewarder, Rewarder),
}
"""Each interface, and its Ray and one-process implementations."""

PACKAGE = Path(handles.__file__).parents[1]
CALLERS = {
    "trainer": handles.TrainerHandle,
    "engines": handles.EnginesHandle,
    "rewarder": handles.RewarderHandle,
}
"""What the step's code calls a worker, and the interface it holds it by."""


def verbs(protocol: type) -> dict[str, object]:
    """The members an interface declares (its own and those of the interfaces it extends): methods
    and properties by their objects, attributes by their annotations."""
    found: dict[str, object] = {}
    for cls in reversed(protocol.__mro__):
        if not getattr(cls, "_is_protocol", False) or cls.__module__ == "typing":
            continue
        found.update(getattr(cls, "__annotations__", {}))
        found.update(
            (name, member)
            for name, member in vars(cls).items()
            if not name.startswith("_") and (inspect.isfunction(member) or isinstance(member, property))
        )
    return found


def _parameters(function) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


def _has_attribute(cls: type, name: str) -> bool:
    annotated = any(name in getattr(c, "__annotations__", {}) for c in cls.__mro__)
    return annotated or hasattr(cls, name)


@pytest.mark.parametrize(
    "protocol, backend",
    [(protocol, backend) for protocol, backends in BACKENDS.items() for backend in backends],
    ids=lambda item: item.__name__,
)
def test_each_backend_implements_every_verb_of_its_interface_with_the_interfaces_parameters(
    protocol, backend
):
    declared = verbs(protocol)
    assert declared, protocol
    for name, member in declared.items():
        if inspect.isfunction(member):
            ours = getattr(backend, name, None)
            assert inspect.isfunction(ours), f"{backend.__name__} has no method {name} ({protocol.__name__})"
            assert _parameters(ours) == _parameters(member), f"{backend.__name__}.{name}"
        else:  # a property or an attribute: a value the backend has (its own property, or set per instance)
            assert _has_attribute(backend, name), f"{backend.__name__} has no {name} ({protocol.__name__})"


def test_the_interfaces_declare_what_a_step_needs_and_extend_the_weight_syncs():
    """The trainer's and the engines' interfaces are the weight-sync coordinator's too."""
    trainer, engines = verbs(handles.TrainerHandle), verbs(handles.EnginesHandle)
    assert set(verbs(coordinator.SyncTrainer)) <= set(trainer)
    assert set(verbs(coordinator.SyncEngines)) <= set(engines)
    assert {"old_logp", "train", "stream_weights", "release_memory", "save_checkpoint"} <= set(trainer)
    assert {"generate", "collect", "regenerate", "begin", "finish", "sleep", "wake_up", "probe"} <= set(
        engines
    )
    assert {"prepare", "prepare_stored", "dump"} <= set(verbs(handles.RewarderHandle))


def _calls(path: Path) -> set[tuple[str, str]]:
    """``(worker, verb)`` for every ``<x>.trainer.<verb>`` (and engines, rewarder) in a module."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        inner = getattr(node, "value", None)
        if isinstance(node, ast.Attribute) and isinstance(inner, ast.Attribute) and inner.attr in CALLERS:
            found.add((inner.attr, node.attr))
    return found


@pytest.mark.parametrize(
    "module",
    [
        "orchestration/stages.py", "orchestration/loop.py", "orchestration/driver.py", "orchestration/local.py",
        "orchestration/run.py", "weight_sync/coordinator.py",
    ],
)  # fmt: skip
def test_the_steps_code_calls_only_verbs_the_interfaces_declare(module):
    calls = _calls(PACKAGE / module)
    undeclared = sorted(f"{worker}.{verb}" for worker, verb in calls if verb not in verbs(CALLERS[worker]))
    assert not undeclared, f"{module} calls verbs no interface declares: {undeclared}"


def test_the_call_finder_sees_the_stages_calls():
    """The scan above reads what the stages call (else it would pass over any module)."""
    calls = _calls(PACKAGE / "orchestration/stages.py")
    assert {("trainer", "old_logp"), ("engines", "generate"), ("rewarder", "prepare")} <= calls
