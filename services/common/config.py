"""Strict stage configuration: one YAML file per stage, loaded into frozen dataclasses.

A stage's config is a frozen dataclass whose fields are *sections*, each section a
frozen dataclass of scalar keys (or tuples of scalars / of small dataclasses). Loading
is strict, so a typo fails at start-up instead of silently running with a default:

- an unknown section or key is an error naming the file and the key;
- a value of the wrong type is an error (no silent coercion: ``"5"`` is not an int
  in YAML; ``1.5`` is not an int anywhere);
- booleans are ``true``/``false`` in any case, or ``1``/``0``. Everything else for a
  boolean key is an error, including YAML 1.1's ``yes``/``no``/``on``/``off``, which
  this loader does not turn into booleans anywhere (``on`` stays the string "on");
- an explicit null means the key's (or the whole section's) default;
- ``VOXRING_<STAGE>__<SECTION>__<KEY>`` environment variables override the file. Their
  values are parsed as YAML scalars by the same loader and checked the same way; an
  override naming an unknown section or key is an error too.

Sections validate their own values in ``__post_init__`` by raising
:class:`ConfigValueError` with the key; the loader adds file and section to the message.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml

__all__ = [
    "ConfigError",
    "ConfigValueError",
    "StrictLoader",
    "env_prefix",
    "load_config",
    "parse_section",
    "parse_yaml_text",
]

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration problem found at start-up; the message names file and key."""


class ConfigValueError(ValueError):
    """Raised by a section's ``__post_init__``: ``key`` is the offending key."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self.reason = message


# --- YAML: YAML 1.2-style scalars, duplicate keys refused ---------------------------


class StrictLoader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 core-schema scalars.

    PyYAML implements YAML 1.1: ``yes``/``no``/``on``/``off`` become booleans, ``010``
    is octal, ``1:30`` is 90 and ``1e-3`` is a string. Here only ``true``/``false`` (any
    case) are booleans, integers are decimal, floats may use exponents without a dot,
    and a mapping with a repeated key is an error.
    """


_YAML11_SCALAR_TAGS = {"tag:yaml.org,2002:bool", "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"}
StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in _YAML11_SCALAR_TAGS]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}

_BOOL_RE = re.compile(r"^(?:true|false)$", re.IGNORECASE)
_INT_RE = re.compile(r"^[-+]?[0-9]+$")
_FLOAT_RE = re.compile(
    r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
)
StrictLoader.add_implicit_resolver("tag:yaml.org,2002:bool", _BOOL_RE, list("tTfF"))
StrictLoader.add_implicit_resolver("tag:yaml.org,2002:int", _INT_RE, list("-+0123456789"))
StrictLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_RE, list("-+0123456789."))


def _construct_bool(loader: StrictLoader, node: yaml.ScalarNode) -> bool:
    return loader.construct_scalar(node).lower() == "true"


def _construct_int(loader: StrictLoader, node: yaml.ScalarNode) -> int:
    return int(loader.construct_scalar(node), 10)


def _construct_float(loader: StrictLoader, node: yaml.ScalarNode) -> float:
    text = loader.construct_scalar(node).lower()
    if text.endswith(".inf"):
        return -math.inf if text.startswith("-") else math.inf
    if text == ".nan":
        return math.nan
    return float(text)


def _construct_mapping(loader: StrictLoader, node: yaml.MappingNode) -> dict:
    loader.flatten_mapping(node)
    result: dict = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in result:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark)
        result[key] = loader.construct_object(value_node, deep=True)
    return result


StrictLoader.add_constructor("tag:yaml.org,2002:bool", _construct_bool)
StrictLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)
StrictLoader.add_constructor("tag:yaml.org,2002:float", _construct_float)
StrictLoader.add_constructor("tag:yaml.org,2002:map", _construct_mapping)


def parse_yaml_text(text: str, source: str) -> Any:
    """Parses YAML with :class:`StrictLoader`; syntax errors name ``source``."""
    try:
        return yaml.load(text, Loader=StrictLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: invalid YAML: {exc}") from None


# --- typed conversion ----------------------------------------------------------------


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


def _convert(value: Any, annotation: Any, where: str) -> Any:
    """Converts one parsed YAML value to ``annotation`` or raises ConfigError."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        concrete = [opt for opt in options if opt is not type(None)]
        if len(concrete) != 1:
            raise TypeError(f"{where}: only Optional[X] unions are supported")
        return _convert(value, concrete[0], where)
    if origin is tuple:
        args = typing.get_args(annotation)
        if len(args) != 2 or args[1] is not Ellipsis:
            raise TypeError(f"{where}: only tuple[X, ...] is supported")
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {_describe(value)}")
        return tuple(_convert(item, args[0], f"{where}[{i}]") for i, item in enumerate(value))
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {_describe(value)}")
        return parse_section(annotation, value, where)
    if annotation is bool:
        return _to_bool(value, where)
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {_describe(value)}")
        return value
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {_describe(value)}")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {_describe(value)}")
        return value
    raise TypeError(f"{where}: unsupported config type {annotation!r}")


def _to_bool(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        lowered = value.strip().lower()
        if lowered in ("true", "1"):
            return True
        if lowered in ("false", "0"):
            return False
    raise ConfigError(
        f"{where}: expected a boolean (true/false in any case, or 1/0), got {_describe(value)}")


def parse_section(
    cls: type[T],
    data: Mapping[str, Any],
    where: str,
    origins: Mapping[str, str] | None = None,
) -> T:
    """Builds dataclass ``cls`` from ``data``: unknown keys and bad types are errors,
    null means the field's default. ``where`` prefixes every message; ``origins`` maps a
    key to a better description of where its value came from (an environment variable).
    """
    origins = origins or {}
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(str(k) for k in data if k not in fields)
    if unknown:
        raise ConfigError(
            f"{where}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} "
            f"(known: {', '.join(sorted(fields))})")
    kwargs = {}
    for name, value in data.items():
        if value is None:
            continue  # explicit null: keep the default
        kwargs[name] = _convert(value, hints[name], origins.get(name, f"{where}.{name}"))
    missing = sorted(f.name for f in dataclasses.fields(cls)
                     if f.init and f.name not in kwargs and f.default is dataclasses.MISSING
                     and f.default_factory is dataclasses.MISSING)
    if missing:
        raise ConfigError(f"{where}: missing required key{'s' if len(missing) > 1 else ''} "
                          f"{', '.join(missing)}")
    try:
        return cls(**kwargs)
    except ConfigValueError as exc:
        raise ConfigError(f"{origins.get(exc.key, f'{where}.{exc.key}')}: {exc.reason}") from None


# --- stage files and environment overrides -----------------------------------------


def env_prefix(stage: str) -> str:
    return f"VOXRING_{stage.upper()}__"


def _read_file(path: str | os.PathLike[str] | None) -> tuple[str, Mapping[str, Any]]:
    if path is None:
        return "<defaults>", {}
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read config: {exc.strerror}") from None
    data = parse_yaml_text(text, source)
    if data is None:
        return source, {}
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{source}: expected a mapping of sections at top level, got {_describe(data)}")
    return source, data


def _env_overrides(
    stage: str, environ: Mapping[str, str], sections: Mapping[str, type]
) -> dict[str, dict[str, tuple[str, Any]]]:
    """{section: {key: (variable name, parsed value)}} for this stage's variables."""
    prefix = env_prefix(stage)
    overrides: dict[str, dict[str, tuple[str, Any]]] = {}
    for var in sorted(environ):
        if not var.startswith(prefix):
            continue
        parts = var[len(prefix):].split("__")
        if len(parts) != 2 or not all(parts):
            raise ConfigError(f"environment {var}: expected {prefix}<SECTION>__<KEY>")
        section, key = (p.lower() for p in parts)
        if section not in sections:
            raise ConfigError(f"environment {var}: unknown section {section} "
                              f"(known: {', '.join(sorted(sections))})")
        keys = {f.name for f in dataclasses.fields(sections[section])}
        if key not in keys:
            raise ConfigError(f"environment {var}: unknown key {section}.{key} "
                              f"(known: {', '.join(sorted(keys))})")
        value = parse_yaml_text(environ[var], f"environment {var}")
        overrides.setdefault(section, {})[key] = (var, value)
    return overrides


def load_config(
    cls: type[T],
    path: str | os.PathLike[str] | None,
    stage: str,
    environ: Mapping[str, str] | None = None,
) -> T:
    """Loads stage config ``cls`` from YAML file ``path`` (None: defaults only) and the
    ``VOXRING_<STAGE>__<SECTION>__<KEY>`` overrides in ``environ`` (default os.environ).
    """
    environ = os.environ if environ is None else environ
    source, data = _read_file(path)
    hints = typing.get_type_hints(cls)
    sections = {f.name: hints[f.name] for f in dataclasses.fields(cls)}
    unknown = sorted(str(k) for k in data if k not in sections)
    if unknown:
        raise ConfigError(f"{source}: unknown section{'s' if len(unknown) > 1 else ''} "
                          f"{', '.join(unknown)} (known: {', '.join(sorted(sections))})")
    overrides = _env_overrides(stage, environ, sections)
    built = {}
    for name, section_cls in sections.items():
        raw = data.get(name)
        if raw is not None and not isinstance(raw, Mapping):
            raise ConfigError(f"{source}: {name}: expected a mapping, got {_describe(raw)}")
        section_data = dict(raw or {})
        origins = {}
        for key, (var, value) in overrides.get(name, {}).items():
            section_data[key] = value  # the environment wins; null restores the default
            origins[key] = f"environment {var}"
        try:
            built[name] = parse_section(section_cls, section_data, name, origins)
        except ConfigError as exc:
            message = str(exc)
            raise ConfigError(
                message if message.startswith("environment ") else f"{source}: {message}"
            ) from None
    return cls(**built)
