"""Checks for Lab 4, DisTrans's offsets on its two toy problems.

DisTrans (Yuan et al., "Addressing Heterogeneity in Federated Learning via Distributional
Transformation", ECCV 2022, Sec. 3, Fig. 2) gives each client an offset it adds to its own inputs,
``x_offset = (1 + p) x + q``, learned with the shared model and kept by the client. The student writes
the loss of the non-convex toy with an offset, the brute-force best offset for every model on a grid, and
one client's local steps on the linear toy (the offset first, then the model, as in DisTrans's Algorithm
1); the checks compare them with :mod:`fedlab_core.toys` on small cases. :func:`fedavg_with` runs FedAvg
on the linear toy with the student's local steps, for the experiment.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from .. import toys
from . import LabCheckError, close, passed, require


def _array(value, what: str) -> np.ndarray:
    try:
        return np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as error:
        raise LabCheckError(f"{what}: expected an array of numbers, got {type(value).__name__} ({error})") from None


def check_cosine_offset_loss(loss: Callable) -> None:
    """`loss(x, y, w, q, p)`: the mean squared error of ``cos(w ((1 + p) x + q))`` over the samples, with
    `w` and `q` broadcast against each other ((W, 1) and (1, Q) give a (W, Q) table)."""
    client = toys.cosine_clients(w_true=(1.5,), num_samples=50, seed=3)[0]
    grid_w, grid_q = np.linspace(-2, 2, 5)[:, None], np.linspace(-1, 1, 3)[None, :]
    for w, q, p, what in ((1.5, 0.3, 0.0, "loss(x, y, w=1.5, q=0.3, p=0)"),
                          (grid_w, grid_q, 0.5, "loss(x, y, w, q, p=0.5) on a (5, 3) grid of (w, q)")):
        got = _array(loss(client.x, client.y, w, q, p), what)
        expected = toys.cosine_loss(client, w, p, q)
        require(got.shape == expected.shape, f"{what}: shape {got.shape}, expected {expected.shape}, one loss per "
                                             "(w, q) pair (average over the samples, the last axis)")
        if np.allclose(got, expected):
            continue
        ww, qq = np.broadcast_arrays(np.asarray(w, dtype=np.float64), np.asarray(q, dtype=np.float64))
        if np.allclose(got, expected * client.y.size):
            raise LabCheckError(f"{what}: the sum of the squared errors; expected their mean over the samples")
        if np.allclose(got, np.mean((np.cos(ww * qq)[..., None] - client.y) ** 2, axis=-1)):
            raise LabCheckError(f"{what}: the offset replaced the input; the model sees x + (p x + q), not q alone")
        if p and np.allclose(got, toys.cosine_loss(client, w, 0.0, q)):
            raise LabCheckError(f"{what}: equals the loss with p = 0; scale the input by (1 + p)")
        close(got, expected, what)
    passed("cosine offset loss: mean squared error of cos(w ((1 + p) x + q)), broadcast over w and q")


def check_best_offset(best: Callable, loss: Callable) -> None:
    """`best(x, y, w_grid, q_grid, p, loss)` -> ``(q_best, loss_best)``, both (W,): for every ``w`` of the
    grid, the ``q`` of the grid with the lowest loss, and that loss (ties to the first)."""
    client = toys.cosine_clients(w_true=(2.0,), num_samples=80, seed=4)[0]
    w_grid, q_grid = np.linspace(0.2, 3.0, 8), np.linspace(-np.pi, np.pi, 41)
    out = best(client.x, client.y, w_grid, q_grid, 0.0, loss)
    require(isinstance(out, tuple) and len(out) == 2, "best_offset: return the pair (q_best, loss_best)")
    q_best, loss_best = (_array(v, "best_offset") for v in out)
    want_q, want_loss = toys.best_offset(client, w_grid, 0.0, q_grid)
    require(q_best.shape == w_grid.shape, f"best_offset: q_best has shape {q_best.shape}, expected {w_grid.shape} "
                                          "(one offset per w: minimise over the q axis)")
    if np.all(np.isin(q_best, np.arange(q_grid.size))) and not np.allclose(q_best, want_q):
        raise LabCheckError("best_offset: q_best holds grid indices; return the offsets themselves (q_grid[index])")
    close(loss_best, want_loss, "best_offset's loss_best (the lowest loss over q for each w)")
    close(q_best, want_q, "best_offset's q_best")
    passed("best offset: for every w, the q with the lowest loss")


def _library_round(clients, steps: int, lr: float, lr_offset: float, p: float):
    """The library's first round of FedAvg with offsets and full-batch steps: (global w, clients' q)."""
    run = toys.linear_fedavg(clients, num_rounds=2, local_steps=steps, lr=lr, offsets=True, p=p,
                             lr_offset=lr_offset, batch_size=None, window=1)
    return run.w[1], run.q[1]


def check_local_steps(local_steps: Callable) -> None:
    """`local_steps(w, q, x, y, p, lr, lr_offset, steps)` -> ``(w_k, q_k)``: `steps` full-batch gradient
    steps on ``mean((w . ((1 + p) x + q) - y)^2)``, each updating the offset first (model fixed), then the
    model (with the new offset), as :func:`fedlab_core.toys.linear_fedavg` does."""
    clients = toys.linear_clients(num_samples=30, seed=5)
    c = clients[0]
    w0, q0 = np.array([0.5, -0.3]), np.array([0.2, 0.1])
    a = 1.5
    residual = a * c.x @ w0 + q0 @ w0 - c.y
    q1 = q0 - 0.1 * 2.0 * residual.mean() * w0
    residual = a * c.x @ w0 + q1 @ w0 - c.y
    w1 = w0 - 0.05 * 2.0 * ((a * c.x + q1) * residual[:, None]).mean(axis=0)
    out = local_steps(w0.copy(), q0.copy(), c.x, c.y, 0.5, 0.05, 0.1, 1)
    require(isinstance(out, tuple) and len(out) == 2, "local_steps: return the pair (w_k, q_k)")
    w_got, q_got = (_array(v, "local_steps") for v in out)
    require(q_got.shape == q0.shape and w_got.shape == w0.shape,
            f"local_steps: shapes {w_got.shape} and {q_got.shape}, expected {w0.shape} for both")
    if not np.allclose(q_got, q1):
        hint = ""
        if np.allclose(q_got, q0 - 0.1 * 2.0 * residual.mean() * np.ones(2)) or \
                np.allclose(q_got, q0 - 0.1 * 2.0 * (a * c.x @ w0 + q0 @ w0 - c.y).mean()):
            hint = "; the gradient of the loss with respect to q is 2 mean(residual) w (the chain rule through w . q)"
        raise LabCheckError(f"local_steps: the offset after one step is {np.round(q_got, 5)}, expected "
                            f"{np.round(q1, 5)}{hint}")
    if not np.allclose(w_got, w1):
        stale = w0 - 0.05 * 2.0 * ((a * c.x + q0) * (a * c.x @ w0 + q0 @ w0 - c.y)[:, None]).mean(axis=0)
        hint = ("; the model's step must use the offset just updated (offset first, then the model)"
                if np.allclose(w_got, stale) else "")
        raise LabCheckError(f"local_steps: the model after one step is {np.round(w_got, 5)}, expected "
                            f"{np.round(w1, 5)}{hint}")
    want_w, want_q = _library_round(clients, steps=7, lr=0.05, lr_offset=0.1, p=0.5)
    locals_ = [local_steps(np.zeros(2), np.zeros(2), k.x, k.y, 0.5, 0.05, 0.1, 7) for k in clients]
    close(np.array([q for _, q in locals_]), want_q, "the clients' offsets after 7 steps (the library's round)")
    close(np.mean([w for w, _ in locals_], axis=0), want_w, "the mean of the clients' models after 7 steps")
    passed("local steps: the offset, then the model, as the library's linear FedAvg with offsets")


def fedavg_with(local_steps: Callable, clients: Sequence[toys.ToyClient], num_rounds: int, steps: int,
                lr: float, lr_offset: float, p: float, offsets: bool) -> np.ndarray:
    """FedAvg on the linear toy with the student's `local_steps` (full batch): every round each client
    starts from the global ``w`` and its own ``q`` (kept at zero without `offsets`), the server averages
    the ``w``; returns the mean training loss of the global model with each client's offset, (R+1,)."""
    dim = clients[0].x.shape[1]
    w, q = np.zeros(dim), np.zeros((len(clients), dim))
    losses = [toys._linear_losses(clients, w, q, p).mean()]
    for _ in range(num_rounds):
        local = []
        for k, c in enumerate(clients):
            w_k, q_k = local_steps(w.copy(), q[k].copy(), c.x, c.y, p, lr, lr_offset if offsets else 0.0, steps)
            local.append(np.asarray(w_k, dtype=np.float64))
            q[k] = q_k
        w = np.mean(local, axis=0)
        losses.append(toys._linear_losses(clients, w, q, p).mean())
    return np.array(losses)
