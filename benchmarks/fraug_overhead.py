"""What FRAug costs per round, relative to FedBN, the method it is built on.

Both on the feature-skew benchmark (five domains of Fashion-MNIST, 300 training images per client, one
client per domain), with the model and local protocol of the FRAug chapter (SGD lr 0.01, momentum 0.5,
20 local steps of batch 64). For each model it measures the seconds of local training per round (the
engine's ``train_seconds``; evaluation left out) and the bytes each client sends up, then prints
``ratio = FRAug / FedBN`` for both. The runs alternate so that a noisy, shared machine slows both alike;
the fastest of ``--repeats`` rounds is kept. No test asserts on these numbers.

Usage: ``python benchmarks/fraug_overhead.py [--models lenet5_bn digit] [--repeats 3]``.
"""
from __future__ import annotations

import argparse

import torch

from fedlab_core import RunConfig
from fedlab_core.runs import build, one_thread


def measure(algorithm: str, model: str, repeats: int) -> tuple[float, int]:
    """(fastest seconds of local training in one round, bytes up per client) on one thread."""
    config = RunConfig(dataset="fashion_mnist_domains", model=model, algorithm=algorithm, partition="domain",
                       num_clients=5, num_rounds=repeats, eval_every=repeats, max_train_samples=0, max_test_samples=0,
                       dataset_params={"samples_per_domain": 300, "test_per_domain": 100},
                       lr=0.01, momentum=0.5, batch_size=64, local_steps=20, seed=0)
    with one_thread():
        sim = build(config, torch.device("cpu"), progress=False)
        state = sim.initial_state()
        rows = [sim.run_round(state) for _ in range(repeats)]
    return min(r["train_seconds"] for r in rows), rows[0]["bytes_up"] // config.num_clients


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["lenet5_bn", "digit"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    for model in args.models:
        base, base_bytes = measure("fedbn", model, args.repeats)
        seconds, nbytes = measure("fraug", model, args.repeats)
        print(f"{model:10s} fedbn_round_s={base:6.2f} fraug_round_s={seconds:6.2f} time_ratio={seconds / base:.3f} "
              f"fedbn_bytes_up={base_bytes:,} fraug_bytes_up={nbytes:,} bytes_ratio={nbytes / base_bytes:.3f}",
              flush=True)


if __name__ == "__main__":
    main()
