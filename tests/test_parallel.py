"""Clients trained side by side in worker processes: the same numbers as one process, whatever the thread
count and whether the workers were forked or spawned (after autograd started threads in the parent); a dying
worker is reported with its client and round; no worker outlives its run."""
import contextlib
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from fedlab_core import RunConfig, parallel, run
from fedlab_core.algorithms import ALGORITHMS, FedAvg
from fedlab_core.augment import AUGMENTS
from fedlab_core.parallel import WorkerDiedError, available_cores
from fedlab_core.runs import resolve_workers

ROOT = Path(__file__).resolve().parents[1]
MODEL_FOR = {"fedbn": "mlp_bn", "partialfed": "mlp_bn", "fraug": "mlp_bn", "fedfa": "digit", "pfedhn": "mlp_bn"}


def _numbers(history):
    return [{k: v for k, v in row.items() if not k.endswith("seconds")} for row in history.rounds], history.final


@pytest.fixture
def threads():
    """Set the caller's torch thread count for one test; restored after."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


CASES = [(name, "none") for name in sorted(ALGORITHMS)] + [("fedavg", name) for name in sorted(AUGMENTS) if name != "none"]


@pytest.mark.parametrize("algorithm,augment", CASES, ids=[f"{a}+{g}" for a, g in CASES])
def test_workers_never_change_the_numbers(algorithm, augment, tiny):
    model = "mlp_bn" if augment == "advprop" else MODEL_FOR.get(algorithm, "mlp")
    partition = {"partition": "one_class"} if algorithm == "fedaws" else {"partition": "dirichlet", "alpha": 0.5}
    config = tiny.replace(algorithm=algorithm, augment=augment, model=model, local_steps=4, fraction=0.75,
                          **partition)
    one = run(config, use_cache=False, progress=False, workers=1)
    two = run(config, use_cache=False, progress=False, workers=2)
    assert _numbers(one) == _numbers(two)
    assert one.meta["workers"] == 1 and two.meta["workers"] == 2


@pytest.mark.parametrize("algorithm,params,augment", [("fedavg", {}, "none"), ("scaffold", {}, "none"),
                                                     ("fedbn", {}, "none"), ("distrans", {"aggregation": "nn"}, "none"),
                                                     ("fedavg", {}, "fedrdn")])
def test_neither_workers_nor_the_callers_threads_change_the_numbers(algorithm, params, augment, threads):
    # LeNet-5 with batch norm on 28x28 images: here one and two torch threads give different sums
    config = RunConfig(dataset="fashion_mnist", max_train_samples=1000, max_test_samples=300, partition="dirichlet",
                       alpha=0.5, num_clients=4, num_rounds=2, model="lenet5_bn", algorithm=algorithm,
                       algorithm_params=params, augment=augment, seed=0)
    results = []
    for caller_threads, workers in ((2, 1), (1, 1), (1, 2), (2, 2)):
        threads(caller_threads)
        results.append(_numbers(run(config, use_cache=False, progress=False, workers=workers)))
        assert torch.get_num_threads() == caller_threads  # the run restores the caller's setting
    assert all(r == results[0] for r in results[1:])


@pytest.mark.parametrize("num_clients,victim", [(4, 1), (40, 23)])  # 40 clients: tasks travel in chunks
def test_a_worker_that_dies_stops_the_run_naming_the_client_and_round(num_clients, victim, tiny, tmp_path,
                                                                     monkeypatch):
    original = FedAvg.train_local

    def train_local(self, data, rng, client_state):
        if data.cid == victim:
            os.kill(os.getpid(), signal.SIGKILL)  # as the out-of-memory killer would
        return original(self, data, rng, client_state)
    monkeypatch.setattr(FedAvg, "train_local", train_local)
    with pytest.raises(WorkerDiedError, match=rf"worker process \d+ was killed by signal 9 \(SIGKILL; out of memory "
                                              rf"is a common cause\) while training client {victim} in round 1; the run "
                                              rf"stops"):
        run(tiny.replace(num_clients=num_clients), cache_dir=tmp_path, progress=False, workers=2)
    assert mp.active_children() == []
    assert not list(tmp_path.glob("*.json"))


def test_no_worker_outlives_a_run_that_ends_or_fails(tiny, tmp_path):
    run(tiny, use_cache=False, progress=False, workers=2)
    assert mp.active_children() == []

    class Stop(Exception):
        pass

    from fedlab_core.runs import build

    sim = build(tiny, torch.device("cpu"), progress=False, workers=2)

    def stop(state):
        assert len(mp.active_children()) == 2  # the pool is there during the rounds
        raise Stop
    with pytest.raises(Stop):
        sim.run(on_round_end=stop)
    assert mp.active_children() == [] and sim.pool is None


AUTOGRAD_THREADS_FIRST = textwrap.dedent("""
    import torch
    from fedlab_core import RunConfig, run
    from fedlab_core.parallel import fork_is_safe

    class Nested(torch.autograd.Function):   # a backward pass that runs another inside it, `depth` deep
        @staticmethod
        def forward(ctx, x, depth):
            ctx.depth = depth
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            if ctx.depth:
                with torch.enable_grad():
                    Nested.apply(torch.zeros(1, requires_grad=True), ctx.depth - 1).sum().backward()
            return grad, None

    assert fork_is_safe()
    # past 60 nested passes autograd starts a thread for the deeper ones, as it starts its device threads after
    # training on a GPU: from then on it refuses every backward pass in a forked child
    Nested.apply(torch.ones(1, requires_grad=True), 70).sum().backward()
    assert not fork_is_safe()
    config = RunConfig(dataset="digits", model="mlp", num_clients=4, num_rounds=2, batch_size=32, lr=0.1)
    one, two = (run(config, use_cache=False, progress=False, workers=w) for w in (1, 2))
    numbers = lambda h: [{k: v for k, v in r.items() if not k.endswith("seconds")} for r in h.rounds]
    assert numbers(one) == numbers(two) and two.meta["workers"] == 2 and two.meta["failed_clients"] == 0
    print("same numbers")
""")


def test_workers_train_after_autograd_started_its_threads(tmp_path):
    # the script has no `if __name__ == "__main__":` guard: the spawned workers must not run it again
    script = tmp_path / "threads_first.py"
    script.write_text(AUTOGRAD_THREADS_FIRST)
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "same numbers" in done.stdout, done.stderr[-3000:]


def test_a_simulation_that_cannot_be_sent_to_spawned_workers_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(parallel, "fork_is_safe", lambda: False)
    with pytest.raises(RuntimeError, match=r"^workers: autograd has started threads in this process .*cannot pickle "
                                           r"'_thread.lock' object\); use workers=1$"):
        parallel.WorkerPool({"lock": threading.Lock()}, 2)
    assert mp.active_children() == []


KILLED_PARENT = textwrap.dedent("""
    import multiprocessing as mp, sys, time
    from fedlab_core import RunConfig, run
    from fedlab_core.engine import Simulation
    original = Simulation.run_round
    def run_round(self, state):
        if state.next_round == 2:
            open(sys.argv[1], "w").write(" ".join(str(p.pid) for p in mp.active_children()))
            time.sleep(60)
        return original(self, state)
    Simulation.run_round = run_round
    run(RunConfig(dataset="digits", model="mlp", num_clients=4, num_rounds=3, lr=0.1), use_cache=False,
        progress=False, workers=2)
""")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in state  # a zombie has ended; its new parent reaps it when it can


def _workers_end_with_their_parent(tmp_path, source: str, sig: int, *args: str) -> None:
    """Run `source` (it writes its two workers' pids to argv[1]), send it `sig` once they work, require them gone."""
    script, pids = tmp_path / "parent.py", tmp_path / "pids"
    script.write_text(source)
    # SIGINT as a terminal delivers it: a suite started in the background of a non-interactive shell ignores
    # SIGINT, and an ignored signal stays ignored across exec (the parent would never see it)
    proc = subprocess.Popen([sys.executable, str(script), str(pids), *args], cwd=ROOT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    workers: list[int] = []
    try:
        deadline = time.time() + 120
        while not (pids.exists() and pids.read_text()):
            assert proc.poll() is None and time.time() < deadline
            time.sleep(0.05)
        workers = [int(p) for p in pids.read_text().split()]
        assert len(workers) == 2 and all(_alive(p) for p in workers)
        proc.send_signal(sig)
        # the parent ends promptly, without waiting for its runs (100,000 rounds): 10 to 20 s; a minute of margin
        proc.wait(timeout=60)
        deadline = time.time() + 10
        while any(_alive(p) for p in workers) and time.time() < deadline:
            time.sleep(0.05)
        assert not any(_alive(p) for p in workers), "workers outlived their parent"
    finally:  # a failure leaves no process computing through the rest of the suite
        for pid in [proc.pid, *workers]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()


def test_workers_end_when_their_parent_is_killed(tmp_path):
    _workers_end_with_their_parent(tmp_path, KILLED_PARENT, signal.SIGKILL)


TERMINATED_SWEEP = textwrap.dedent("""
    import multiprocessing as mp, pathlib, sys, threading, time
    from fedlab_core import RunConfig, sweep
    def report():   # once both runs are under way (each has written a checkpoint), name the workers
        while len(list(pathlib.Path(sys.argv[2]).rglob("*.ckpt"))) < 2:
            time.sleep(0.05)
        open(sys.argv[1], "w").write(" ".join(str(p.pid) for p in mp.active_children()))
    if __name__ == "__main__":   # the workers are spawned: they import this file
        threading.Thread(target=report, daemon=True).start()
        long = RunConfig(dataset="digits", model="mlp", num_clients=4, num_rounds=100000, lr=0.1)
        sweep([long, long.replace(seed=1)], max_workers=2, cache_dir=sys.argv[2])
""")


def test_a_sweeps_workers_end_when_it_is_terminated(tmp_path):
    # SIGTERM, as a notebook server or a job scheduler stops a chapter (a SIGKILL takes the same path: the parent
    # dies and the workers' watcher ends them)
    _workers_end_with_their_parent(tmp_path, TERMINATED_SWEEP, signal.SIGTERM, str(tmp_path / "cache"))


def test_a_sweeps_workers_end_when_it_is_interrupted(tmp_path):
    # SIGINT to the sweep alone (a notebook's interrupt button, `kill -INT`): the runs in flight end with it, not
    # when they would have finished
    _workers_end_with_their_parent(tmp_path, TERMINATED_SWEEP, signal.SIGINT, str(tmp_path / "cache"))


def test_default_workers_every_core_on_a_cpu_one_on_a_gpu():
    assert resolve_workers(None, torch.device("cpu")) == available_cores()
    assert resolve_workers(None, torch.device("cuda")) == 1
    with pytest.raises(ValueError, match="^workers: more than one worker process needs a CPU run"):
        resolve_workers(2, torch.device("cuda"))
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="^workers: must be an integer >= 1"):
            resolve_workers(bad, torch.device("cpu"))


def test_a_sweep_runs_each_config_in_one_process(tiny):
    from fedlab_core import sweep

    with pytest.raises(ValueError, match="^workers: a sweep runs its configs side by side"):
        sweep([tiny], workers=2)
