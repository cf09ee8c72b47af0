"""Command line: ``python -m fedlab_core run ...`` and ``python -m fedlab_core partition ...``.

With ``--json``, stdout carries exactly one JSON object and nothing else; logs and progress go to
stderr. Invalid arguments exit with status 2 and a one-line message naming the field.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys

from . import RunConfig, run
from .data import DATASETS, federate, load_dataset
from .data import partition as P
from .runs import _finite


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", default="fashion_mnist", help=f"one of: {', '.join(sorted(DATASETS))}")
    p.add_argument("--partition", "--scheme", dest="partition", default="iid",
                   help=f"one of: {', '.join(sorted(P.PARTITIONS))}")
    p.add_argument("--alpha", type=float, default=0.5, help="Dirichlet concentration (dirichlet)")
    p.add_argument("--dh", type=float, default=None, help="target distributional heterogeneity (distrans)")
    p.add_argument("--classes-per-client", type=int, default=None, help="classes per client (distrans, pathological)")
    p.add_argument("--beta", type=float, default=0.5, help="client-size concentration (quantity)")
    p.add_argument("--min-size", type=int, default=10, help="fewest samples per client (dirichlet, quantity)")
    p.add_argument("--num-clients", type=int, default=10)
    p.add_argument("--max-train-samples", type=int, default=0, help="0: all; else a stratified subset")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def _params(pairs: list[str]) -> dict:
    """KEY=VALUE pairs, values parsed as JSON when they parse (numbers, booleans), else strings."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"expected KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m fedlab_core", description=__doc__.splitlines()[0])
    sub = top.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run one federated experiment")
    _common(r)
    r.add_argument("--algorithm", default="fedavg")
    r.add_argument("--algorithm-param", action="append", default=[], metavar="KEY=VALUE",
                   help="an algorithm hyperparameter, e.g. mu=0.01 (repeatable)")
    r.add_argument("--augment", default="none")
    r.add_argument("--augment-param", action="append", default=[], metavar="KEY=VALUE")
    r.add_argument("--model", default="auto")
    r.add_argument("--rounds", type=int, default=20)
    r.add_argument("--local-epochs", type=int, default=1)
    r.add_argument("--local-steps", type=int, default=0)
    r.add_argument("--batch-size", type=int, default=32)
    r.add_argument("--optimizer", default="sgd")
    r.add_argument("--lr", type=float, default=0.05)
    r.add_argument("--momentum", type=float, default=0.0)
    r.add_argument("--weight-decay", type=float, default=0.0)
    r.add_argument("--fraction", type=float, default=1.0)
    r.add_argument("--clients-per-round", type=int, default=0)
    r.add_argument("--eval-every", type=int, default=1)
    r.add_argument("--device", default="auto")
    r.add_argument("--no-cache", action="store_true", help="neither read nor write the result cache")
    p = sub.add_parser("partition", help="show how a scheme splits a dataset")
    _common(p)
    return top


def _config(a: argparse.Namespace) -> RunConfig:
    return RunConfig(
        algorithm=a.algorithm, algorithm_params=_params(a.algorithm_param), augment=a.augment,
        augment_params=_params(a.augment_param), model=a.model, dataset=a.dataset,
        max_train_samples=a.max_train_samples, partition=a.partition, alpha=a.alpha, dh=a.dh,
        classes_per_client=a.classes_per_client, beta=a.beta, min_size=a.min_size, num_clients=a.num_clients,
        num_rounds=a.rounds, fraction=a.fraction, clients_per_round=a.clients_per_round,
        local_epochs=a.local_epochs, local_steps=a.local_steps, batch_size=a.batch_size, optimizer=a.optimizer,
        lr=a.lr, momentum=a.momentum, weight_decay=a.weight_decay, eval_every=a.eval_every, seed=a.seed)


def cmd_run(a: argparse.Namespace) -> dict:
    history = run(_config(a), use_cache=not a.no_cache, device=a.device, progress=None if not a.json else False)
    return {
        "config": history.config,
        "final": {k: history.final[k] for k in ("global_accuracy", "mean_client_accuracy")},
        "rounds": [{k: r[k] for k in ("round", "global_accuracy", "bytes_up", "bytes_down")} for r in history.rounds],
    }


def cmd_partition(a: argparse.Namespace) -> dict:
    # Validation goes through RunConfig so the CLI and the library reject the same inputs.
    config = RunConfig(dataset=a.dataset, partition=a.partition, alpha=a.alpha, dh=a.dh,
                       classes_per_client=a.classes_per_client, beta=a.beta, min_size=a.min_size,
                       num_clients=a.num_clients, max_train_samples=a.max_train_samples, seed=a.seed)
    data = load_dataset(config.dataset, max_train=config.max_train_samples, seed=config.seed)
    fed = federate(data, config.partition, config.num_clients, config.seed, **config.partition_options())
    return {"class_counts": fed.class_counts.tolist(), "dh": fed.dh}


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    try:
        out = cmd_run(args) if args.command == "run" else cmd_partition(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(_finite(out)) if args.json else _human(args.command, out))
    return 0


def _human(command: str, out: dict) -> str:
    """A short readable summary for people at a terminal."""
    if command == "partition":
        rows = [f"client {i:>3}: " + " ".join(f"{v:>5}" for v in row) for i, row in enumerate(out["class_counts"])]
        return "samples per class\n" + "\n".join(rows) + f"\nDH = {out['dh']:.3f}"
    lines = [f"{'round':>5} {'global acc':>10} {'MB up':>8} {'MB down':>8}"]
    for r in out["rounds"]:
        acc = "-" if r["global_accuracy"] is None else f"{r['global_accuracy']:.4f}"
        lines.append(f"{r['round']:>5} {acc:>10} {r['bytes_up'] / 1e6:>8.2f} {r['bytes_down'] / 1e6:>8.2f}")
    final = out["final"]
    lines.append(f"final global accuracy {final['global_accuracy']:.4f}, "
                 f"mean client accuracy {final['mean_client_accuracy']:.4f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
