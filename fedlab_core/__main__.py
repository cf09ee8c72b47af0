"""Command line: ``python -m fedlab_core run ...`` and ``python -m fedlab_core partition ...``.

Every :class:`~fedlab_core.runs.RunConfig` field is an option of ``run`` (``--num-clients`` for
``num_clients``; ``--rounds`` also for ``num_rounds``; ``--algorithm-param``, ``--augment-param`` and
``--dataset-param KEY=VALUE``, repeatable, for the parameter mappings), with the field's own comment as
its help and its default. With ``--json``, stdout carries exactly one JSON object and nothing else; logs
and progress go to stderr.

Errors are one line on stderr, never a traceback (``--debug`` adds it): exit status 2 for an invalid
input (nothing is loaded or written), 1 for a run that fails (missing or damaged data, a diverging run,
every client failing), 130 when interrupted (the last checkpoint, if one was written, is kept: the same command
resumes from it).
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import logging
import re
import sys
import traceback
import typing
from typing import Any, Callable, Mapping

from .params import OneOf
from .runs import FIELD_CONSTRAINTS, PARTITION_OPTIONS, RunConfig
from .store import _finite

ALIASES = {"num_rounds": ["--rounds"], "partition": ["--scheme"]}
MAPPINGS = {"algorithm_params": "--algorithm-param", "augment_params": "--augment-param",
            "dataset_params": "--dataset-param"}
PARTITION_FIELDS = ("dataset", "dataset_params", "max_train_samples", "max_test_samples", "partition", "alpha", "dh",
                    "classes_per_client", "beta", "min_size", "num_clients", "seed")
ROUND_KEYS = ("round", "clients", "failed", "train_loss", "global_accuracy", "mean_client_accuracy", "bytes_up",
              "bytes_down")
# the local-training fields: None there means the method's own setting, its paper's
LOCAL_TRAINING = ("local_epochs", "local_steps", "batch_size", "optimizer", "lr", "momentum", "weight_decay",
                  "train_transform")
META_KEYS = ("key", "code_version", "torch", "device", "workers", "dh", "samples", "failed_clients",
             "resumed_from_round", "stopped_at_plateau", "seconds")


class Interrupted(Exception):
    """A run stopped by Ctrl-C, with what is left of it (whether a checkpoint was kept)."""


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (status 2), like every other error of this command."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def field_comments() -> dict[str, str]:
    """Each RunConfig field's trailing comment in the source: its one-line documentation."""
    found = re.findall(r"^\s+(\w+): [^#\n]+#\s*(.+)$", inspect.getsource(RunConfig), flags=re.M)
    return dict(found)


def _params(pairs: list[str]) -> dict:
    """KEY=VALUE pairs, values parsed as JSON when they parse (numbers, booleans, lists), else strings."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"expected KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def _add_fields(p: argparse.ArgumentParser, names: tuple[str, ...]) -> None:
    """One option per RunConfig field, typed by its annotation; defaults stay RunConfig's own."""
    hints, comments = typing.get_type_hints(RunConfig), field_comments()
    for f in dataclasses.fields(RunConfig):
        if f.name not in names:
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        shown = ("the method's own, its paper's setting" if default is None and f.name in LOCAL_TRAINING else
                 "unset" if default is None else repr(default))
        help_text = f"{comments.get(f.name, '')} (default: {shown})"
        if isinstance(FIELD_CONSTRAINTS.get(f.name), OneOf):
            help_text += "; one of: " + ", ".join(FIELD_CONSTRAINTS[f.name].values)
        if f.name in MAPPINGS:
            p.add_argument(MAPPINGS[f.name], dest=f.name, action="append", metavar="KEY=VALUE",
                           default=argparse.SUPPRESS, help=f"{help_text}; repeatable, values parsed as JSON")
            continue
        if hints[f.name] is bool:
            p.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, action=argparse.BooleanOptionalAction,
                           default=argparse.SUPPRESS, help=help_text)
            continue
        kinds = [a for a in typing.get_args(hints[f.name]) if a is not type(None)] or [hints[f.name]]
        p.add_argument(f"--{f.name.replace('_', '-')}", *ALIASES.get(f.name, []), dest=f.name, type=kinds[0],
                       default=argparse.SUPPRESS, help=help_text)


def parser() -> argparse.ArgumentParser:
    top = Parser(prog="python -m fedlab_core", description=__doc__.splitlines()[0])
    sub = top.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run one federated experiment (or print its cached result)")
    _add_fields(r, tuple(f.name for f in dataclasses.fields(RunConfig)))
    r.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda or cuda:N")
    r.add_argument("--no-cache", action="store_true", help="neither read nor write the result cache")
    r.add_argument("--checkpoint-every", type=int, default=1,
                   help="write a checkpoint every this many rounds, 0: never (default: 1)")
    r.add_argument("--workers", type=int, default=None,
                   help="processes training clients side by side, one thread each (default: every core on a "
                        "CPU, 1 on a GPU); the numbers do not depend on it")
    p = sub.add_parser("partition", help="show how a scheme splits a dataset")
    _add_fields(p, PARTITION_FIELDS)
    for q in (r, p):
        q.add_argument("--json", action="store_true", help="print one JSON object on stdout")
        q.add_argument("--debug", action="store_true", help="show the traceback of an error")
    return top


def _config(a: argparse.Namespace) -> RunConfig:
    given = {name: value for name, value in vars(a).items() if name in RunConfig.__dataclass_fields__}
    for name in MAPPINGS:
        if name in given:
            try:
                given[name] = _params(given[name])
            except ValueError as err:
                raise ValueError(f"{name}: {err}") from None
    partition = given.get("partition", RunConfig.partition)
    for name in given.keys() & PARTITION_OPTIONS.keys():
        # a value the library would reset to its default: refuse it rather than ignore it
        if partition not in PARTITION_OPTIONS[name] and given[name] != RunConfig.__dataclass_fields__[name].default:
            users = PARTITION_OPTIONS[name]
            raise ValueError(f"{name}: partition {partition!r} does not use it (only {' and '.join(map(repr, users))} "
                             f"{'does' if len(users) == 1 else 'do'}); leave it out")
    return RunConfig(**given)


def _flag(name: str, argv: list[str]) -> str:
    """The option the user typed for field `name` (an alias such as --rounds if that one), else its own."""
    options = [f"--{name.replace('_', '-')}", *ALIASES.get(name, [])]
    if name in MAPPINGS:
        options = [MAPPINGS[name]]
    typed = [o for o in options if any(a == o or a.startswith(o + "=") for a in argv)]
    return (typed or options)[0]


def cli_message(text: str, argv: list[str]) -> str:
    """A library error as a command-line user reads it: fields named by the flags typed (the leading one,
    and, unquoted, any other that is no English word: one with an underscore, or dh), and "None", which no
    flag can give, said as leaving the option out."""
    name, sep, rest = text.partition(":")
    if sep and name in RunConfig.__dataclass_fields__:
        text = f"{_flag(name, argv)}:{rest}"
    text = re.sub(r"(?<![-\w'])([a-z]+_[a-z_]+|dh)\b(?!')",
                  lambda m: _flag(m[1], argv) if m[1] in RunConfig.__dataclass_fields__ else m[1], text)
    return text.replace(" or None (null)", " (or leave the option out)")


def prepare_run(a: argparse.Namespace) -> Callable[[], dict]:
    """Everything that can be checked before any work (the config, the device); the run itself, to call."""
    from .runs import resolve_device, resolve_workers, run
    from .store import cache_key, default_cache_dir

    config, device = _config(a), resolve_device(a.device)
    workers = resolve_workers(a.workers, device)
    if a.checkpoint_every < 0:
        raise ValueError(f"checkpoint_every: must be an integer >= 0; got {a.checkpoint_every}")

    def work() -> dict:
        try:
            history = run(config, use_cache=not a.no_cache, device=device, checkpoint_every=a.checkpoint_every,
                          progress=None if not a.json else False, workers=workers)
        except KeyboardInterrupt:
            kept = not a.no_cache and (default_cache_dir() / f"{cache_key(config, device)}.ckpt").exists()
            raise Interrupted("interrupted; the last checkpoint is kept, and the same command resumes from it" if kept
                              else "interrupted before any checkpoint was written; the same command starts again "
                                   "from round 1") from None
        return {"config": history.config,
                "final": {k: history.final[k] for k in ("global_accuracy", "mean_client_accuracy")},
                "rounds": [{k: r[k] for k in ROUND_KEYS} for r in history.rounds],
                "meta": {k: history.meta.get(k) for k in META_KEYS}}
    return work


def prepare_partition(a: argparse.Namespace) -> Callable[[], dict]:
    from .data import federate, load_dataset

    config = _config(a)  # validation goes through RunConfig: the CLI and the library reject the same inputs

    def work() -> dict:
        data = load_dataset(config.dataset, max_train=config.max_train_samples, max_test=config.max_test_samples,
                            seed=config.seed, **config.dataset_params)
        fed = federate(data, config.partition, config.num_clients, config.seed, **config.partition_options())
        return {"class_counts": fed.class_counts.tolist(), "dh": fed.dh}
    return work


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    try:
        work = prepare_run(args) if args.command == "run" else prepare_partition(args)
    except (ValueError, FileNotFoundError) as err:  # invalid input or a missing model file: nothing was loaded or written
        return _fail(type(err)(cli_message(str(err), argv)), 2, args.debug)
    try:
        out = work()
    except (KeyboardInterrupt, Interrupted) as err:
        print(f"error: {err if isinstance(err, Interrupted) else 'interrupted'}", file=sys.stderr)
        return 130
    except Exception as err:
        return _fail(err, 1, args.debug)
    print(json.dumps(_finite(out)) if args.json else _human(args.command, out))
    return 0


def _fail(err: Exception, status: int, debug: bool) -> int:
    """Print the error on one line (the traceback first with --debug); return the exit status."""
    from .algorithms import ClientsFailedError

    if debug:
        traceback.print_exc()
    text = " ".join(str(err).split()) or type(err).__name__
    if not isinstance(err, (ValueError, OSError, FloatingPointError, ClientsFailedError)):
        text = f"unexpected {type(err).__name__}: {text} (run again with --debug for the traceback)"
    print(f"error: {text}", file=sys.stderr)
    return status


def _human(command: str, out: Mapping[str, Any]) -> str:
    """A short readable summary for people at a terminal."""
    if command == "partition":
        rows = [f"client {i:>3}: " + " ".join(f"{v:>5}" for v in row) for i, row in enumerate(out["class_counts"])]
        return "samples per class\n" + "\n".join(rows) + f"\nDH = {out['dh']:.3f}"
    lines = [f"{'round':>5} {'global acc':>10} {'client acc':>10} {'failed':>6} {'MB up':>8} {'MB down':>8}"]
    show = lambda v: "-" if v is None else f"{v:.4f}"  # None: not evaluated, or no global model
    for r in out["rounds"]:
        lines.append(f"{r['round']:>5} {show(r.get('global_accuracy')):>10} {show(r.get('mean_client_accuracy')):>10} "
                     f"{r['failed']:>6} {r['bytes_up'] / 1e6:>8.2f} {r['bytes_down'] / 1e6:>8.2f}")
    final, samples = out["final"], out["meta"]["samples"]
    if final["mean_client_accuracy"] is None:  # a run recorded as diverged
        lines.append("final accuracy: none (the run diverged)")
    else:
        glob = ("no global model" if final["global_accuracy"] is None
                else f"final global accuracy {final['global_accuracy']:.4f}")
        lines.append(f"{glob}, mean client accuracy {final['mean_client_accuracy']:.4f}")
    held_out = "validation" if out["config"]["validation"] else "test"  # a validation run scores held-out training data
    lines.append(f"{samples['train']} training and {samples['test']} {held_out} samples; cache key {out['meta']['key']}")
    if out["meta"]["resumed_from_round"]:
        lines.append(f"resumed from the checkpoint after round {out['meta']['resumed_from_round']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
