"""Checks for Lab 3, client drift and SCAFFOLD's control variates.

SCAFFOLD (Karimireddy, Kale, Mohri, Reddi, Stich and Suresh, "SCAFFOLD: Stochastic Controlled Averaging
for Federated Learning", ICML 2020) keeps a control variate ``c`` on the server and one ``c_i`` on each
client (all zero at the start). The student writes its three formulas as plain functions of tensors:

- :func:`check_corrected_gradient`: the local step's corrected gradient ``g + c - c_i``, on hand-made
  tensors of two shapes (a sign error, a forgotten term and a changed input are named);
- :func:`check_control_update`: the client's option II update
  ``c_i+ = c_i - c + (w_global - w_i) / (K lr)``, on a hand-worked case (a flipped drift, a missing or
  wrong-signed ``c``, a division by K or by lr alone, the change returned instead of the new variate are
  named) and against the variate the library's :class:`~fedlab_core.algorithms.scaffold.Scaffold` computes
  after a real local update;
- :func:`check_server_update`: the server's step ``w += server_lr * mean(delta_w)`` and
  ``c += sum(delta_c) / N`` over all N clients, on a hand-worked case (the mean over the sampled clients
  where N is due, the sum or the division by N for the weights, a forgotten ``server_lr``, a lost ``c``
  or a flipped sign are named) and against the library's ``Scaffold.aggregate``;
- :func:`check_scaffold`: :class:`StudentScaffold`, the library's ``Scaffold`` with its three formulas
  replaced by the student's, must give the library's weights and control variates over two rounds with
  partial participation on a tiny federation (same seed).

The experiment runs :class:`StudentScaffold` (and, with its control variates switched off, FedAvg) and
records a measure of client drift per round (:attr:`StudentScaffold.drift`).
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Callable

import numpy as np
import torch
from torch import nn

from ..algorithms import Message, Training
from ..algorithms.scaffold import Scaffold
from ..engine import Simulation
from ..runs import RunConfig, build
from . import LabCheckError, close, passed, require


def _tensor(value, like: torch.Tensor, what: str) -> torch.Tensor:
    """A student's answer as a tensor shaped, typed and placed like `like` (after checking the shape)."""
    if torch.is_tensor(value) and value.shape == like.shape:  # the usual case, on the hot path: no copy
        return value.to(dtype=like.dtype, device=like.device)
    try:
        out = torch.as_tensor(np.asarray(value.detach().cpu() if hasattr(value, "detach") else value,
                                         dtype=np.float64))
    except (TypeError, ValueError) as error:
        raise LabCheckError(f"{what}: expected a tensor of numbers, got {type(value).__name__} ({error})") from None
    require(out.numel() == like.numel(), f"{what}: {out.numel()} numbers, expected {like.numel()} "
                                         f"(shape {tuple(like.shape)})")
    return out.reshape(like.shape).to(dtype=like.dtype, device=like.device)


def _np(x) -> np.ndarray:
    return np.asarray(x.detach().cpu() if hasattr(x, "detach") else x, dtype=np.float64)


def _matches(answer, candidate) -> bool:
    got = _np(answer)
    want = np.asarray(candidate, dtype=np.float64)
    return got.shape == want.shape and bool(np.allclose(got, want, atol=1e-6, rtol=1e-5))


def _name_mistake(answer, mistakes: list[tuple[np.ndarray, str]], what: str) -> None:
    """Raise the message of the first known wrong answer that `answer` equals."""
    for candidate, message in mistakes:
        if _matches(answer, candidate):
            raise LabCheckError(f"{what}: {message}")


def _unchanged(inputs: dict[str, torch.Tensor], copies: dict[str, torch.Tensor], what: str) -> None:
    for name, t in inputs.items():
        require(torch.equal(t, copies[name]), f"{what}: it changed its argument {name} in place; leave the "
                                              f"inputs alone and return a new tensor")


# ---------------------------------------------------------------------------------------- task 1


def check_corrected_gradient(corrected_gradient: Callable) -> None:
    """`corrected_gradient(grad, c, c_i)` must return ``grad + c - c_i``, shaped like grad."""
    what = "corrected_gradient"
    g = torch.tensor([1.0, 2.0, 3.0])
    c = torch.tensor([0.5, 0.0, -1.0])
    c_i = torch.tensor([0.25, 1.0, 1.0])
    inputs = {"grad": g, "c": c, "c_i": c_i}
    copies = {k: v.clone() for k, v in inputs.items()}
    got = corrected_gradient(g, c, c_i)
    require(got is not None, f"{what}: returned None; return the corrected gradient")
    _unchanged({"c": c, "c_i": c_i}, copies, what)
    g, c, c_i = (copies[k].numpy() for k in ("grad", "c", "c_i"))
    _name_mistake(got, [
        (g - c + c_i, "the signs are flipped (g - c + c_i); the step follows g + c - c_i: add the server's c and "
                      "subtract the client's own c_i"),
        (g + c, "the client's own c_i is missing; expected g + c - c_i"),
        (g - c_i, "the server's c is missing; expected g + c - c_i"),
        (g, "the gradient came back unchanged; expected g + c - c_i"),
        (c - c_i, "the gradient g itself is missing; expected g + c - c_i"),
    ], what)
    close(got, g + c - c_i, f"{what} of g = [1, 2, 3], c = [0.5, 0, -1], c_i = [0.25, 1, 1]")
    generator = torch.Generator().manual_seed(3)
    g, c, c_i = (torch.randn(4, 3, generator=generator) for _ in range(3))  # a weight matrix's shape
    expected = g + c - c_i
    got = corrected_gradient(g.clone(), c.clone(), c_i.clone())
    require(tuple(np.shape(_np(got))) == (4, 3), f"{what}: shape {tuple(np.shape(_np(got)))} for a (4, 3) "
                                                 f"gradient; return a tensor shaped like grad")
    close(got, expected, f"{what} of random (4, 3) tensors")
    passed("corrected_gradient: g + c - c_i, shaped like the gradient")


# ---------------------------------------------------------------------------------------- task 2


def _workspace(num_clients: int = 3) -> Simulation:
    """A model and a federation of real 8x8 digits, for local updates that take milliseconds."""
    config = RunConfig(dataset="digits", model="mlp", partition="pathological", classes_per_client=2,
                       num_clients=num_clients, num_rounds=2, seed=0)
    return build(config, torch.device("cpu"))


def check_control_update(control_update: Callable) -> None:
    """`control_update(c_i, c, w_global, w_local, num_steps, lr)` must return option II's new variate
    ``c_i - c + (w_global - w_local) / (num_steps * lr)``."""
    what = "control_update"
    c_i, c = torch.tensor([1.0, -2.0]), torch.tensor([0.5, 1.0])
    w_global, w_local = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0])
    steps, lr = 5, 0.1
    inputs = {"c_i": c_i, "c": c, "w_global": w_global, "w_local": w_local}
    copies = {k: v.clone() for k, v in inputs.items()}
    got = control_update(c_i, c, w_global, w_local, steps, lr)
    require(got is not None, f"{what}: returned None; return the client's new control variate")
    _unchanged(inputs, copies, what)
    ci, cc, wg, wl = (copies[k].numpy() for k in ("c_i", "c", "w_global", "w_local"))
    drift = (wg - wl) / (steps * lr)
    _name_mistake(got, [
        (ci - cc - drift, "the drift term has the wrong sign; it is (w_global - w_local) / (K lr), the mean "
                          "gradient along the client's path (w_local = w_global - K lr * mean gradient)"),
        (ci + drift, "the server's c is missing; expected c_i - c + (w_global - w_local) / (K lr)"),
        (ci + cc + drift, "c is added where it is subtracted; expected c_i - c + (w_global - w_local) / (K lr)"),
        (ci - cc + (wg - wl) / steps, "divided by K only; the drift is divided by K * lr, the number of steps "
                                      "times the learning rate"),
        (ci - cc + (wg - wl) / lr, "divided by lr only; the drift is divided by K * lr, the number of steps "
                                   "times the learning rate"),
        (ci - cc + (wg - wl) * steps * lr, "multiplied by K * lr where it divides; expected "
                                           "c_i - c + (w_global - w_local) / (K lr)"),
        (drift - cc, "returned the change c_i+ - c_i (or forgot c_i); return the new variate "
                     "c_i - c + (w_global - w_local) / (K lr)"),
        (drift, "returned only the drift (w_global - w_local) / (K lr); expected c_i - c + that"),
    ], what)
    close(got, ci - cc + drift, f"{what} with c_i = [1, -2], c = [0.5, 1], w_global = [2, 0], w_local = [1, 1], "
                                f"K = 5, lr = 0.1")

    # against the library: a real local update from non-zero variates
    sim = _workspace()
    steps, lr = 4, 0.1
    algo = Scaffold(Training(lr=lr, local_steps=steps, batch_size=16))
    server = algo.init(sim.model, sim.federation)
    generator = torch.Generator().manual_seed(1)
    server["control"] = 0.1 * torch.randn(server["control"].shape, generator=generator)
    client = {**algo.init_client(0), "control": 0.1 * torch.randn(server["control"].shape, generator=generator)}
    message = algo.server_message(server, 0)
    upload, new_state = algo.local_update(message, client, sim.federation.clients[0],
                                          torch.Generator().manual_seed(2))
    w_local = server["weights"] + upload.tensors["delta"]
    got = control_update(client["control"].clone(), server["control"].clone(), server["weights"].clone(),
                         w_local, steps, lr)
    close(got, new_state["control"], f"{what} after {steps} real local steps (lr {lr}), against the library's "
                                     f"Scaffold", atol=1e-4, rtol=1e-4)
    passed("control_update: option II, c_i - c + (w_global - w_local) / (K lr), as the library's Scaffold")


# ---------------------------------------------------------------------------------------- task 3


def _pair(answer, what: str):
    require(isinstance(answer, (tuple, list)) and len(answer) == 2,
            f"{what}: return a pair (new_w, new_c), got {type(answer).__name__}")
    return answer


def check_server_update(server_update: Callable) -> None:
    """`server_update(w, c, delta_ws, delta_cs, num_clients, server_lr)` must return
    ``(w + server_lr * mean(delta_ws), c + sum(delta_cs) / num_clients)``."""
    what = "server_update"
    w, c = torch.tensor([1.0, 1.0]), torch.tensor([0.0, 2.0])
    dws = [torch.tensor([3.0, 0.0]), torch.tensor([0.0, 3.0]), torch.tensor([3.0, 6.0])]
    dcs = [torch.tensor([1.0, 1.0]), torch.tensor([3.0, -1.0]), torch.tensor([1.0, 5.0])]
    n, lr = 5, 0.5
    inputs = {"w": w, "c": c, **{f"delta_ws[{k}]": t for k, t in enumerate(dws)},
              **{f"delta_cs[{k}]": t for k, t in enumerate(dcs)}}
    copies = {k: v.clone() for k, v in inputs.items()}
    new_w, new_c = _pair(server_update(w, c, dws, dcs, n, lr), what)
    _unchanged(inputs, copies, what)
    w0, c0 = w.numpy(), c.numpy()
    sum_w, sum_c = sum(d.numpy() for d in dws), sum(d.numpy() for d in dcs)
    case = (" (w = [1, 1], c = [0, 2], three sampled clients out of N = 5, server_lr = 0.5, "
            "delta_ws [3, 0], [0, 3], [3, 6], delta_cs [1, 1], [3, -1], [1, 5])")
    _name_mistake(new_c, [
        (c0 + sum_c / 3, "new_c used the mean over the 3 sampled clients; c must stay the mean of ALL N client "
                         "variates, so add sum(delta_cs) / N (the clients not sampled changed by 0)" + case),
        (c0 + sum_c, "new_c added the plain sum of delta_cs; divide it by N, the number of all clients" + case),
        (sum_c / n, "new_c lost the old c; expected c + sum(delta_cs) / N" + case),
        (c0 - sum_c / n, "new_c subtracted the changes; expected c + sum(delta_cs) / N" + case),
        (c0 + lr * sum_c / n, "new_c took the server_lr step; server_lr scales the weights' step only, "
                              "expected c + sum(delta_cs) / N" + case),
    ], what)
    _name_mistake(new_w, [
        (w0 + lr * sum_w / n, "new_w divided the summed updates by N; the weights step by the mean over the "
                              "sampled clients, w + server_lr * mean(delta_ws)" + case),
        (w0 + sum_w / n, "new_w divided the summed updates by N and forgot server_lr; expected "
                         "w + server_lr * mean(delta_ws)" + case),
        (w0 + lr * sum_w, "new_w used the sum of the updates; expected w + server_lr * mean(delta_ws)" + case),
        (w0 + sum_w / 3, "new_w forgot server_lr; expected w + server_lr * mean(delta_ws)" + case),
        (w0 - lr * sum_w / 3, "new_w subtracted the mean update; delta_w = w_i - w_global already points "
                              "downhill, expected w + server_lr * mean(delta_ws)" + case),
        (lr * sum_w / 3, "new_w lost the old weights; expected w + server_lr * mean(delta_ws)" + case),
    ], what)
    close(new_w, w0 + lr * sum_w / 3, "new_w" + case)
    close(new_c, c0 + sum_c / n, "new_c" + case)

    # against the library's aggregate, on random uploads
    algo = Scaffold(server_lr=0.7)
    model = nn.Linear(3, 2)
    num_clients = 7
    state = algo.init(model, SimpleNamespace(num_clients=num_clients))
    generator = torch.Generator().manual_seed(4)
    state["weights"], state["control"] = (torch.randn(8, generator=generator) for _ in range(2))
    uploads = [(k, Message({"delta": torch.randn(8, generator=generator),
                            "delta_control": torch.randn(8, generator=generator)}, num_samples=10 * k + 1))
               for k in (0, 2, 5)]
    expected = algo.aggregate(state, uploads, 1)
    new_w, new_c = _pair(server_update(state["weights"].clone(), state["control"].clone(),
                                       [m.tensors["delta"].clone() for _, m in uploads],
                                       [m.tensors["delta_control"].clone() for _, m in uploads],
                                       num_clients, 0.7), what)
    close(new_w, expected["weights"], f"{what}'s new_w for 3 random uploads of 7 clients, against the library")
    close(new_c, expected["control"], f"{what}'s new_c for 3 random uploads of 7 clients, against the library")
    passed("server_update: w + server_lr * mean(delta_w) over the sampled clients, c + sum(delta_c) / N")


# ---------------------------------------------------------------------------------------- assembled


class StudentScaffold(Scaffold):
    """The library's :class:`Scaffold` with its three formulas replaced by the student's functions.

    Parameters
    ----------
    corrected_gradient, control_update, server_update : the student's functions (tasks 1 to 3).
    training : local training; its lr enters the control-variate update.
    server_lr : the server's step on the mean update.
    control : False switches the control variates off (they stay zero and the gradient is not
        corrected): FedAvg with the plain mean of the updates, for comparison.

    After each round :attr:`drift` gains a dict: ``round``, ``distance`` (the mean over the sampled clients
    of ``||w_i - w_global||``, how far local training moved them) and ``spread`` (the mean of
    ``||w_i - mean_j w_j||``, how far apart the clients' local models ended up).
    """

    name = "student_scaffold"

    def __init__(self, corrected_gradient: Callable, control_update: Callable, server_update: Callable,
                 training: Training | None = None, server_lr: float = 1.0, control: bool = True):
        super().__init__(training, server_lr=server_lr)
        self.corrected_gradient_fn, self.control_update_fn, self.server_update = (
            corrected_gradient, control_update, server_update)
        self.control = control
        self.drift: list[dict] = []

    def server_message(self, server_state, cid) -> Message:
        if self.control:
            return super().server_message(server_state, cid)
        return Message({"weights": server_state["weights"]})  # FedAvg: the model only

    def local_update(self, message, client_state, data, rng):
        if self.control:
            return super().local_update(message, client_state, data, rng)
        zero = torch.zeros_like(client_state["control"])  # FedAvg: no correction, the variates stay zero
        upload, state = super().local_update(Message({"weights": message.tensors["weights"], "control": zero}),
                                             client_state, data, rng)
        del upload.tensors["delta_control"]  # FedAvg sends its update only
        return upload, state

    def corrected_gradient(self, grad, c, c_i):
        if not self.control:
            return grad
        return _tensor(self.corrected_gradient_fn(grad.clone(), c.clone(), c_i.clone()), grad, "corrected_gradient")

    def control_update(self, c_i, c, w_global, w_local, num_steps, lr):
        if not self.control:
            return c_i.clone()
        return _tensor(self.control_update_fn(c_i.clone(), c.clone(), w_global.clone(), w_local.clone(), num_steps,
                                              lr), c_i, "control_update")

    def aggregate(self, server_state, uploads, round_idx):
        w, c = server_state["weights"], server_state["control"]
        mask = self.param_mask
        deltas = [m.tensors["delta"] for _, m in uploads]
        mean_delta = torch.stack(deltas).mean(0)
        new_w, new_c = self.server_update(w[mask].clone(), c.clone(), [d[mask].clone() for d in deltas],
                                          [m.tensors["delta_control"].clone() if self.control
                                           else torch.zeros_like(c) for _, m in uploads],
                                          self.federation.num_clients, self.server_lr)
        full_w = w + mean_delta  # buffers (batch-norm statistics) take the plain average
        full_w[mask] = _tensor(new_w, w[mask], "server_update's new_w")
        new_c = _tensor(new_c, c, "server_update's new_c")
        self.drift.append({"round": round_idx,
                           "distance": float(np.mean([d[mask].norm().item() for d in deltas])),
                           "spread": float(np.mean([(d - mean_delta)[mask].norm().item() for d in deltas]))})
        return {**server_state, "weights": full_w, "control": new_c}


def check_scaffold(corrected_gradient: Callable, control_update: Callable, server_update: Callable) -> None:
    """:class:`StudentScaffold` built from the three functions must give the library's Scaffold's server
    weights, server variate and every client's variate after each of two rounds (four clients, two sampled
    per round, three local steps, same seed)."""
    training = Training(lr=0.1, local_steps=3, batch_size=16)
    states = {}
    for who, algo in (("library", Scaffold(training, server_lr=0.8)),
                      ("yours", StudentScaffold(corrected_gradient, control_update, server_update, training,
                                                server_lr=0.8))):
        built = _workspace(num_clients=4)
        sim = Simulation(algo, built.federation, built.model, seed=0, num_rounds=2, clients_per_round=2,
                         progress=False)
        state = sim.initial_state()
        states[who] = []
        for _ in range(2):
            sim.run_round(state)
            states[who].append(({k: v.clone() for k, v in state.server.items() if torch.is_tensor(v)},
                                {cid: s["control"].clone() for cid, s in state.clients.items()},
                                sim.sample(state.next_round - 1)))
    for r, ((lib_server, lib_clients, picked), (server, clients, _)) in enumerate(
            zip(states["library"], states["yours"]), start=1):
        for cid in lib_clients:
            close(clients[cid], lib_clients[cid], f"round {r} (clients {picked} sampled of 4): client {cid}'s "
                                                  f"control variate against the library's Scaffold",
                  atol=1e-4, rtol=1e-3)
        close(server["control"], lib_server["control"], f"round {r} (clients {picked} sampled of 4): the server's "
                                                        f"control variate against the library's Scaffold",
              atol=1e-4, rtol=1e-3)
        close(server["weights"], lib_server["weights"], f"round {r} (clients {picked} sampled of 4): the global "
                                                        f"weights against the library's Scaffold",
              atol=1e-4, rtol=1e-3)
    passed("SCAFFOLD from your three functions: the library's weights and control variates over two rounds")
