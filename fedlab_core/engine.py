"""The simulation loop: sample clients, run local updates, aggregate, evaluate, log, checkpoint.

The engine knows nothing about any algorithm: it moves :class:`~fedlab_core.algorithms.base.Message`
objects between :meth:`Algorithm.server_message`, :meth:`Algorithm.local_update` and
:meth:`Algorithm.aggregate`, counts their bytes, and evaluates through :meth:`Algorithm.predict`.

Every client in every round draws its randomness from its own generator, derived from
(seed, round, client), so results do not depend on the order clients run in, and a run resumed from a
checkpoint ends with exactly the numbers of an uninterrupted one.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm  # the plain bar: no widget dependency, silent when not on a terminal

from . import batched
from .algorithms.base import Algorithm, ClientsFailedError, Message, NonFiniteLossError
from .augment.base import Augment
from .data.federation import Federation
from .parallel import WorkerPool
from .convergence import metric_curve, stop_round

log = logging.getLogger("fedlab_core")

EXECUTORS = ("auto", "loop", "batched")
SERVER = -1  # the "client id" of the server's own random stream (client sampling)
INIT = -2    # the stream that initialises the model
TIMING_DIGITS = 4   # significant digits kept of a timing


def timing(seconds: float) -> float:
    """A measured duration as the logs keep it: to :data:`TIMING_DIGITS` significant digits. A timing is the
    machine's, never compared between runs (verification skips it), and the digits past these are noise that took
    a fifth of an archived run's bytes."""
    return float(f"{seconds:.{TIMING_DIGITS}g}")


def derive_seed(seed: int, round_idx: int, client: int) -> int:
    """A 63-bit seed that depends only on (seed, round, client); client may be SERVER or INIT."""
    state = np.random.SeedSequence([seed, round_idx, client - INIT]).generate_state(2, np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


def client_generator(seed: int, round_idx: int, client: int) -> torch.Generator:
    """The torch generator client `client` uses in round `round_idx` (CPU; indices move to the device)."""
    return torch.Generator().manual_seed(derive_seed(seed, round_idx, client))


@dataclass
class SimulationState:
    """Everything a checkpoint holds: the next round to run, the server and client states, the log."""

    next_round: int
    server: dict[str, Any]
    clients: dict[int, dict[str, Any]]
    rows: list[dict[str, Any]] = field(default_factory=list)
    setup_bytes: tuple[int, int] = (0, 0)


def _all_failed(round_idx: int, failed: list[tuple[int, Exception]]) -> str:
    """One line: every client failed in this round, and with what (clients with the same error grouped)."""
    groups: dict[str, list[int]] = {}
    for cid, err in failed:
        groups.setdefault(f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}",
                          []).append(cid)
    errors = "; ".join(f"client{'s' if len(ids) > 1 else ''} {', '.join(map(str, ids))}: {text}"
                       for text, ids in groups.items())
    return f"every client sampled in round {round_idx} failed, so the run stops ({errors})"


class Simulation:
    """Runs an algorithm on a federation.

    Parameters
    ----------
    algorithm : the method (already constructed with its hyperparameters).
    federation : the clients' data, on the run's device.
    model : the workspace model (already initialised from the seed, on the device).
    seed : the run's seed.
    num_rounds : communication rounds.
    fraction, clients_per_round : client sampling; `clients_per_round` > 0 wins over `fraction`.
    eval_every : evaluate every this many rounds (and always after the last round).
    eval_batch_size : batch size for evaluation.
    augment : an augmentation plug-in (None: none).
    progress : show a tqdm bar (None: only on a terminal).
    workers : processes that train clients (and evaluate) side by side in :meth:`run`; 1: all in this
        process. More than one needs a CPU run (see :mod:`fedlab_core.parallel`). The numbers do not
        depend on it as long as every process runs torch with the same thread count (:func:`run` uses one).
    stop_at_plateau : stop before a round once the evaluated rounds so far of `plateau_metric` (the mean client
        accuracy, the global model's accuracy, or the clients' mean accuracy on their monitored validation shares,
        ``"validation_accuracy"``) have passed the plateau test at `patience` evaluations in a row
        (:func:`fedlab_core.convergence.stop_round`); `num_rounds` is then the cap. A method without a global
        model never stops on the global accuracy.
    executor : how a round's clients train: ``"loop"``, one local update after another (on the workers), or
        ``"batched"``, all together in this process as one vectorised program (:mod:`fedlab_core.batched`;
        the same maths, other floats); ``"auto"``: batched on a GPU, the loop on a CPU (where the vectorised
        program gains nothing). A run the batched executor cannot train (:func:`batched.unsupported`) trains in
        the loop, and says so once in a logged line (a warning when ``"batched"`` was asked for).
    """

    def __init__(self, algorithm: Algorithm, federation: Federation, model: torch.nn.Module, *, seed: int,
                 num_rounds: int, fraction: float = 1.0, clients_per_round: int = 0, eval_every: int = 1,
                 eval_batch_size: int = 1024, augment: Augment | None = None, progress: bool | None = None,
                 workers: int = 1, stop_at_plateau: bool = False, plateau_metric: str = "mean_client_accuracy",
                 patience: int = 1, executor: str = "loop"):
        self.algorithm, self.federation, self.model = algorithm, federation, model
        self.stop_at_plateau, self.plateau_metric, self.patience = stop_at_plateau, plateau_metric, patience
        self.seed, self.num_rounds = seed, num_rounds
        self.fraction, self.clients_per_round = fraction, clients_per_round
        self.eval_every, self.eval_batch_size = eval_every, eval_batch_size
        self.augment = augment or Augment()
        self.progress = progress
        if workers > 1 and federation.x_test.device.type != "cpu":
            raise ValueError(f"workers: more than one worker process needs a CPU run; got {workers} on "
                             f"{federation.x_test.device}")
        self.workers = workers
        self.pool: WorkerPool | None = None  # while run() runs with workers > 1
        self.augment.check_model(model)  # e.g. FedBN or AdvProp on a model without batch norm: refused
        self.algorithm.check_model(model)
        algorithm.augment = None if type(self.augment) is Augment else self.augment
        algorithm.num_rounds = num_rounds
        if executor not in EXECUTORS:
            raise ValueError(f"executor: unknown value {executor!r}; allowed: {', '.join(EXECUTORS)}")
        self.executor = executor
        wanted = executor == "batched" or executor == "auto" and federation.x_test.device.type == "cuda"
        why = batched.unsupported(algorithm, model) if wanted else None
        if why is not None:
            (log.warning if executor == "batched" else log.info)(
                "executor: 'batched' cannot train this run (%s), so its clients train in the loop", why)
        self.batched = wanted and why is None

    # ------------------------------------------------------------------ state

    def initial_state(self) -> SimulationState:
        """Run the augmentation's set-up exchange and the algorithm's initialisation."""
        self.model = self.augment.prepare_model(self.model)
        self.federation, up, down = self.augment.setup(self.federation, self.seed)
        server = self.algorithm.init(self.model, self.federation)
        clients = {cid: self.algorithm.init_client(cid) for cid in range(self.federation.num_clients)}
        return SimulationState(1, server, clients, [], (sum(m.nbytes for m in up), sum(m.nbytes for m in down)))

    def resume_state(self, state: SimulationState) -> SimulationState:
        """Prepare a checkpointed state to continue: redo the (deterministic) set-up, keep the rest."""
        self.model = self.augment.prepare_model(self.model)
        self.federation, _, _ = self.augment.setup(self.federation, self.seed)
        self.algorithm.init(self.model, self.federation)
        return state

    # ------------------------------------------------------------------ the loop

    def sample(self, round_idx: int) -> list[int]:
        """The clients that take part in a round, from the server's own stream for that round."""
        k = self.federation.num_clients
        m = self.clients_per_round or (k if self.fraction >= 1.0 else max(1, round(self.fraction * k)))
        if m >= k:
            return list(range(k))
        picked = torch.randperm(k, generator=client_generator(self.seed, round_idx, SERVER))[:m]
        return sorted(picked.tolist())

    def _map(self, fn: Callable, arglist: list[tuple], describe: Callable[[int], str],
             costs: list[float] | None = None) -> list[tuple[bool, Any]]:
        """``fn(self, *args)`` for every args: on the worker pool while :meth:`run` holds one (`costs` help
        it balance the load), else here. Returns ``(True, result)`` or ``(False, exception)`` per task, in
        order."""
        if self.pool is not None:
            return self.pool.map(fn, arglist, describe, costs)
        out = []
        for args in arglist:
            try:
                out.append((True, fn(self, *args)))
            except Exception as err:
                out.append((False, err))
        return out

    def run_round(self, state: SimulationState) -> dict[str, Any]:
        """One communication round; updates `state` in place and returns its log row."""
        t0 = time.perf_counter()
        r = state.next_round
        selected, messages = self.messages(state)
        if self.batched:
            results = batched.local_updates(self.tasks(state, selected, messages))
        else:
            results = self._map(_train_client, [(r, cid, m, state.clients[cid]) for cid, m in zip(selected, messages)],
                                lambda i: f"training client {selected[i]} in round {r}",
                                [self.federation.clients[cid].num_train for cid in selected])
        return self.end_round(state, selected, messages, results, t0)

    def messages(self, state: SimulationState) -> tuple[list[int], list[Message]]:
        """The start of a round: the clients sampled for it, and what the server sends each."""
        selected = self.sample(state.next_round)
        return selected, [self.algorithm.server_message(state.server, cid) for cid in selected]  # in id order

    def tasks(self, state: SimulationState, selected: list[int], messages: list[Message]) -> list[batched.Task]:
        """The round's local updates as the batched executor takes them: each client on its own stream for the
        round, as in :func:`_train_client`."""
        r = state.next_round
        return [(self.algorithm, self.federation.clients[cid], m, state.clients[cid], client_generator(self.seed, r, cid))
                for cid, m in zip(selected, messages)]

    def end_round(self, state: SimulationState, selected: list[int], messages: list[Message],
                  results: list[tuple[bool, Any]], t0: float) -> dict[str, Any]:
        """The end of a round whose clients' local updates gave `results` (:meth:`_map`'s form): aggregate,
        evaluate, log; `t0` is when the round began."""
        r = state.next_round
        uploads: list[tuple[int, Message]] = []
        bytes_up, bytes_down = 0, sum(m.nbytes for m in messages)
        failed: list[tuple[int, Exception]] = []
        for cid, (ok, value) in zip(selected, results):  # handled in id order, as if run one after another
            if not ok:
                if isinstance(value, NonFiniteLossError):
                    raise NonFiniteLossError(f"non-finite training loss at client {cid} in round {r} ({value}): "
                                             f"the run diverged; a lower learning rate usually helps") from None
                # a failing client must not sink the federation
                log.warning("client %d failed in round %d and is left out of the aggregate: %r", cid, r, value)
                failed.append((cid, value))
                continue
            upload, state.clients[cid] = value
            bytes_up += upload.nbytes
            uploads.append((cid, upload))
        if failed and not uploads:
            raise ClientsFailedError(_all_failed(r, failed))
        uploads.sort(key=lambda pair: pair[0])  # aggregation order never depends on execution order
        if uploads:
            state.server = self.algorithm.aggregate(state.server, uploads, r)
        if r == 1:
            bytes_up += state.setup_bytes[0]
            bytes_down += state.setup_bytes[1]
        losses = [(m.metrics["loss"], m.num_samples) for _, m in uploads if "loss" in m.metrics]
        row = {
            "round": r,
            "clients": len(selected),
            "failed": len(failed),
            "train_loss": (sum(l * n for l, n in losses) / max(sum(n for _, n in losses), 1)) if losses else math.nan,
            "bytes_up": int(bytes_up),
            "bytes_down": int(bytes_down),
            "train_seconds": timing(time.perf_counter() - t0),
        }
        for name in sorted({k for _, m in uploads for k in m.diagnostics}):  # e.g. DisTrans's offset_change
            values = [float(m.diagnostics[name]) for _, m in uploads if name in m.diagnostics]
            row[name] = sum(values) / len(values)  # the mean over the round's clients that reported it
        t1 = time.perf_counter()
        if r % self.eval_every == 0 or r == self.num_rounds:
            row.update(self.evaluate(state))
        else:
            row.update(global_accuracy=None, global_loss=None, mean_client_accuracy=None)
        row["eval_seconds"] = timing(time.perf_counter() - t1)
        state.rows.append(row)
        state.next_round = r + 1
        return row

    def _seed_global_streams(self, seed: int) -> None:
        """Seed torch's global generators for code that draws from them (dropout, some augmentations).

        Not ``torch.manual_seed``: with CUDA not initialised it queues a lazy call, with a formatted
        stack trace, for every accelerator backend, which costs ~0.5 ms and memory per client.
        """
        torch.default_generator.manual_seed(seed)
        if self.federation.x_test.is_cuda:
            torch.cuda.manual_seed(seed)

    def run(self, state: SimulationState | None = None,
            on_round_end: Callable[[SimulationState], None] | None = None, until: int | None = None) -> SimulationState:
        """Run the remaining rounds; `on_round_end(state)` is called after each (checkpointing). `until`: stop
        after that round (the first rounds of the same run, e.g. to verify a stored run).

        With ``workers`` > 1 the worker pool is started once the set-up is done and closed when the rounds
        end (or fail).
        """
        state = self.initial_state() if state is None else self.resume_state(state)
        bar = tqdm(total=self.num_rounds, initial=state.next_round - 1, desc=self.algorithm.name,
                   unit="round", disable=(None if self.progress is None else not self.progress), leave=False)
        workers = min(self.workers, self.federation.num_clients)
        with bar, (WorkerPool(self, workers) if workers > 1 else contextlib.nullcontext()) as pool:
            self.pool = pool
            try:
                self._rounds(state, bar, on_round_end, self.num_rounds if until is None else min(until, self.num_rounds))
            finally:
                self.pool = None
        return state

    def plateaued(self, state: SimulationState) -> bool:
        """Whether the run stops here: `stop_at_plateau` and the evaluated rounds so far have passed the plateau test
        `patience` times in a row. It reads only the log, so a run resumed from a checkpoint stops at the same round."""
        return self.stop_at_plateau and stop_round(metric_curve(state.rows, self.plateau_metric), self.patience) is not None

    def _rounds(self, state: SimulationState, bar, on_round_end, last: int) -> None:
        while state.next_round <= last and not self.plateaued(state):
            row = self.run_round(state)
            if row["mean_client_accuracy"] is not None:  # an evaluated round
                shown = row["global_accuracy"] if not math.isnan(row["global_accuracy"]) else row["mean_client_accuracy"]
                bar.set_postfix(acc=f"{shown:.3f}", loss=f"{row['train_loss']:.3f}")
            bar.update(1)
            if on_round_end is not None:
                on_round_end(state)

    # ------------------------------------------------------------------ evaluation

    @torch.no_grad()
    def _score_batches(self, predict: Callable[[torch.Tensor], torch.Tensor], cid: int | None,
                       x: torch.Tensor, y: torch.Tensor) -> list[tuple[int, float]]:
        """(correct, summed loss) of `predict`'s logits on each evaluation batch of (x, y), inputs prepared
        as client `cid` prepares them (None: the global test set)."""
        out = []
        for s in range(0, len(y), self.eval_batch_size):
            xb, yb = x[s:s + self.eval_batch_size], y[s:s + self.eval_batch_size]
            logits = predict(self.augment.eval_input(xb, cid))
            out.append(((logits.argmax(1) == yb).sum().item(), F.cross_entropy(logits, yb, reduction="sum").item()))
        return out

    def _score(self, predict: Callable[[torch.Tensor], torch.Tensor], cid: int | None,
               x: torch.Tensor, y: torch.Tensor) -> tuple[float, float, int]:
        """(correct, summed loss, count) of `predict`'s logits on (x, y); see :meth:`_score_batches`."""
        return _total(self._score_batches(predict, cid, x, y)) + (len(y),)

    def _predictor(self, state: SimulationState, cid: int | None) -> Callable[[torch.Tensor], torch.Tensor]:
        """The algorithm's logits as evaluation uses them: client `cid`'s `predict`, or `predict_global`."""
        if cid is None:
            return lambda xb: self.algorithm.predict_global(state.server, state.clients, xb)
        return lambda xb: self.algorithm.predict(state.server, state.clients[cid], xb)

    def accuracy(self, state: SimulationState, x: torch.Tensor, y: torch.Tensor, cid: int | None = None) -> float:
        """Accuracy on any images (x, y), predicted and prepared exactly as evaluation does for client `cid`
        (None: the global view), e.g. on training images or a transformed test set."""
        correct, _, n = self._score(self._predictor(state, cid), cid, x, y)
        return correct / max(n, 1)

    def cross_site_accuracy(self, state: SimulationState) -> np.ndarray:
        """Cross-site generalisation of the clients' local models: a (K, K) array, row i column j the
        accuracy of client i's local model on client j's test set (inputs prepared as client j prepares
        them, e.g. normalised with its own FedRDN statistics).

        Client i's local model is what one more round of local training from `state` gives it (on that
        round's stream, so the numbers are deterministic); `state` itself is left unchanged.
        """
        k, r = self.federation.num_clients, state.next_round
        acc = np.full((k, k), np.nan)
        for i in range(k):
            _train_client(self, r, i, self.algorithm.server_message(state.server, i), copy.deepcopy(state.clients[i]))
            self.algorithm.model.eval()
            for j, data in enumerate(self.federation.clients):
                if len(data.y_test):
                    correct, _, n = self._score(self.algorithm.model, j, data.x_test, data.y_test)
                    acc[i, j] = correct / n
        return acc

    def _evaluation_shares(self, state: SimulationState) -> list[tuple]:
        """The evaluation split into one task per worker: (server state, the client states it needs, its
        units), a unit being (target, start, stop, part) with target None for the global test set (one unit
        per batch) or a client id (its whole test set, part "test", or its monitored validation set, part
        "val"). Units go to the least-loaded share, largest first."""
        fed = self.federation
        units = [(None, s, min(s + self.eval_batch_size, len(fed.y_test)), "test")
                 for s in range(0, len(fed.y_test), self.eval_batch_size)] if self.algorithm.global_model else []
        units += [(cid, 0, len(d.y_test), "test") for cid, d in enumerate(fed.clients) if len(d.y_test)]
        units += [(cid, 0, len(d.y_val), "val") for cid, d in enumerate(fed.clients)
                  if d.y_val is not None and len(d.y_val)]
        if self.pool is None:
            return [(state.server, state.clients, units)]
        shares: list[list[tuple]] = [[] for _ in range(self.pool.size)]
        load = [0] * self.pool.size
        for unit in sorted(units, key=lambda u: u[2] - u[1], reverse=True):
            i = load.index(min(load))
            shares[i].append(unit)
            load[i] += unit[2] - unit[1]
        every = type(self.algorithm).predict_global is not Algorithm.predict_global  # e.g. an ensemble of clients
        out = []
        for share in shares:
            wanted = set(state.clients) if every and any(u[0] is None for u in share) else {u[0] for u in share}
            out.append((state.server, {cid: state.clients[cid] for cid in wanted if cid is not None}, share))
        return out

    def evaluate(self, state: SimulationState) -> dict[str, Any]:
        """`predict_global` on the global test set; each client's `predict` on its own test set (and on its
        monitored validation set, when it has one: ``client_validation_accuracy``).

        A method without a global model (``algorithm.global_model`` False) has NaN global accuracy and
        loss: no other number stands in for them. Every evaluation batch is scored on its own and the sums
        are taken here in batch order, so the numbers are the same however the batches were spread over
        the workers.
        """
        fed = self.federation
        shares = self._evaluation_shares(state)
        results = self._map(_score_units, shares, lambda i: f"evaluating after round {state.next_round}")
        scores: dict[tuple, list[tuple[int, float]]] = {}
        for (_, _, units), (ok, value) in zip(shares, results):
            if not ok:
                raise value
            scores.update(zip(units, value))
        correct, loss = _total([b for unit in sorted((u for u in scores if u[0] is None), key=lambda u: u[1])
                                for b in scores[unit]])
        per_client = {"test": [math.nan] * fed.num_clients, "val": [math.nan] * fed.num_clients}
        for (target, _, n, part), batches in scores.items():
            if target is not None:
                per_client[part][target] = _total(batches)[0] / n
        valid = [a for a in per_client["test"] if not math.isnan(a)]
        scored = self.algorithm.global_model
        out = {
            "global_accuracy": correct / len(fed.y_test) if scored else math.nan,
            "global_loss": loss / len(fed.y_test) if scored else math.nan,
            "mean_client_accuracy": float(np.mean(valid)) if valid else math.nan,
            "client_accuracy": per_client["test"],
        }
        if any(u[3] == "val" for u in scores):
            out["client_validation_accuracy"] = per_client["val"]
        return out


def run_together(sims: list[Simulation], states: list[SimulationState],
                 on_round_end: list[Callable[[SimulationState], None] | None]) -> list[SimulationState | Exception]:
    """Several runs trained together: in each round every run that has not ended (its rounds done, or stopped at
    its plateau) samples its clients, and the local updates of all the batched runs (:attr:`Simulation.batched`)
    are one batched program (:func:`batched.local_updates`); each run then aggregates, evaluates and logs on its
    own. A run's numbers are those it has alone: its clients' streams, batches, rates and rounds are its own. The
    batched runs must share the algorithm's class and settings but for the local training's rates, the model's
    architecture and the device; a run the batched executor cannot train takes its rounds in the loop, in turn.
    `states`: where each run starts, each from its :meth:`Simulation.initial_state` or
    :meth:`Simulation.resume_state` called right after its own build (their initialisation draws from the stream
    the build left, as in a run alone); `on_round_end[i]` is called with run i's state after each of its rounds.
    Returns each run's final state, or the exception that ended it (a diverged run ends; the others go on)."""
    out: list[SimulationState | Exception] = list(states)
    while True:
        going = [i for i, (sim, st) in enumerate(zip(sims, out)) if isinstance(st, SimulationState)
                 and st.next_round <= sim.num_rounds and not sim.plateaued(st)]
        if not going:
            return out
        t0 = time.perf_counter()
        together = [i for i in going if sims[i].batched]
        rounds = {i: sims[i].messages(out[i]) for i in together}
        tasks = {i: sims[i].tasks(out[i], *rounds[i]) for i in together}
        results = batched.local_updates([task for i in together for task in tasks[i]])
        for i in going:
            try:
                if i in rounds:
                    mine, results = results[:len(tasks[i])], results[len(tasks[i]):]
                    sims[i].end_round(out[i], *rounds[i], mine, t0)
                else:
                    sims[i].run_round(out[i])
            except Exception as err:  # this run ends here; the others go on
                out[i] = err
                continue
            if on_round_end[i] is not None:
                on_round_end[i](out[i])


# ------------------------------------------------------------------ tasks (run here or on a worker)

def _train_client(sim: Simulation, round_idx: int, cid: int, message: Message, client_state: dict[str, Any]
                  ) -> tuple[Message, dict[str, Any]]:
    """Client `cid`'s local update in round `round_idx`, on its own random streams for that round."""
    seed = derive_seed(sim.seed, round_idx, cid)
    sim._seed_global_streams(seed)
    return sim.algorithm.local_update(message, client_state, sim.federation.clients[cid],
                                      torch.Generator().manual_seed(seed))


def _score_units(sim: Simulation, server: dict[str, Any], clients: dict[int, dict[str, Any]],
                 units: list[tuple]) -> list[list[tuple[int, float]]]:
    """Per unit (target, start, stop, part), the per-batch (correct, summed loss) of its samples."""
    out = []
    for target, start, stop, part in units:
        fed = sim.federation
        client = None if target is None else fed.clients[target]
        x, y = (fed.x_test, fed.y_test) if client is None else \
            (client.x_test, client.y_test) if part == "test" else (client.x_val, client.y_val)
        if target is None:
            predict = lambda xb: sim.algorithm.predict_global(server, clients, xb)
        else:
            predict = lambda xb, state=clients[target]: sim.algorithm.predict(server, state, xb)
        out.append(sim._score_batches(predict, target, x[start:stop], y[start:stop]))
    return out


def _total(batches: list[tuple[int, float]]) -> tuple[float, float]:
    """(correct, loss) summed over batches in their order."""
    correct = loss = 0.0
    for c, l in batches:
        correct += c
        loss += l
    return correct, loss
