"""FedAvg simulation throughput against the machine's ceiling, with one worker and with every core.

For K = 10, 100 and 1,000 clients (Fashion-MNIST, Dirichlet 0.5, LeNet-5, plain SGD, batch 32, one local
epoch: the ceiling's training, fixed rather than FedAvg's paper setting of five epochs)
it runs ``run(config, workers=W)`` for W = 1 and W = every core, each in a fresh process, and reports:

- ``ceiling_ratio``: the run's training samples per second (the samples its clients trained, counted from
  the run's record by :func:`fedlab_core.runs.samples_trained`; local updates plus aggregation; the one
  evaluation after the last round left out) over the machine's ceiling: one single-thread process per
  core, each training LeNet-5 centrally on its share of the 60,000 samples, all started together, their
  samples per second summed;
- ``peak_pss_mb``: the peak proportional set size (PSS, from /proc/<pid>/smaps_rollup) summed over the
  whole process tree, sampled every 50 ms in a second run of its own (reading PSS costs CPU): shared
  pages (the forked workers share the parent's data and code) are counted once, split between the
  processes that share them;
- ``first_round_s``: seconds from the ``run()`` call to the start of round 1 (data loading, the split,
  the model, forking the workers), and ``import_s``, the seconds ``import fedlab_core`` took before it;
- ``eval_s``: the seconds of that one evaluation of the global and every client's test set.

Usage: ``python benchmarks/throughput.py [--clients 10 100 1000] [--rounds 2]``. The numbers are ratios
so that a noisy, shared machine still gives comparable results; no test asserts on them.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

BATCH = 32


def centralised_seconds(x, y, seed: int = 0) -> float:
    """Seconds for one epoch of plain mini-batch SGD on (x, y) with LeNet-5."""
    import torch
    import torch.nn.functional as F

    from fedlab_core.models import build_model

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


def _ceiling_worker(share: tuple[int, int], seed: int, barrier, results) -> None:
    import torch

    from fedlab_core.data import load_dataset

    torch.set_num_threads(1)
    data = load_dataset("fashion_mnist")
    x, y = data.x_train[share[0]:share[1]], data.y_train[share[0]:share[1]]
    centralised_seconds(x[:2048], y[:2048], seed)  # warm-up
    barrier.wait()  # every core starts together
    results.put(len(y) / centralised_seconds(x, y, seed))


def ceiling_samples_per_second(n: int, cores: int) -> float:
    """All cores busy, one single-thread process each, each training on its share of the n samples,
    started together: the sum of their samples per second."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(cores), ctx.Queue()
    procs = [ctx.Process(target=_ceiling_worker, args=((i * n // cores, (i + 1) * n // cores), i, barrier, results))
             for i in range(cores)]
    for p in procs:
        p.start()
    rates = [results.get() for _ in procs]
    for p in procs:
        p.join()
    return sum(rates)


def _tree(pid: int) -> list[int]:
    """`pid` and all its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            pass
    return out


def _pss_mb(pids: list[int]) -> float:
    total = 0
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total / 1024


def measure(num_clients: int, workers: int, rounds: int, memory: bool) -> dict:
    """One run in this (fresh) process: its throughput and start-up; or, with `memory`, its peak memory
    (reading PSS costs the sampling process a lot of CPU, so it is measured in a run of its own)."""
    started = time.perf_counter()
    import fedlab_core
    from fedlab_core import RunConfig, run
    from fedlab_core.engine import Simulation
    from fedlab_core.runs import samples_trained

    import_s = time.perf_counter() - started
    peak, done = [0.0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _pss_mb(_tree(os.getpid())))
            time.sleep(0.05)
    sampler = threading.Thread(target=sample, daemon=True)
    if memory:
        sampler.start()
    first: list[float] = []
    original = Simulation.run_round

    def run_round(self, state):
        if not first:
            first.append(time.perf_counter())
        return original(self, state)
    Simulation.run_round = run_round
    # the local training the ceiling does: one pass of plain SGD (FedAvg's paper setting would be five)
    config = RunConfig(dataset="fashion_mnist", partition="dirichlet", alpha=0.5, num_clients=num_clients,
                       num_rounds=rounds, eval_every=rounds, model="lenet5", local_epochs=1, local_steps=0,
                       batch_size=BATCH, optimizer="sgd", lr=0.05, momentum=0.0, weight_decay=0.0, seed=0)
    called = time.perf_counter()
    history = run(config, use_cache=False, progress=False, workers=workers)
    done.set()
    if memory:
        sampler.join()
    samples = sum(samples_trained(history))  # what the clients trained, from the run's own record
    return {"samples_per_s": samples / sum(r["train_seconds"] for r in history.rounds),
            "first_round_s": first[0] - called, "import_s": import_s, "peak_pss_mb": peak[0],
            "eval_s": history.rounds[-1]["eval_seconds"], "version": fedlab_core.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--measure", type=int, nargs=2, metavar=("K", "WORKERS"), help=argparse.SUPPRESS)
    parser.add_argument("--memory", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:  # the child process of one measurement
        print(json.dumps(measure(*args.measure, args.rounds, args.memory)))
        return
    import torch

    from fedlab_core.data import load_dataset
    from fedlab_core.parallel import available_cores

    cores = available_cores()
    n = len(load_dataset("fashion_mnist").y_train)
    print(f"# torch {torch.__version__}, {cores} cores, {n} training samples, batch {BATCH}", flush=True)
    ceiling = ceiling_samples_per_second(n, cores)
    for k in args.clients:
        for workers in sorted({1, cores}):
            speed, memory = (json.loads(subprocess.run(
                [sys.executable, __file__, "--measure", str(k), str(workers), "--rounds", str(args.rounds), *flags],
                capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]) for flags in ([], ["--memory"]))
            m = {**speed, "peak_pss_mb": memory["peak_pss_mb"]}
            print(f"K={k} workers={workers} sim_samples_per_s={m['samples_per_s']:.0f} "
                  f"ceiling_samples_per_s={ceiling:.0f} peak_pss_mb={m['peak_pss_mb']:.0f} "
                  f"first_round_s={m['first_round_s']:.2f} import_s={m['import_s']:.2f} eval_s={m['eval_s']:.2f} "
                  f"ceiling_ratio={m['samples_per_s'] / ceiling:.3f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
