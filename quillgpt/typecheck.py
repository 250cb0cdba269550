"""Typed fields of plain data: the one check of a value against a type annotation, for everything read from outside
(a TOML file or the command line, a checkpoint's dict, a tokenizer's dict, a Hugging Face config.json).

    coerce(value, float | None)                 # the value as that type, or TypeError
    wrong_fields(ckpt, TrainState)              # the dataclass fields a dict lacks or holds with another type
    required(hf, "n_embd", int, "config.json has no integer n_embd")   # d[key] as that type, or that UserError

Annotations: bool, int, float, str, list, dict, list[X], and unions with None (X | None). As in TOML and JSON,
a bool is not an int; an int is a float (and becomes one).
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from typing import Any

from quillgpt.errors import UserError

# dataclass field metadata: the field may be missing from a dict (written only sometimes, or added later)
OPTIONAL = {"optional": True}
MISSING = object()


def unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """(X, True) for X | None, (tp, False) otherwise."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], len(args) < len(typing.get_args(tp))
    return tp, False


def type_name(tp: Any) -> str:
    """How messages and the config reference name a type: int, list[int], float or none."""
    base, optional = unwrap_optional(tp)
    name = getattr(base, "__name__", str(base))
    if typing.get_origin(base) is list:
        name = f"list[{typing.get_args(base)[0].__name__}]"
    return f"{name} or none" if optional else name


def coerce(value: Any, tp: Any) -> Any:
    """value checked against the annotation tp and returned as that type (an int where a float is expected becomes
    that float); TypeError when it is not of that type."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        for option in typing.get_args(tp):
            try:
                return coerce(value, option)
            except TypeError:
                pass
        raise TypeError
    if tp is type(None):
        if value is None:
            return None
        raise TypeError
    if tp is float:
        # an int beyond the float range (TOML and the command line allow any size) would raise OverflowError
        if isinstance(value, float) or (
            isinstance(value, int) and not isinstance(value, bool) and abs(value) <= sys.float_info.max
        ):
            return float(value)
        raise TypeError
    if typing.get_origin(tp) is list:
        if isinstance(value, list):
            return [coerce(v, typing.get_args(tp)[0]) for v in value]
        raise TypeError
    if isinstance(value, tp) and (tp is bool or not isinstance(value, bool)):
        return value
    raise TypeError


def is_a(value: Any, tp: Any) -> bool:
    try:
        coerce(value, tp)
    except TypeError:
        return False
    return True


def wrong_fields(d: dict, cls: type, exclude: tuple[str, ...] = ()) -> list[str]:
    """The fields of dataclass cls (but those in exclude) that d lacks (unless their metadata is OPTIONAL) or holds
    with another type than annotated."""
    hints = typing.get_type_hints(cls)
    wrong = []
    for f in dataclasses.fields(cls):
        if f.name in exclude:
            continue
        if f.name not in d:
            wrong += [] if f.metadata.get("optional") else [f.name]
        elif not is_a(d[f.name], hints[f.name]):
            wrong.append(f.name)
    return wrong


def required(d: dict, key: str, tp: Any, message: str, default: Any = MISSING) -> Any:
    """d[key] as type tp (default when d lacks it and a default is given); else UserError(message)."""
    if key not in d and default is not MISSING:
        return default
    try:
        return coerce(d[key], tp)
    except (KeyError, TypeError):
        raise UserError(message) from None
