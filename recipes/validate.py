"""Build frozen config dataclasses from plain YAML data, with errors that name file and key path."""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, Union

from lowbit.calibrate.messages import short_repr, shown_name

INT_BOUND = 2**63  # an int option outside int64 is a typo, and would overflow torch or numpy later


class RecipeError(ValueError):
    """A recipe that cannot run: says which file, which key, and what would be valid."""

    def __init__(self, source: str, key: str, message: str):
        self.source, self.key = source, key
        where = f"{shown_name(source)}: {shown_name(key)}" if key else shown_name(source)
        super().__init__(f"{where}: {message}")



def build(cls, data: Any, source: str, key: str = ""):
    """An instance of dataclass `cls` from a mapping, checking every key and type."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(source, key, f"expected a mapping of {cls.__name__} options, got {_kind(data)} "
                          f"{short_repr(data)}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_")}
    unknown = sorted(set(map(str, data)) - set(fields))
    if unknown:
        raise RecipeError(source, _join(key, unknown[0]),
                          f"unknown key;{_grid_hint(cls, unknown)} valid keys here: {sorted(fields)}")
    hints = typing.get_type_hints(cls)
    values = {name: convert(hints[name], value, source, _join(key, name)) for name, value in data.items()}
    try:
        return cls(**values)
    except (ValueError, TypeError) as err:
        raise RecipeError(source, key or "(top level)", str(err)) from None


def _grid_hint(cls, unknown: list[str]) -> str:
    """Recipes written before the weight grid became one `scheme:` object put its keys on the step."""
    grid = typing.get_type_hints(cls).get("scheme")
    grids = [g for g in (typing.get_args(grid) or (grid,)) if dataclasses.is_dataclass(g)]  # one or a Union
    names = {f.name for g in grids for f in dataclasses.fields(g)}
    moved = [k for k in unknown if k in names]
    return f" the weight grid's options ({', '.join(moved)}) go under scheme: (in the step, or once at the recipe's top level);" if moved else ""


def convert(hint, value, source: str, key: str):
    """Check `value` against a type hint; returns it converted (lists to tuples, dicts to dataclasses)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return build(hint, value, source, key)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) > 1 and all(dataclasses.is_dataclass(a) for a in inner):
            return build(_dataclass_for(inner, value, source, key), value, source, key)
        return convert(inner[0] if len(inner) == 1 else Union[tuple(inner)], value, source, key)
    if origin is Literal:
        if value not in args:
            raise RecipeError(source, key, f"{short_repr(value)} is not valid; choose one of {list(args)}")
        return value
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise RecipeError(source, key, f"expected a list, got {_kind(value)}")
        item = args[0] if args else Any
        return tuple(convert(item, v, source, f"{key}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise RecipeError(source, key, f"expected a mapping, got {_kind(value)}")
        return dict(value)
    return _scalar(hint, value, source, key)


def _dataclass_for(choices: list, value, source: str, key: str):
    """The first of several option classes whose keys include all of `value`'s (an IntScheme's
    bits/group_size or a GGUFTypes' gguf: the keys say which grid is meant)."""
    given = set(map(str, value)) if isinstance(value, dict) else set()
    for cls in choices:
        if given <= {f.name for f in dataclasses.fields(cls)}:
            return cls
    keys = "; ".join(f"{c.__name__}: {sorted(f.name for f in dataclasses.fields(c))}" for c in choices)
    raise RecipeError(source, key, f"keys {short_repr(sorted(given))} fit none of the choices here ({keys})")


def _scalar(hint, value, source, key):
    if hint is Any:
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        if abs(value) > 1e308:  # float() would raise OverflowError
            raise RecipeError(source, key, f"{short_repr(value)} is too large for a number")
        return float(value)
    if hint in (int, float) and isinstance(value, bool):
        raise RecipeError(source, key, f"expected {hint.__name__}, got a boolean {value!r}")
    if not isinstance(value, hint):
        raise RecipeError(source, key, f"expected {hint.__name__}, got {_kind(value)} {short_repr(value)}")
    if hint is int and not -INT_BOUND <= value < INT_BOUND:
        raise RecipeError(source, key, f"{short_repr(value)} is out of range (at most 2**63 - 1 in size)")
    return value


def _kind(value) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean",
            int: "an integer", float: "a number", type(None): "nothing (null)"}.get(type(value), type(value).__name__)


def _join(key: str, name) -> str:
    name = str(name) or "''"  # an empty key, named
    return f"{key}.{name}" if key else name


def to_plain(obj):
    """Dataclasses, tuples and dicts as plain YAML/JSON-ready data."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if not f.name.startswith("_")}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    return obj
