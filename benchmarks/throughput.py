"""FedAvg simulation throughput versus centralised training of the same samples.

For K = 10, 100 and 1,000 clients (Fashion-MNIST, Dirichlet 0.5, LeNet-5, batch 32, one local epoch)
it measures the engine's training samples per second (local updates plus aggregation; evaluation
left out) and divides it by:

- ``ratio``: centralised training of the same 60,000 samples with the same model, batch size and
  thread count, measured just before and just after in the same process (the faster is kept);
- ``ceiling_ratio``: the machine's real ceiling, one single-thread process per core, each training
  centrally on its share of the samples at the same time.

Usage: ``python benchmarks/throughput.py [--clients 10 100 1000] [--rounds 2]``. Prints one line per K
ending in ``ceiling_ratio=<float> ratio=<float>``. The numbers are ratios so that a noisy, shared
machine still gives comparable results; no test asserts on them.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import sys
import time

import torch
import torch.nn.functional as F

from fedlab_core import RunConfig
from fedlab_core.data import load_dataset
from fedlab_core.data import partition as P
from fedlab_core.models import build_model
from fedlab_core.runs import build

BATCH = 32


def centralised_seconds(x: torch.Tensor, y: torch.Tensor, seed: int = 0) -> float:
    """Seconds for one epoch of plain mini-batch SGD on (x, y) with LeNet-5."""
    torch.manual_seed(seed)
    model = build_model("lenet5", tuple(x.shape[1:]), 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model.train()
    start = time.perf_counter()
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    xs, ys = x[perm], y[perm]
    for s in range(0, len(y), BATCH):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(xs[s:s + BATCH]), ys[s:s + BATCH]).backward()
        opt.step()
    return time.perf_counter() - start


def _ceiling_worker(args) -> float:
    share, seed = args
    torch.set_num_threads(1)
    data = load_dataset("fashion_mnist")
    idx = torch.arange(share[0], share[1])
    return centralised_seconds(data.x_train[idx], data.y_train[idx], seed)


def ceiling_samples_per_second(n: int) -> float:
    """All cores busy, one single-thread process each, each on its share of the n samples."""
    cores = os.cpu_count() or 1
    bounds = [(i * n // cores, (i + 1) * n // cores) for i in range(cores)]
    with mp.get_context("spawn").Pool(cores) as pool:
        pool.map(_ceiling_worker, [((0, 256), 0)] * cores)  # warm-up: imports and data loading
        start = time.perf_counter()
        pool.map(_ceiling_worker, [(b, i) for i, b in enumerate(bounds)])
        wall = time.perf_counter() - start
    return n / wall


def simulation_samples_per_second(num_clients: int, rounds: int) -> float:
    config = RunConfig(dataset="fashion_mnist", partition="dirichlet", alpha=0.5, num_clients=num_clients,
                       num_rounds=rounds, eval_every=rounds, model="lenet5", batch_size=BATCH, lr=0.05, seed=0)
    sim = build(config, torch.device("cpu"), progress=False)
    state = sim.run()
    samples = rounds * sum(c.num_train for c in sim.federation.clients)
    return samples / sum(r["train_seconds"] for r in state.rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    data = load_dataset("fashion_mnist")
    n = len(data.y_train)
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores, "
          f"{n} training samples, batch {BATCH}", flush=True)
    start = time.perf_counter()
    P.dirichlet(data.y_train.numpy(), 1000, seed=0, alpha=0.01)
    print(f"partition dirichlet K=1000 alpha=0.01 seconds={time.perf_counter() - start:.3f}", flush=True)
    centralised_seconds(data.x_train[:2048], data.y_train[:2048])  # warm-up
    ceiling = ceiling_samples_per_second(n)
    for k in args.clients:
        # centralised is timed before and after the simulation and the faster kept: noise on a
        # shared machine then counts against the simulation, never for it
        before = centralised_seconds(data.x_train, data.y_train)
        sim = simulation_samples_per_second(k, args.rounds)
        central = n / min(before, centralised_seconds(data.x_train, data.y_train))
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"K={k} sim_samples_per_s={sim:.0f} centralised_samples_per_s={central:.0f} "
              f"ceiling_samples_per_s={ceiling:.0f} peak_rss_mb={peak_mb:.0f} "
              f"ceiling_ratio={sim / ceiling:.3f} ratio={sim / central:.3f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
