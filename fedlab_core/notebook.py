"""What a chapter's notebook checks before any work: the parameters papermill was given.

A notebook's parameters cell declares its parameters with their defaults; :func:`check_notebook_parameters`, called
in a hidden cell right after it, refuses a name the cell does not declare, a value of another kind than its
default's, and a value outside the range of the :class:`~fedlab_core.runs.RunConfig` field the parameter sets
(``DIRICHLET_ALPHA`` is ``alpha``, ``TUNE_SEEDS`` are seeds, ``PAPER_ROUNDS`` a number of rounds: the field
of the same name, or named by the parameter's last words, :data:`LAST_WORDS`). Each refusal is one line, shown
without a traceback, so a misspelt or impossible parameter stops the notebook before its first run.
"""
from __future__ import annotations

import ast
import difflib
import numbers
import typing
from typing import Any, Sequence

from .params import check_value
from .runs import FIELD_CONSTRAINTS, RunConfig

# a parameter's last words -> the RunConfig field whose rule its values follow (besides a field's own name)
LAST_WORDS = {"seeds": "seed", "alphas": "alpha", "rounds": "num_rounds", "clients": "num_clients",
              "train_samples": "max_train_samples", "test_samples": "max_test_samples", "epochs": "local_epochs",
              "validation": "validation_monitor", "alpha": "alpha", "beta": "beta", "dh": "dh", "lr": "lr"}
OWN_MEANING = ("VERIFY_ROUNDS",)   # named like a field, meaning something else (the report's rounds re-run, 0: none)


def _assignments(source: str) -> dict[str, Any]:
    """``NAME = literal`` assignments of a cell (a value that is not a literal: the name with ``...``)."""
    out: dict[str, Any] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    try:
                        out[target.id] = ast.literal_eval(node.value)
                    except ValueError:
                        out[target.id] = ...
    return out


def _kind(value: Any) -> str:
    """What a parameter's default says it takes, in words: "an integer", "a list of numbers", ..."""
    if isinstance(value, bool):
        return "true or false"
    if isinstance(value, numbers.Integral):
        return "an integer"
    if isinstance(value, numbers.Real):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        inner = {_kind(v) for v in value}
        return "a list" + (f" of {inner.pop().split(' ', 1)[1]}s" if len(inner) == 1 else "")
    return f"a {type(value).__name__}"


def _fits(value: Any, default: Any) -> bool:
    if default is ... or default is None or value is None:
        return True
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(default, bool)
    if isinstance(default, numbers.Integral):
        return isinstance(value, numbers.Integral)
    if isinstance(default, numbers.Real):
        return isinstance(value, numbers.Real)
    if isinstance(default, (list, tuple)):
        return isinstance(value, (list, tuple)) and (not default or all(_fits(v, default[0]) for v in value))
    return isinstance(value, type(default))


def field_of(name: str) -> str | None:
    """The RunConfig field whose rule a notebook parameter's values follow, or None (see the module)."""
    lower = name.lower()
    if lower in RunConfig.__dataclass_fields__:
        return lower
    return next((field for words, field in sorted(LAST_WORDS.items(), key=lambda kv: -len(kv[0]))
                 if lower.endswith("_" + words) or lower == words), None)


class ParameterError(ValueError):
    """A notebook parameter given through papermill that the notebook does not take, of the wrong kind, or out of
    its range."""

    def _render_traceback_(self) -> list[str]:   # IPython shows this instead of a traceback: the line says it all
        return [f"{type(self).__name__}: {self}"]


def check_notebook_parameters(executed: Sequence[str]) -> None:
    """Refuse, before any work, a parameter that papermill injected into a notebook but that its parameters cell
    does not declare (naming the closest declared one), a value of another kind than the default's (a string
    for a number, a number for a list), or a value its RunConfig field would refuse (every item of a list).
    `executed`: the cell sources the kernel ran so far, in order (IPython's ``In``); the parameters cell is the
    first, papermill's injected cell the one starting ``# Parameters``.

    Raises :class:`ParameterError`, shown in a kernel as its one line, which ends the notebook's (and
    papermill's) report."""
    cells = [c for c in executed if c.strip()]
    if not cells:
        return
    declared = _assignments(cells[0])
    hints = typing.get_type_hints(RunConfig)
    for source in cells[1:]:
        if not source.lstrip().startswith("# Parameters"):
            continue
        for name, value in _assignments(source).items():
            if name not in declared:
                close = difflib.get_close_matches(name, declared, n=1)
                raise ParameterError(f"{name}: not a parameter of this notebook"
                                     + (f"; did you mean {close[0]}?" if close else "")
                                     + f" (its parameters: {', '.join(declared)})")
            if not _fits(value, declared[name]):
                raise ParameterError(f"{name}: expects {_kind(declared[name])}, like its default "
                                     f"{declared[name]!r}; got {value!r}")
            field = None if name in OWN_MEANING else field_of(name)
            if field is None or value is None or isinstance(declared[name], bool) != (hints[field] is bool):
                continue   # a parameter of its own meaning, or a switch named like a field (PAPER_ROUNDS = True)
            for item in value if isinstance(value, (list, tuple)) else [value]:
                try:
                    check_value(f"{name}:", item, hints[field], FIELD_CONSTRAINTS.get(field))
                except ValueError as err:
                    raise ParameterError(f"{err} (the rule of RunConfig's {field})") from None


def check_horizons(name: str, horizons: typing.Mapping[str, Any], planned: typing.Iterable[str], what: str) -> None:
    """Refuse, before any work, a page's longer horizons (`name`: its parameter, a key -> rounds) where a key names
    no `what` of the page (`planned`: those it runs) or its rounds are not a positive integer."""
    planned = sorted(set(planned))
    for key, cap in horizons.items():
        if key not in planned:
            raise ParameterError(f"{name}: {key!r} names no {what} of this page (it runs {', '.join(planned)})")
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
            raise ParameterError(f"{name}: {key!r} maps to {cap!r}, not a number of rounds (a positive integer)")
