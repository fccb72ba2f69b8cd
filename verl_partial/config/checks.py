"""The one validation style of every config block of ours (``partial``, ``rollout_correction``, ``balance``).

A block is a frozen dataclass whose fields carry their allowed values in the type: ``bool``, ``int``, ``float``,
``str``, ``None`` and ``Literal[...]`` choices. ``check_types`` holds every field to its type in ``__post_init__``
(so a YAML ``"false"`` for a bool or ``1.5`` for an int fails, whoever builds the config: Hydra, a test, the
simulator), then the block states its ranges and cross-field rules with ``require``. Both raise the same
``ValueError``: ``<block>.<key> must be <allowed>, got <value>``, in the driver, before Ray starts.

Standard library only: the core layer imports no verl, Ray, torch or OmegaConf.
"""

from __future__ import annotations

import dataclasses
import types
import typing
import warnings
from collections.abc import Mapping
from typing import Any, Literal

__all__ = ["check_types", "choices", "rename_deprecated", "require", "type_text"]

_SCALAR_TEXT = {bool: "a bool (true or false)", int: "an integer", float: "a number", str: "a string"}


def require(ok: bool, key: str, allowed: str, value: object) -> None:
    """Raise ``ValueError("<key> must be <allowed>, got <value>")`` unless ``ok``."""
    if not ok:
        raise ValueError(f"{key} must be {allowed}, got {value!r}")


def choices(hint: Any) -> tuple[Any, ...]:
    """The values a ``Literal[...]`` type hint allows (``()`` for any other hint)."""
    return typing.get_args(hint) if typing.get_origin(hint) is Literal else ()


def _options(hint: Any) -> tuple[Any, ...]:
    """A union's members (``int | None`` -> ``(int, NoneType)``), or the hint alone."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return typing.get_args(hint)
    return (hint,)


def type_text(hint: Any) -> str:
    """The allowed values of a field in the words the error messages and docs/configuration.md use."""
    options = _options(hint)
    parts = ["null"] if type(None) in options else []
    for option in options:
        if option is type(None):
            continue
        if choices(option):
            parts.append(f"one of {list(choices(option))}")
        else:
            parts.append(_SCALAR_TEXT[option])
    return " or ".join(parts)


def _fits(value: Any, option: Any) -> bool:
    if option is type(None):
        return value is None
    if choices(option):
        return isinstance(value, str | int) and not isinstance(value, bool) and value in choices(option)
    if option is bool:
        return isinstance(value, bool)
    if option is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if option is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, option)


def check_types(config: Any, block: str) -> None:
    """Every field of the dataclass instance ``config`` holds a value of its declared type, or ValueError naming
    ``<block>.<field>`` and the allowed values."""
    hints = typing.get_type_hints(type(config))
    for field in dataclasses.fields(config):
        hint = hints[field.name]
        value = getattr(config, field.name)
        require(any(_fits(value, option) for option in _options(hint)), f"{block}.{field.name}", type_text(hint), value)


def rename_deprecated(values: Mapping[str, Any], block: str, renamed: Mapping[str, str]) -> dict[str, Any]:
    """``values`` with each deprecated key of ``renamed`` (old -> new) moved to its new name.

    An old key set to a value warns (FutureWarning: shown to users by default, unlike DeprecationWarning) naming
    both keys; an old key left null is dropped silently, so our YAMLs can keep it for command lines that override
    it without ``+``. Old and new keys set to different values are an error.
    """
    result = dict(values)
    for old, new in renamed.items():
        if old not in result:
            continue
        value = result.pop(old)
        if value is None:
            continue
        warnings.warn(
            f"{block}.{old} is deprecated and will be removed: use {block}.{new} (same meaning)",
            FutureWarning,
            stacklevel=3,
        )
        require(
            result.get(new) in (None, value),
            f"{block}.{old}",
            f"unset or equal to {block}.{new}={result.get(new)!r} ({old} is the deprecated name of {new})",
            value,
        )
        result[new] = value
    return result
