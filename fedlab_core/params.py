"""Declared settings: one type-and-range check for every value a run can name.

A setting's type is its annotation (a constructor's or a dataclass field's); what a type alone cannot
say, a range or a set of allowed values, is declared once beside it as a :class:`Range`,
:class:`OneOf` or :class:`Subset`. :func:`check` holds a mapping of values against both and raises one
``ValueError`` that names the field, the setting and what is allowed; it returns the values normalised
(an integer given for a float setting becomes a float), so equal settings hash equally.

:class:`Configurable` is the base of algorithms and augmentations: constructing one checks its
arguments against its own declaration (``constraints`` plus the constructor's annotations), so the
same rule holds whether a method is named in a :class:`~fedlab_core.runs.RunConfig` or built by hand.
"""
from __future__ import annotations

import functools
import inspect
import math
import numbers
import os
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar

import numpy as np


@dataclass(frozen=True)
class Range:
    """A number between `low` and `high` (either may be None: unbounded); `*_open` excludes the bound. A list
    of numbers is in the range when every number is.

    NaN never lies in a range; infinities lie only in ranges unbounded on their side.
    """

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def __call__(self, value: Any) -> bool:
        if isinstance(value, (list, tuple)):  # a list of numbers: every one in the range
            return all(self(v) for v in value)
        if isinstance(value, float) and math.isnan(value):
            return False
        if self.low is not None and not (value > self.low if self.low_open else value >= self.low):
            return False
        if self.high is not None and not (value < self.high if self.high_open else value <= self.high):
            return False
        return True

    def describe(self) -> str:
        if self.high == math.inf and self.high_open:  # an open infinite bound: "finite"
            return Range(self.low, None, self.low_open).describe() + " and finite"
        if self.low is not None and self.high is not None:
            return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        if self.high is not None:
            return f"{'<' if self.high_open else '<='} {self.high:g}"
        return "any value"


@dataclass(frozen=True)
class OneOf:
    """One of the listed values."""

    values: tuple

    def __init__(self, *values: Any):
        object.__setattr__(self, "values", tuple(values))

    def __call__(self, value: Any) -> bool:
        return any(value == v and type(value) is type(v) for v in self.values)

    def describe(self) -> str:
        return "one of " + ", ".join(repr(v) for v in self.values)


class Subset(OneOf):
    """A non-empty list whose items are all among the listed values."""

    def __call__(self, value: Any) -> bool:
        return len(value) > 0 and all(v in self.values for v in value)

    def describe(self) -> str:
        return "a non-empty list of " + ", ".join(repr(v) for v in self.values)


Constraint = Range | OneOf | Subset

_MISSING = object()


def _describe(hint: Any) -> str:
    """A type annotation in words, as an error message gives it."""
    if hint is Any or hint is inspect.Parameter.empty:
        return "any value"
    args = typing.get_args(hint)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if hint is type(None):
        return "None (null)"
    if hint is bool:
        return "true or false"
    if hint is int:
        return "an integer"
    if hint is float:
        return "a number"
    if hint is str:
        return "a string"
    if hint is Path or hint is os.PathLike:
        return "a path"
    if origin in (tuple, Sequence, list) or hint in (tuple, list):
        if len(args) == 2 and args[1] is Ellipsis or origin in (Sequence, list):
            return f"a list of {_plural(args[0]) if args else 'values'}"
        return f"a list of {len(args)} " + " and ".join(_plural(a) for a in dict.fromkeys(args))
    if origin in (dict, Mapping) or hint in (dict, Mapping):
        return "a mapping of names to values"
    return f"a {getattr(hint, '__name__', hint)}"


def _plural(hint: Any) -> str:
    return {int: "integers", float: "numbers", str: "strings", bool: "booleans"}.get(hint, _describe(hint))


def conform(value: Any, hint: Any) -> Any:
    """`value` normalised to the annotation `hint`, or ``_MISSING`` if it does not conform.

    Integers are accepted for floats (and become floats); numpy scalars become Python numbers; lists
    and tuples are accepted for sequence types; booleans are never numbers.
    """
    if hint is Any or hint is inspect.Parameter.empty:
        return value
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        for a in args:  # the first member the value conforms to
            out = conform(value, a)
            if out is not _MISSING:
                return out
        return _MISSING
    if hint is type(None):
        return None if value is None else _MISSING
    if hint is bool:
        return bool(value) if isinstance(value, (bool, np.bool_)) else _MISSING
    if hint is int:
        return int(value) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else _MISSING
    if hint is float:
        return float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else _MISSING
    if hint is str:
        return value if isinstance(value, str) else _MISSING
    if hint is Path or hint is os.PathLike:  # kept as text, so a config stays plain JSON
        return os.fspath(value) if isinstance(value, (str, os.PathLike)) else _MISSING
    if origin in (tuple, Sequence, list) or hint in (tuple, list):
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            return _MISSING
        if not args:
            return value
        item_hints = [args[0]] * len(value) if (len(args) == 2 and args[1] is Ellipsis) or origin is not tuple \
            else list(args)
        if len(item_hints) != len(value):
            return _MISSING
        items = [conform(v, h) for v, h in zip(value, item_hints)]
        if any(i is _MISSING for i in items):
            return _MISSING
        return type(value)(items)
    if origin in (dict, Mapping) or hint in (dict, Mapping):
        return value if isinstance(value, Mapping) else _MISSING
    if isinstance(hint, type):
        return value if isinstance(value, hint) else _MISSING
    return value


@functools.lru_cache(maxsize=None)
def _declared(fn: Callable) -> tuple[tuple[str, ...], dict[str, Any]]:
    """(parameter names, their resolved annotations) of a callable; `self`, `*args` and `**kwargs` left out."""
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    names = tuple(n for n, p in inspect.signature(fn).parameters.items() if n != "self" and p.kind not in variadic)
    return names, typing.get_type_hints(fn)


def check(owner: str, fn: Callable, params: Mapping[str, Any], constraints: Mapping[str, Constraint] = {},
          field: str | None = None, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """Check `params` against `fn`'s parameters (names, annotated types) and `constraints`.

    Parameters
    ----------
    owner : how the message names what takes the parameters (e.g. ``"'fedprox'"``).
    fn : the constructor or loader the parameters go to.
    params : name -> value.
    constraints : name -> :class:`Range` / :class:`OneOf` / :class:`Subset`, checked after the type.
    field : the field the message starts with (e.g. ``"algorithm_params"``); None: `owner` alone.
    skip : parameter names that are not settings (e.g. ``"training"``).

    Returns
    -------
    dict : the values normalised (see :func:`conform`).

    Raises
    ------
    ValueError : ``"<field>: <owner> has no parameter 'x'; it accepts: ..."`` (``"... takes no parameters; got 'x'"``
        where it takes none) or
        ``"<field>: <owner> parameter 'x' must be <what is allowed>; got <value>"``.
    """
    names, hints = _declared(fn)
    accepted = [n for n in names if n not in skip]
    prefix = f"{field}: {owner}" if field else owner
    if not isinstance(params, Mapping):
        raise ValueError(f"{field or owner}: must be a mapping of parameter names to values; got {params!r}")
    unknown = sorted(set(params) - set(accepted), key=str)
    if unknown:
        raise ValueError(f"{prefix} has no parameter {unknown[0]!r}; it accepts: {', '.join(accepted)}" if accepted
                         else f"{prefix} takes no parameters; got {unknown[0]!r}")
    return {name: check_value(f"{prefix} parameter {name!r}", value, hints.get(name, Any), constraints.get(name))
            for name, value in params.items()}


def check_value(label: str, value: Any, hint: Any, rule: Constraint | None = None) -> Any:
    """`value` normalised to the annotation `hint` and checked against `rule` (None values skip the rule);
    else ValueError ``"<label> must be <what is allowed>; got <value>"``."""
    normalised = conform(value, hint)
    if normalised is _MISSING or (rule is not None and normalised is not None and not rule(normalised)):
        what = _describe(hint) if rule is None else _with_rule(hint, rule)
        raise ValueError(f"{label} must be {what}; got {value!r}")
    return normalised


def _with_rule(hint: Any, rule: Constraint) -> str:
    if isinstance(rule, Range):
        base = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
        text = f"{_describe(base[0])} {rule.describe()}"
        return text + (" or None (null)" if type(None) in typing.get_args(hint) else "")
    return rule.describe() + (" or None (null)" if type(None) in typing.get_args(hint) else "")


class Configurable:
    """A class whose constructor arguments are checked against their declaration when it is built.

    Class attributes
    ----------------
    name : the registry name messages use.
    constraints : parameter name -> :class:`Range` / :class:`OneOf` / :class:`Subset`; types come from
        the constructor's annotations.
    """

    name: ClassVar[str] = ""
    constraints: ClassVar[dict[str, Constraint]] = {}
    not_settings: ClassVar[tuple[str, ...]] = ("training",)

    def __new__(cls, *args: Any, **kwargs: Any):
        self = super().__new__(cls)
        try:
            bound = inspect.signature(cls.__init__).bind(self, *args, **kwargs)
        except TypeError:
            return self  # __init__ raises Python's own message for a wrong call
        given = {k: v for k, v in bound.arguments.items() if k != "self" and k not in cls.not_settings}
        cls.check_params(given, field=None)
        return self

    @classmethod
    def check_params(cls, params: Mapping[str, Any], field: str | None) -> dict[str, Any]:
        """The parameters checked and normalised (see :func:`check`); ValueError naming `field` if not."""
        return check(repr(cls.name), cls.__init__, params, cls.constraints, field, skip=cls.not_settings)

    def check_model(self, model: Any) -> None:
        """Raise ValueError if this method cannot do what it is for on `model` (default: any model will do)."""
