"""What the batched executor costs in training time, relative to the loop, as the number of clients grows.

FedAvg (``--algorithm``: another batched method) on Fashion-MNIST (LeNet-5, IID, batch 32, one local epoch,
momentum 0.9, 10,000 training images split over K clients), every client sampled, for each K in turn. For each
executor it measures the seconds of local training per round (the engine's ``train_seconds``; evaluation left out)
in this process with one torch thread, the loop on one worker, then prints ``ratio = batched seconds / loop
seconds`` (below 1: the batched executor is faster). The runs alternate so that a noisy, shared machine slows both
alike; the faster of ``--repeats`` rounds is kept. No test asserts on these numbers: the executor is meant for
GPUs, where one vectorised program replaces K small ones; on a CPU it shows the overhead.

Usage: ``python benchmarks/batched.py [--clients 10 100] [--repeats 2] [--algorithm fedavg]``.
"""
from __future__ import annotations

import argparse

import torch

from fedlab_core import RunConfig
from fedlab_core.runs import build


def measure(clients: int, executor: str, repeats: int, algorithm: str = "fedavg") -> float:
    """The fastest seconds of local training in one round."""
    config = RunConfig(algorithm=algorithm, dataset="fashion_mnist", model="lenet5", max_train_samples=10_000, max_test_samples=1_000,
                       num_clients=clients, num_rounds=repeats, batch_size=32, local_epochs=1, lr=0.05, momentum=0.9,
                       eval_every=repeats, executor=executor, seed=0)
    sim = build(config, torch.device("cpu"), progress=False)
    state = sim.initial_state()
    return min(sim.run_round(state)["train_seconds"] for _ in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", nargs="+", type=int, default=[10, 100])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--algorithm", default="fedavg", help="a batched method (fedavg, moon, distrans, ...)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as a run computes (fedlab_core.runs.one_thread)
    for k in args.clients:
        loop = measure(k, "loop", args.repeats, args.algorithm)
        batched = measure(k, "batched", args.repeats, args.algorithm)
        print(f"K={k:<4d} loop_round_s={loop:6.2f} batched_round_s={batched:6.2f} ratio={batched / loop:.3f}",
              flush=True)


if __name__ == "__main__":
    main()
