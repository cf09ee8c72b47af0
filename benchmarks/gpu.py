"""What the batched executor and runs trained together gain on a GPU, as ratios against the loop on the same GPU
and against the same machine's CPU cores.

FedAvg (``--algorithm``: another batched method) on Fashion-MNIST, LeNet-5, Dirichlet(0.5) split, batch 32, one
local epoch, momentum 0.9, every client sampled. Four measurements, each printed as a ratio (above 1: faster than what it is compared with):

1. clients batched: the local training of one round (the engine's ``train_seconds``, the fastest of rounds 2 to
   ``--rounds``; round 1 warms the GPU up), for K clients sharing ``--train`` images: the batched executor on the
   GPU against the loop on the GPU, and against the loop on the CPU with one worker process per core; on a GPU
   also the batched steps launched eagerly, not replayed as a CUDA graph;
2. runs batched: a tuning grid (``--rates``, five by default, x 5 seeds, ``--grid-clients`` clients, ``--rounds``
   rounds, evaluated after the last), whole runs from their configs to their histories: trained together on the GPU
   (:func:`fedlab_core.runs.run_many`) against the loop on the GPU one run after another, and against a sweep
   on the CPU cores (one run per core, as the book computes on a CPU);
3. agreement: the global accuracy after ``--rounds`` rounds, loop against batched on the GPU, at every K (at
   K = 100 on 20,000 images both sit at chance after 3 rounds: it compares something where the runs have learned).

4. where a batched round's time goes (``--parts 4``): the functions taking the most time in rounds 2 to ``--rounds``
   at the largest K, by cProfile (the GPU's work shows where the host waits for it), and the share of the local
   training spent around the mapped steps (starting the clients, drawing their batches, finishing them).

No test asserts on these numbers. Usage: ``python benchmarks/gpu.py [--train 60000] [--clients 10 100 1000]``;
``--device cpu`` runs the same script on a CPU (to check it, not to measure).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import time

import torch

from fedlab_core import RunConfig, batched, run, sweep
from fedlab_core.kernels import deterministic
from fedlab_core.runs import build, resolve_device, run_many

RATES = (0.01, 0.02, 0.05, 0.1, 0.2)
SEEDS = (0, 1, 2, 3, 4)


def base(train: int, clients: int, rounds: int, algorithm: str = "fedavg") -> RunConfig:
    return RunConfig(algorithm=algorithm, dataset="fashion_mnist", model="lenet5", max_train_samples=train,
                     max_test_samples=2_000,
                     partition="dirichlet", alpha=0.5, num_clients=clients, num_rounds=rounds, eval_every=rounds,
                     batch_size=32, local_epochs=1, lr=0.05, momentum=0.9, seed=0)


def round_seconds(config: RunConfig, device: torch.device, workers: int = 1) -> tuple[float, float, int]:
    """(the fastest round's local training seconds after the first, the final global accuracy, images a round)."""
    sim = build(config, device, progress=False, workers=workers)
    with deterministic(device):
        state = sim.run()
    seconds = min(row["train_seconds"] for row in state.rows[1:])
    return seconds, state.rows[-1]["global_accuracy"], sum(c.num_train for c in sim.federation.clients)


@contextlib.contextmanager
def graphs(on: bool):
    """The batched executor's steps replayed as CUDA graphs (its default) or launched eagerly."""
    held = batched.GRAPHS.get("cuda", False)
    batched.GRAPHS["cuda"] = on
    try:
        yield
    finally:
        batched.GRAPHS["cuda"] = held


def wall(fn) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--algorithm", default="fedavg", help="a batched method (fedavg, moon, distrans, ...)")
    parser.add_argument("--train", type=int, default=60_000, help="training images shared by the clients")
    parser.add_argument("--clients", nargs="+", type=int, default=[10, 100, 1000])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--grid-clients", type=int, default=10)
    parser.add_argument("--grid-train", type=int, default=10_000)
    parser.add_argument("--rates", nargs="+", type=float, default=list(RATES),
                        help="the grid's rates (pFedMe diverges at 0.2: its local copy steps at lr x lam)")
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="0: no CPU comparison")
    parser.add_argument("--parts", nargs="+", type=int, default=[1, 2],
                        help="1: clients batched (and 3, the accuracies); 2: the tuning grid; 4: the profile")
    args = parser.parse_args()
    device = resolve_device(args.device)
    cpu = torch.device("cpu")
    torch.set_num_threads(1)  # as a run computes; the CPU's parallelism is its worker processes
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"device: {name}; CPU: {args.cores} cores; torch {torch.__version__}", flush=True)

    if 1 in args.parts:
        clients(args, device, cpu)
    if 2 in args.parts:
        grid(args, device)
    if 4 in args.parts:
        profile(args, device)


def clients(args, device: torch.device, cpu: torch.device) -> None:
    """Measurements 1 and 3: one round's local training, K clients; the accuracies at every K."""
    print("\n1. one round's local training, K clients sharing "
          f"up to {args.train} images (samples/s; ratios: batched against each)", flush=True)
    accuracy = {}
    for k in args.clients:
        config = base(args.train, k, args.rounds, args.algorithm)
        loop, acc_loop, images = round_seconds(config.replace(executor="loop"), device)
        batched, acc_batched, _ = round_seconds(config.replace(executor="batched"), device)
        accuracy[k] = (acc_loop, acc_batched)
        line = (f"K={k:<5d} {images} images  loop {images / loop:9,.0f}/s  batched {images / batched:9,.0f}/s  "
                f"batched/loop {loop / batched:6.1f}x")
        if device.type == "cuda":  # the same steps launched one by one, not replayed as a CUDA graph
            with graphs(False):
                eager, _, _ = round_seconds(config.replace(executor="batched"), device)
            line += f"  (its steps launched eagerly {images / eager:9,.0f}/s: the graph {eager / batched:4.1f}x)"
        if args.cores:
            cores, _, _ = round_seconds(config.replace(executor="loop"), cpu, workers=args.cores)
            line += f"  {args.cores} CPU cores {images / cores:9,.0f}/s  batched/cores {cores / batched:6.1f}x"
        print(line, flush=True)

    print(f"\n3. global accuracy after {args.rounds} rounds: " + "; ".join(
        f"K={k}: loop {loop:.4f}, batched {batched:.4f}" for k, (loop, batched) in accuracy.items()), flush=True)


def grid(args, device: torch.device) -> None:
    """Measurement 2: a tuning grid's runs, together, one by one and on the CPU cores."""
    grid = [base(args.grid_train, args.grid_clients, args.rounds, args.algorithm).replace(lr=lr, seed=seed)
            for lr in args.rates for seed in SEEDS]
    print(f"\n2. a tuning grid: {len(args.rates)} rates x {len(SEEDS)} seeds, {args.grid_clients} clients, "
          f"{args.grid_train} images, {args.rounds} rounds each (seconds for the {len(grid)} runs)", flush=True)
    together = wall(lambda: run_many([c.replace(executor="batched") for c in grid], use_cache=False, device=device))
    one_by_one = wall(lambda: [run(c.replace(executor="loop"), use_cache=False, device=device, progress=False)
                               for c in grid])
    line = f"together {together:7.1f} s  loop one by one {one_by_one:7.1f} s  together/loop {one_by_one / together:6.1f}x"
    if args.cores:
        on_cores = wall(lambda: sweep([c.replace(executor="loop") for c in grid], use_cache=False, device="cpu",
                                      max_workers=args.cores))
        line += f"  {args.cores} CPU cores {on_cores:7.1f} s  together/cores {on_cores / together:6.1f}x"
    print(line, flush=True)


def profile(args, device: torch.device) -> None:
    """Measurement 4: the functions a batched round spends its time in, rounds 2 on, at the largest K."""
    import cProfile
    import pstats

    k = max(args.clients)
    sim = build(base(args.train, k, args.rounds, args.algorithm).replace(executor="batched"), device, progress=False)
    profiler = cProfile.Profile()
    with deterministic(device):
        sim.run(on_round_end=lambda state: profiler.enable() if len(state.rows) == 1 else None)
    profiler.disable()
    print(f"\n4. where rounds 2 to {args.rounds} of K={k} batched spend their time (cProfile, own time first)")
    stats = pstats.Stats(profiler)
    cumulative = {name: sum(row[3] for (_, _, function), row in stats.stats.items() if function == name)
                  for name in ("run_round", "local_updates", "_train")}
    outside = cumulative["local_updates"] - cumulative["_train"]
    print(f"rounds {cumulative['run_round']:.3f} s; local training {cumulative['local_updates']:.3f} s, of which the "
          f"mapped steps {cumulative['_train']:.3f} s and around them (starting the clients, drawing their batches, "
          f"finishing them) {outside:.3f} s "
          f"({outside / max(cumulative['local_updates'], 1e-9):.0%})", flush=True)
    stats.sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
