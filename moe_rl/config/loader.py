"""Load a recipe: layered YAML files + dotlist overrides, merged onto the typed schema.

Order of precedence, lowest first:
  1. the dataclass defaults (`moe_rl.config.schema`);
  2. the quantization recipe named by `rollout.quant` (`<recipes>/quant/<name>.yaml`);
  3. the recipe's `defaults:` pieces, in order (paths relative to the recipes folder, `.yaml`
     optional), each of which may list `defaults:` of its own;
  4. the recipe file itself;
  5. the command-line overrides (`trainer.lr=2e-6`).

Unknown keys are errors naming the key and the closest valid key; values of the wrong type are
errors naming the full path and the expected type; every value is checked on its own
(`validate.check_values`). The cross-field checks live in `validate.py` and are enforced by the
preflight (`moe_rl.orchestration.preflight`) with every component's rules.

Files are UTF-8. An empty recipe file (nothing, or only comments) is an error, and so is an empty
quantization recipe (a recipe named by `rollout.quant` must define its `quant` section); an empty
`defaults:` piece is a placeholder layer and adds nothing. A file or override whose YAML aliases
expand it past `MAX_VALUES` values (an "alias bomb": a few lines of nested anchors can stand for
billions of values) is refused as it is parsed, before anything walks it; a value that refers to
itself is refused too. Errors show a value only in part (`brief`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
import typing
from collections.abc import Iterable, Sequence
from enum import Enum
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from moe_rl.config.schema import CHOICES, LIST_CHOICES, RecipeConfig
from moe_rl.config.validate import check_values
from moe_rl.errors import BRIEF_CHARS, ConfigError, brief, clip

MAX_VALUES = 100_000
"""The most values (scalars, lists and mappings, counted at every use of a YAML alias) one recipe
file or override may hold: recipes hold hundreds; nested aliases can make a few lines stand for
billions, which OmegaConf and the checks would build and walk one by one."""
_SIZE_CAP = 10**15
"""Sizes are counted up to here: a chain of aliases grows past any number, and adding numbers of
millions of digits would take the time the bound is there to save. The key a refusal names holds
only keys within the bound, as many as are written, so its own count stays far below."""


class TooManyValues(yaml.YAMLError):
    """The document expands to more than `MAX_VALUES` values with its aliases followed, or a value
    refers to itself; ``key`` is where (dotted keys and list indices; empty: the whole file)."""

    def __init__(self, key: str, line: int, values: int | None):
        where = f"`{key}`" if key else "a value" if values is None else "the file"
        if values is None:
            what = "refers to itself through a YAML alias"
        else:
            what = f"expands to {values:,} values with its YAML aliases followed; a recipe holds at most {MAX_VALUES:,}"
        super().__init__(f"line {line}: {where} {what}")


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _expanded_sizes(root: yaml.Node) -> dict[int, int]:
    """How many values each node of a composed document stands for, every alias followed (a node
    shared through an alias counted at each use), by id; in time linear in the nodes as written.
    Raises `TooManyValues` for a node that contains itself."""
    sizes: dict[int, int] = {}
    open_: set[int] = set()  # started, not finished: the ancestors of what is visited
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        if finished:
            open_.discard(id(node))
            sizes[id(node)] = min(_SIZE_CAP + 1, 1 + sum(sizes[id(c)] for c in _children(node)))
        elif id(node) in open_:
            raise TooManyValues("", node.start_mark.line + 1, None)
        elif id(node) not in sizes:
            open_.add(id(node))
            stack.append((node, True))
            stack += [(child, False) for child in _children(node)]
    return sizes


def _check_size(root: yaml.Node) -> None:
    """Refuse a document that stands for more than `MAX_VALUES` values, naming the deepest key
    that alone does."""
    sizes = _expanded_sizes(root)
    if sizes[id(root)] <= MAX_VALUES:
        return
    node, keys = root, []
    while True:
        if isinstance(node, yaml.MappingNode):
            parts = [(str(k.value) if isinstance(k, yaml.ScalarNode) else "?", v) for k, v in node.value]
        elif isinstance(node, yaml.SequenceNode):
            parts = [(f"[{i}]", v) for i, v in enumerate(node.value)]
        else:
            parts = []
        big = [(key, child) for key, child in parts if sizes[id(child)] > MAX_VALUES]
        if not big:
            break
        key, node = big[0]
        keys.append(key)
    raise TooManyValues(".".join(keys).replace(".[", "["), node.start_mark.line + 1, sizes[id(node)])


class DuplicateKey(yaml.YAMLError):
    """A mapping gives one key twice (YAML would keep the last silently)."""

    def __init__(self, key: str, line: int, first: int):
        super().__init__(f"line {line}: `{clip(key)}` is given twice (first at line {first})")
        self.key, self.line, self.first = key, line, first


class _YamlLoader(yaml.SafeLoader):
    """YAML with 1.2 booleans: only true/false are booleans, so `off`, `on`, `yes`, `no` stay
    strings (`algo.routing_replay: off`); a key given twice in one mapping is an error, not the
    last one silently winning (a second `rollout:` section would replace the whole first); a
    document whose aliases expand it past `MAX_VALUES` values is refused once composed, before
    anything is built from it (`_check_size`)."""

    def get_single_node(self) -> yaml.Node | None:
        node = super().get_single_node()
        if node is not None:
            _check_size(node)
        return node

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise DuplicateKey(str(key), line, seen[key])
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


_BOOL = "tag:yaml.org,2002:bool"
_YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != _BOOL]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_YamlLoader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))


def parse_yaml(text: str) -> Any:
    """Parse YAML text with 1.2 booleans (see `_YamlLoader`)."""
    return yaml.load(text, Loader=_YamlLoader)  # a SafeLoader subclass: no arbitrary objects


def recipes_root(recipe: Path) -> Path:
    """The `recipes/` folder a recipe file lives in (its own folder if none is named so)."""
    for parent in recipe.resolve().parents:
        if parent.name == "recipes":
            return parent
    return recipe.resolve().parent


def _is_file(path: Path) -> bool:
    """Whether ``path`` is a file; False too for a name the system cannot look up (too long)."""
    try:
        return path.is_file()
    except OSError:
        return False


def _read_text(path: Path) -> str:
    if not _is_file(path):
        raise ConfigError(f"recipe file not found: {clip(str(path), 2 * BRIEF_CHARS)}")
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); save it as UTF-8"
        ) from None


def _read_yaml(path: Path) -> dict[str, Any] | None:
    """The mapping in a YAML file; None when the file holds nothing (empty, or only comments)."""
    try:
        data = parse_yaml(_read_text(path))
    except DuplicateKey as exc:
        raise ConfigError(f"{path} {exc}; give each key once") from None
    except TooManyValues as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {_yaml_problem(exc)}") from exc
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{path}: a recipe must be a mapping of sections, got {type(data).__name__}")
    return data


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """PyYAML's error on one line: where and what (its own message quotes the lines around it)."""
    mark, problem = getattr(exc, "problem_mark", None), getattr(exc, "problem", None)
    if mark is None or problem is None:
        return clip(" ".join(str(exc).split()), 2 * BRIEF_CHARS)
    context = getattr(exc, "context", None)
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" + (f" ({context})" if context else "")


def _resolve_piece(root: Path, name: str) -> Path:
    path = root / name
    return path if path.suffix in (".yaml", ".yml") else path.with_suffix(".yaml")


def _load_layers(path: Path, root: Path, seen: tuple[Path, ...] = ()) -> list[tuple[Path, dict]]:
    """The recipe and its `defaults:` pieces, flattened lowest precedence first."""
    path = path.resolve()
    if path in seen:
        chain = " -> ".join(str(p.name) for p in (*seen, path))
        raise ConfigError(f"recipe defaults form a cycle: {chain}")
    data = _read_yaml(path)
    if data is None and not seen:
        raise ConfigError(f"recipe {path} is empty")
    data = data or {}  # an empty piece adds nothing
    defaults = data.pop("defaults", [])
    if not isinstance(defaults, list) or not all(isinstance(d, str) for d in defaults):
        raise ConfigError(f"{path}: `defaults` must be a list of recipe piece names, got {brief(defaults)}")
    layers: list[tuple[Path, dict]] = []
    for piece in defaults:
        layers += _load_layers(_resolve_piece(root, piece), root, (*seen, path))
    layers.append((path, data))
    return layers


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _all_paths(cls: type, prefix: str = "") -> list[str]:
    paths = []
    for name, tp in _field_types(cls).items():
        full = f"{prefix}{name}"
        paths.append(full)
        if dataclasses.is_dataclass(tp):
            paths += _all_paths(tp, full + ".")
    return paths


def _unknown_key(key: str, cls: type, path: str, source: str) -> ConfigError:
    valid = list(_field_types(cls))
    full = f"{path}{key}"
    paths = _all_paths(RecipeConfig)
    elsewhere = [p for p in paths if p.rpartition(".")[2] == key]  # the key itself, in other sections
    close = [] if elsewhere else difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    if elsewhere:
        hint = f"; did you mean {' or '.join(f'`{c}`' for c in elsewhere)}?"
    elif not close:  # maybe the key belongs to another section: match on the last component
        leaves = sorted({p.rpartition(".")[2] for p in paths})
        leaf = difflib.get_close_matches(key, leaves, n=1, cutoff=0.8)
        if leaf:  # every section that holds it (`lr`: critic.lr, trainer.lr)
            close = [p for p in paths if p.rpartition(".")[2] == leaf[0]]
        else:
            close = difflib.get_close_matches(full, paths, n=1, cutoff=0.6)
        hint = f"; did you mean {' or '.join(f'`{c}`' for c in close)}?" if close else ""
    else:
        hint = f"; did you mean `{path}{close[0]}`?"
    where = path.rstrip(".") or "the top level"
    return ConfigError(
        f"{source}: unknown key `{full}`{hint} (valid keys in {where}: {', '.join(sorted(valid))})"
    )


def check_keys(data: dict[str, Any], source: str, cls: type = RecipeConfig, path: str = "") -> None:
    """Raise `ConfigError` for any key of `data` that the schema does not have."""
    types = _field_types(cls)
    for key, value in data.items():
        if key not in types:
            raise _unknown_key(str(key), cls, path, source)
        if dataclasses.is_dataclass(types[key]):
            if value is None:
                continue
            if not isinstance(value, dict):
                raise ConfigError(
                    f"{source}: `{path}{key}` is a section; expected a mapping, got {brief(value)}"
                )
            check_keys(value, source, types[key], f"{path}{key}.")


def _overrides_to_dict(overrides: Sequence[str]) -> dict[str, Any]:
    """`a.b=value` items → nested dict; values parse as YAML (1.2 booleans)."""
    out: dict[str, Any] = {}
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override `{clip(item)}` is not of the form section.key=value")
        try:
            value = parse_yaml(text) if text else None
        except yaml.YAMLError as exc:
            raise ConfigError(
                f"override `{clip(item)}`: the value is not valid YAML: {_yaml_problem(exc)}"
            ) from exc
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override `{clip(item)}` conflicts with an earlier override of `{part}`")
        node[leaf] = value
    return out


def _typed_modes(data: dict[str, Any], path: str = "") -> dict[str, Any]:
    """``data`` with the value of every choice field (`moe_rl.config.schema.CHOICES`, every field
    the schema types with a mode) turned into its mode's member, before OmegaConf sees it (OmegaConf
    would match an enum by its member's name, and 2.3 only by that); a value that is none of them is
    a `ConfigError` naming the field, the value and the valid ones."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        full = f"{path}{key}"
        mode = CHOICES.get(full)
        if isinstance(value, dict):
            value = _typed_modes(value, f"{full}.")
        elif full in LIST_CHOICES and isinstance(value, list | tuple):
            value = [_member(LIST_CHOICES[full], item, full) for item in value]
        elif mode is not None and value is not None and not isinstance(value, Enum):
            value = _member(mode, value, full)
        out[key] = value
    return out


def _member(mode: type[Enum], value: Any, field: str) -> Enum:
    """``value`` as a member of ``mode`` (by its text), or a `ConfigError` naming ``field``."""
    if isinstance(value, Enum):
        return value
    text = str(value)
    try:
        return mode(text)
    except ValueError:
        valid = ", ".join(member.value for member in mode)
        raise ConfigError(f"{field}={brief(text)} is not one of: {valid}") from None


def _expected_type(full_key: str) -> str:
    cls: Any = RecipeConfig
    tp: Any = None
    for part in full_key.split("."):
        if not dataclasses.is_dataclass(cls):
            break
        tp = _field_types(cls).get(part)
        cls = tp
    return getattr(tp, "__name__", None) or str(tp)


@functools.cache
def _schema() -> DictConfig:
    """The recipe's schema as OmegaConf's structured config, built once: `OmegaConf.merge` copies
    what it merges into and never changes its arguments."""
    return OmegaConf.structured(RecipeConfig)


def _merge(layers: Iterable[tuple[str, dict[str, Any]]]) -> DictConfig:
    layers = list(layers)
    try:  # all at once: one copy of the whole config, not one per layer
        created = [OmegaConf.create(_typed_modes(data)) for _, data in layers]
        return OmegaConf.merge(_schema(), *created)  # type: ignore[return-value]
    except OmegaConfBaseException:
        pass  # layer by layer below, to name the layer at fault
    merged = _schema()
    for source, data in layers:
        try:
            merged = OmegaConf.merge(merged, OmegaConf.create(_typed_modes(data)))
        except OmegaConfBaseException as exc:
            key = getattr(exc, "full_key", None) or "?"
            raise ConfigError(
                f"{source}: `{key}` expects {_expected_type(key)}: {clip(str(exc).splitlines()[0], 2 * BRIEF_CHARS)}"
            ) from exc
    return merged  # type: ignore[return-value]


def _quant_layer(root: Path, name: str) -> tuple[str, dict[str, Any]]:
    path = root / "quant" / f"{name}.yaml"
    if not _is_file(path):
        available = sorted(p.stem for p in (root / "quant").glob("*.yaml"))
        raise ConfigError(
            f"rollout.quant: no quantization recipe `{clip(name)}` in {root / 'quant'} "
            f"(available: {', '.join(available) or 'none'})"
        )
    data = _read_yaml(path)
    if data is None:
        raise ConfigError(f"quantization recipe {path} is empty")
    check_keys(data, str(path))
    if set(data) - {"quant"}:
        raise ConfigError(f"{path}: a quantization recipe may only set the `quant` section")
    return str(path), data


def load_recipe(recipe: str | Path, overrides: Sequence[str] = ()) -> RecipeConfig:
    """Load `recipe` with `overrides` into a typed `RecipeConfig`.

    Every field's own value is checked (`check_values`: ranges, finite numbers, choices, the run
    name), so nothing downstream divides by a zero size. The cross-field checks and the components'
    rules are the preflight's (`moe_rl.orchestration.preflight`): `check` enforces them,
    `load_checked` loads and checks.
    """
    path = Path(recipe)
    root = recipes_root(path)
    layers = [(str(p), d) for p, d in _load_layers(path, root)]
    for source, data in layers:
        check_keys(data, source)
    cli = _overrides_to_dict(overrides)
    check_keys(cli, "override")
    layers.append(("override", cli))
    first = _merge(layers)
    quant_name = first.rollout.quant
    if _is_file(root / "quant" / f"{quant_name}.yaml") or first.quant.name != quant_name:
        layers.insert(0, _quant_layer(root, quant_name))
    # else: a resolved recipe (e.g. a run directory's config.yaml) that carries its quant section
    merged = _merge(layers)
    config: RecipeConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    check_values(config)
    return config


def to_yaml(config: RecipeConfig) -> str:
    """The resolved recipe as YAML (loadable again with `load_recipe`); modes as the recipe
    spells them."""
    return OmegaConf.to_yaml(OmegaConf.create(to_dict(config)))


def to_dict(config: RecipeConfig) -> dict[str, Any]:
    """The resolved recipe as plain Python containers; modes as the recipe spells them."""
    return _spelled(OmegaConf.to_container(OmegaConf.structured(config), enum_to_str=False))


def _spelled(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _spelled(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_spelled(v) for v in value]
    return value.value if isinstance(value, Enum) else value
