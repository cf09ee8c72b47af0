"""What each data-level plug-in costs in training time, relative to plain FedAvg.

FedAvg on Fashion-MNIST (10 clients, IID, LeNet-5, batch 32, one local epoch, 60,000 training images),
with each augmentation in turn. For each it measures the seconds of local training per round (the
engine's ``train_seconds``; evaluation left out) and the one-off set-up time (statistics, pools or
alignment), then prints ``ratio = seconds per round with the augmentation / without``. The runs
alternate so that a noisy, shared machine slows all of them alike; the faster of ``--repeats`` rounds
is kept. No test asserts on these numbers.

Usage: ``python benchmarks/augment_overhead.py [--augments fedrdn normalize ...] [--repeats 2]``.
"""
from __future__ import annotations

import argparse
import time

import torch

from fedlab_core import RunConfig
from fedlab_core.runs import build

AUGMENTS = {
    "normalize": ("normalize", {}),
    "fedrdn": ("fedrdn", {}),
    "fedrdn-per-batch": ("fedrdn", {"draw": "per_batch", "pairing": "independent"}),
    "naivemix": ("naivemix", {}),
    "mixup": ("mixup", {}),
    "ot_align": ("ot_align", {}),
}


def measure(name: str, params: dict, repeats: int) -> tuple[float, float]:
    """(set-up seconds, fastest seconds of local training in one round) for one augmentation."""
    config = RunConfig(dataset="fashion_mnist", model="lenet5", num_clients=10, num_rounds=repeats,
                       augment=name, augment_params=params, eval_every=repeats, seed=0)
    sim = build(config, torch.device("cpu"), progress=False)
    t0 = time.perf_counter()
    state = sim.initial_state()
    setup = time.perf_counter() - t0
    rounds = [sim.run_round(state)["train_seconds"] for _ in range(repeats)]
    return setup, min(rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--augments", nargs="+", default=list(AUGMENTS), choices=list(AUGMENTS))
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    for label in args.augments:
        _, base = measure("none", {}, args.repeats)
        setup, seconds = measure(*AUGMENTS[label], args.repeats)
        print(f"{label:18s} setup_s={setup:6.2f} round_s={seconds:6.2f} plain_round_s={base:6.2f} "
              f"ratio={seconds / base:.3f}", flush=True)


if __name__ == "__main__":
    main()
