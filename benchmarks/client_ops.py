"""What starting and finishing its clients costs the batched executor, outside its mapped steps: the tensor
operations dispatched per client in a round, each a kernel launch on a GPU, against the model's entries.

Each client is started (its starting model put into the workspace model and read into the chunk's stacked
tensors) and finished (its trained entries put back, its upload built) one after another, in Python; on a GPU every
operation there is a launch of its own, which costs more than its arithmetic on LeNet-5's small tensors. With one
copy per entry, a client cost several operations per entry; with the entries copied by one fused copy per type
(``fedlab_core.algorithms.base.copy_all``) it costs a few operations whatever the model's size. This script counts
them (``TorchDispatchMode``, views excluded: they launch nothing) on the CPU, where the count is the one a GPU
launches, for each batched method on LeNet-5 with batch norm, and prints ``ratio = operations per client /
entries`` (1 would be one launch per entry). The mapped steps are left out: they are one program for all clients
(on a GPU a replayed CUDA graph). No test asserts on these numbers.

Usage: ``python benchmarks/client_ops.py [--clients 10 100] [--algorithms fedavg moon scaffold distrans]``.
"""
from __future__ import annotations

import argparse
import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fedlab_core import RunConfig, batched
from fedlab_core.runs import build


class Operations(TorchDispatchMode):
    """Counts the operations dispatched while it is active and `counting`, views excluded."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.counting = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.counting and not func.is_view:
            self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def per_client(algorithm: str, clients: int) -> tuple[float, int, list[tuple[str, int]]]:
    """(operations per client in round 2 outside the mapped steps, the model's entries, the commonest ones)."""
    split = {"partition": "distrans", "dh": 0.6} if algorithm == "distrans" else {}
    config = RunConfig(algorithm=algorithm, dataset="fashion_mnist", model="lenet5_bn",
                       max_train_samples=20 * clients, max_test_samples=200, num_clients=clients, num_rounds=2,
                       batch_size=32, local_epochs=1, lr=0.05, momentum=0.9, eval_every=2, executor="batched", seed=0,
                       **split)
    sim = build(config, torch.device("cpu"), progress=False)
    state = sim.initial_state()
    sim.run_round(state)  # the first round builds the programs
    counter, train = Operations(), batched._train

    def uncounted(*args, **kwargs):
        counter.counting = False
        try:
            return train(*args, **kwargs)
        finally:
            counter.counting = True

    batched._train = uncounted
    try:
        selected, messages = sim.messages(state)
        tasks = sim.tasks(state, selected, messages)
        with counter:
            batched.local_updates(tasks)
    finally:
        batched._train = train
    entries = len(batched._entries(sim.algorithm))
    return sum(counter.counts.values()) / len(tasks), entries, counter.counts.most_common(4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", nargs="+", type=int, default=[10, 100])
    parser.add_argument("--algorithms", nargs="+", default=["fedavg", "moon", "scaffold", "distrans"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    for algorithm in args.algorithms:
        for k in args.clients:
            ops, entries, common = per_client(algorithm, k)
            print(f"{algorithm:<9s} K={k:<4d} operations_per_client={ops:6.1f} entries={entries} "
                  f"ratio={ops / entries:.2f}  commonest: {', '.join(f'{n} {c}' for n, c in common)}", flush=True)


if __name__ == "__main__":
    main()
