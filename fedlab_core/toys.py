"""The motivating toy problems of DisTrans (Yuan et al., "Addressing Heterogeneity in Federated Learning
via Distributional Transformation", ECCV 2022, Sec. 3, Fig. 2): why a per-client input offset might help.

Two clients, one shared model, and an *offset* that each client adds to its own inputs and keeps:

    x_offset = x + (p x + q) = (1 + p) x + q,

with ``p`` one fixed number shared by both clients and ``q`` the client's own offset. The paper gives
only "the offsets are px+q"; adding them to the input (rather than replacing the input) is our
reading, and it matches DisTrans' first input channel, ``(1 - a) x + a t`` (Eq. 1), with ``p = -a``
and ``q = a t``.

- (a) a non-convex problem: ``y = cos(w_k x) + noise`` at client k, model ``cos(w x_offset)``; for every
  ``w`` on a grid each client picks its ``q`` by brute force (:func:`cosine_loss_curves`).
- (b) linear regression: ``y = w_k . x + noise`` with ``x`` in R^2, model ``w . x_offset``, trained by
  FedAvg with ``q`` learned by SGD at each client and never averaged (:func:`linear_fedavg`).

Both data generators take optional per-client input ``shifts``: client k then observes ``x + m_k``
while its label still depends on ``x``. That is the heterogeneity an input offset can undo exactly,
a useful contrast to the paper's different-``w_k`` setting. The ``plot_*`` functions draw the panels
of Fig. 2. Everything is plain numpy and runs in seconds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = [
    "ToyClient", "cosine_clients", "cosine_loss", "best_offset", "cosine_loss_curves", "curve_consistency",
    "linear_clients", "LinearFedAvg", "linear_fedavg", "linear_global_loss", "loss_by_sum", "fedavg_summary",
    "plot_cosine_curves", "plot_fedavg_rounds", "plot_loss_by_sum",
]


@dataclass(frozen=True)
class ToyClient:
    """One client's training data: inputs ``x`` of shape (n,) or (n, d) and targets ``y`` of shape (n,)."""

    x: np.ndarray
    y: np.ndarray


def _check_positive(**values) -> None:
    for name, value in values.items():
        if value is None or value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")


def _shifts(shifts, num_clients: int, dim: int) -> np.ndarray:
    """Per-client input shifts as a (clients, dim) array; zeros when not given."""
    if shifts is None:
        return np.zeros((num_clients, dim))
    if np.size(shifts) != num_clients * dim:
        raise ValueError(f"shifts must hold one {dim}-vector per client ({num_clients} clients)")
    return np.asarray(shifts, dtype=np.float64).reshape(num_clients, dim)


# ----------------------------------------------------------------------------- (a) non-convex: cos(w x)

def cosine_clients(w_true: Sequence[float] = (1.0, 2.0), num_samples: int = 200, noise: float = 0.1,
                   seed: int = 0, shifts: Sequence[float] | None = None) -> list[ToyClient]:
    """Data of the non-convex toy: client k holds ``y = cos(w_true[k] x) + eps``.

    The default frequencies 1 and 2 give each client its own clear valley in the loss against ``w``,
    and both valleys fit on one grid over a few periods of the cosine on the data.

    Parameters
    ----------
    w_true : one true frequency per client.
    num_samples : training samples per client; ``x ~ N(0, 1)``.
    noise : standard deviation of the Gaussian label noise ``eps``.
    seed : the data are a pure function of the seed.
    shifts : optional per-client input shift ``m_k``: the client observes ``x + m_k``, the label is
        still ``cos(w_true[k] x) + eps``.
    """
    _check_positive(num_samples=num_samples)
    if noise < 0:
        raise ValueError(f"noise must be >= 0, got {noise}")
    w_true = np.asarray(w_true, dtype=np.float64)
    m = _shifts(shifts, len(w_true), 1)[:, 0]
    rng = np.random.default_rng(seed)
    clients = []
    for k, w in enumerate(w_true):
        x = rng.standard_normal(num_samples)                       # (n,)
        y = np.cos(w * x) + noise * rng.standard_normal(num_samples)
        clients.append(ToyClient(x + m[k], y))
    return clients


def cosine_loss(client: ToyClient, w, p: float = 0.0, q=0.0) -> np.ndarray:
    """Mean squared training loss of the model ``cos(w ((1 + p) x + q))`` on one client.

    ``w`` and ``q`` are broadcast against each other; the result has their broadcast shape, e.g.
    w of shape (W, 1) and q of shape (1, Q) give a (W, Q) table. ``p = 0, q = 0`` is the model
    without offset.
    """
    w, q = np.broadcast_arrays(np.asarray(w, dtype=np.float64), np.asarray(q, dtype=np.float64))
    x_offset = (1.0 + p) * client.x + q[..., None]                 # (..., n)
    residual = np.cos(w[..., None] * x_offset) - client.y          # (..., n)
    return np.mean(residual ** 2, axis=-1)                         # (...)


def best_offset(client: ToyClient, w_grid, p: float = 0.0, q_grid=None, q_points: int = 256,
                chunk: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """Brute-force offset: for every ``w`` the ``q`` with the lowest loss of ``cos(w ((1 + p) x + q))``.

    With ``q_grid`` (shape (Q,)) every ``w`` searches that fixed grid. Without it the search is
    exhaustive up to resolution: for ``w != 0`` the loss is periodic in ``q`` with period ``2 pi / |w|``,
    so ``q_points`` values spread evenly over one period cover every distinct offset (``q`` then lies in
    ``[-pi/|w|, pi/|w|)``); at ``w = 0`` the offset has no effect and ``q = 0``. Returns
    ``(q_best, loss)``, both of shape (W,); ties go to the first candidate. A (chunk, Q, n) block is
    evaluated at a time, so memory stays small for fine grids.
    """
    w_grid = np.asarray(w_grid, dtype=np.float64).ravel()
    if w_grid.size == 0:
        raise ValueError("w_grid must be non-empty")
    if q_grid is None:
        _check_positive(q_points=q_points)
        phases = np.linspace(-np.pi, np.pi, q_points, endpoint=False)              # (Q,)
        safe = np.where(w_grid == 0.0, 1.0, np.abs(w_grid))
        candidates = np.where(w_grid[:, None] == 0.0, 0.0, phases[None, :] / safe[:, None])   # (W, Q)
    else:
        q_grid = np.asarray(q_grid, dtype=np.float64).ravel()
        if q_grid.size == 0:
            raise ValueError("q_grid must be non-empty")
        candidates = np.broadcast_to(q_grid, (w_grid.size, q_grid.size))
    q_best, loss = np.empty_like(w_grid), np.empty_like(w_grid)
    for start in range(0, w_grid.size, chunk):
        rows = slice(start, start + chunk)
        table = cosine_loss(client, w_grid[rows, None], p, candidates[rows])        # (chunk, Q)
        pick = np.argmin(table, axis=1)
        q_best[rows] = candidates[rows][np.arange(len(pick)), pick]
        loss[rows] = table[np.arange(len(pick)), pick]
    return q_best, loss


def cosine_loss_curves(clients: Sequence[ToyClient], w_grid, p: float = 0.0, q_grid=None,
                       q_points: int = 256) -> dict[str, np.ndarray]:
    """Each client's loss against ``w``, without offset and with its own brute-force offset.

    Returns ``{"plain": (K, W), "offset": (K, W), "q": (K, W)}``: the loss of ``cos(w x)``, the
    loss of ``cos(w ((1 + p) x + q))`` with the best ``q`` for that client and that ``w``
    (:func:`best_offset`), and that ``q``.
    """
    w_grid = np.asarray(w_grid, dtype=np.float64)
    plain = np.stack([cosine_loss(c, w_grid) for c in clients])
    found = [best_offset(c, w_grid, p, q_grid, q_points) for c in clients]
    return {"plain": plain, "offset": np.stack([f[1] for f in found]), "q": np.stack([f[0] for f in found])}


def curve_consistency(w_grid, losses) -> dict[str, float]:
    """How much the clients' loss curves disagree; 0 means they coincide.

    ``argmin_gap``: the spread (max - min) of the clients' minimising ``w`` on the grid, i.e. how far
    apart the models each client would choose are. ``mean_abs_gap``: the spread of the losses at each
    ``w``, averaged over the grid (``mean |L_1(w) - L_2(w)|`` for two clients). ``relative_gap``:
    ``mean_abs_gap`` divided by the mean loss, so that curves which are merely lower do not count as
    more consistent.
    """
    w_grid, losses = np.asarray(w_grid), np.asarray(losses)              # (W,), (K, W)
    if losses.ndim != 2 or losses.shape[1] != w_grid.size or losses.shape[0] < 2:
        raise ValueError("losses must be (clients >= 2, len(w_grid))")
    argmins = w_grid[np.argmin(losses, axis=1)]
    gap = float(np.mean(losses.max(axis=0) - losses.min(axis=0)))
    return {"argmin_gap": float(argmins.max() - argmins.min()), "mean_abs_gap": gap,
            "relative_gap": gap / float(np.mean(losses))}


# ----------------------------------------------------------------------------- (b) linear regression + FedAvg

def linear_clients(w_true: Sequence[Sequence[float]] = ((1.0, 2.0), (-2.0, 0.5)), num_samples: int = 200,
                   noise: float = 0.1, seed: int = 0, shifts=None) -> list[ToyClient]:
    """Data of the linear toy: client k holds ``y = w_true[k] . x + eps`` with ``x ~ N(0, I)``.

    The default true models differ in both entries and their sums (3 and -1.5, the x-axis of
    DisTrans' Fig. 2b) lie far apart, so one shared ``w`` is a clear compromise.

    ``w_true`` is (clients, d); ``shifts`` optional (clients, d): client k then observes ``x + m_k``
    while its label is still ``w_true[k] . x + eps``. Deterministic by ``seed``.
    """
    _check_positive(num_samples=num_samples)
    if noise < 0:
        raise ValueError(f"noise must be >= 0, got {noise}")
    w_true = np.atleast_2d(np.asarray(w_true, dtype=np.float64))       # (K, d)
    m = _shifts(shifts, *w_true.shape)
    rng = np.random.default_rng(seed)
    clients = []
    for k, w in enumerate(w_true):
        x = rng.standard_normal((num_samples, w.size))               # (n, d)
        y = x @ w + noise * rng.standard_normal(num_samples)         # (n,)
        clients.append(ToyClient(x + m[k], y))
    return clients


@dataclass(frozen=True)
class LinearFedAvg:
    """The record of :func:`linear_fedavg`; index 0 is the initial state, index r the state after round r.

    ``w``: (R+1, d) global model. ``q``: (R+1, K, d) the clients' offsets. ``client_loss``: (R+1, K)
    each client's training loss of the global model with its own offset. ``loss``: (R+1,) their mean.
    ``drift``: (R,) mean distance of the clients' local models from their average at the end of each
    round (0 when the clients agree). ``converged``: the mean loss of the last ``window`` rounds differs
    from that of the ``window`` rounds before by less than ``tol`` (averaging over a window keeps the
    jitter of constant-step SGD from counting as non-convergence).
    """

    w: np.ndarray
    q: np.ndarray
    client_loss: np.ndarray
    loss: np.ndarray
    drift: np.ndarray
    converged: bool


def _linear_losses(clients, w, q, p) -> np.ndarray:
    """(K,) mean squared loss of ``w . ((1 + p) x + q_k)`` on each client."""
    return np.array([np.mean(((1.0 + p) * c.x @ w + q_k @ w - c.y) ** 2) for c, q_k in zip(clients, q)])


def linear_fedavg(clients: Sequence[ToyClient], num_rounds: int = 50, local_steps: int = 10, lr: float = 0.05,
                  offsets: bool = False, p: float = 0.0, lr_offset: float = 0.05, batch_size: int | None = 16,
                  seed: int = 0, tol: float = 1e-3, window: int = 10) -> LinearFedAvg:
    """FedAvg on the linear toy, with or without per-client offsets.

    Every round each client starts from the global ``w`` and takes ``local_steps`` SGD steps on
    mini-batches of ``batch_size`` (``None``: the full local set, i.e. gradient descent) of the loss
    ``mean((w . ((1 + p) x + q_k) - y)^2)``. With ``offsets`` each step first updates the client's
    ``q_k`` (model fixed, step ``lr_offset``), then ``w`` (new offset fixed), the order of DisTrans'
    Algorithm 1; ``q_k`` starts at zero and stays with the client (no offset aggregation). The server
    takes the unweighted mean of the clients' ``w``. Without offsets ``q_k`` stays zero and ``p`` still
    scales the input, so the two runs differ only by the learned ``q``.
    """
    _check_positive(num_rounds=num_rounds, local_steps=local_steps, lr=lr, window=window, tol=tol)
    if num_rounds < 2 * window:
        raise ValueError(f"num_rounds={num_rounds} is too few to judge convergence over window={window} "
                         f"(need at least {2 * window})")
    if batch_size is not None:
        _check_positive(batch_size=batch_size)
    if offsets:
        _check_positive(lr_offset=lr_offset)
    if not clients:
        raise ValueError("clients must not be empty")
    rng = np.random.default_rng(seed)
    a = 1.0 + p
    dim = clients[0].x.shape[1]
    w = np.zeros(dim)
    q = np.zeros((len(clients), dim))
    ws, qs, losses, drift = [w.copy()], [q.copy()], [_linear_losses(clients, w, q, p)], []
    for _ in range(num_rounds):
        local = []
        for k, c in enumerate(clients):
            w_k, q_k = w.copy(), q[k].copy()
            for _ in range(local_steps):
                idx = slice(None) if batch_size is None else rng.choice(len(c.y), size=min(batch_size, len(c.y)),
                                                                         replace=False)
                x, y = c.x[idx], c.y[idx]                                        # (B, d), (B,)
                if offsets:
                    residual = a * x @ w_k + q_k @ w_k - y                         # (B,)
                    q_k = q_k - lr_offset * 2.0 * residual.mean() * w_k           # d/dq of the mean squared loss
                residual = a * x @ w_k + q_k @ w_k - y
                w_k = w_k - lr * 2.0 * ((a * x + q_k) * residual[:, None]).mean(axis=0)
            local.append(w_k)
            q[k] = q_k
        w = np.mean(local, axis=0)
        drift.append(float(np.mean(np.linalg.norm(np.array(local) - w, axis=1))))
        ws.append(w.copy())
        qs.append(q.copy())
        losses.append(_linear_losses(clients, w, q, p))
    client_loss = np.array(losses)                                               # (R+1, K)
    loss = client_loss.mean(axis=1)
    change = abs(loss[-window:].mean() - loss[-2 * window:-window].mean())
    return LinearFedAvg(np.array(ws), np.array(qs), client_loss, loss, np.array(drift), bool(change < tol))


def _quadratic(clients, p: float, offsets: bool) -> tuple[np.ndarray, np.ndarray, float]:
    """``(A, b, c)`` with global loss ``w A w - 2 b . w + c`` (mean over clients).

    With offsets each client's best ``q`` for a given ``w != 0`` turns ``w . q`` into any bias, and the
    best bias centres the residual, so the loss is that of the centred data.
    """
    a = 1.0 + p
    A, b, c = 0.0, 0.0, 0.0
    for client in clients:
        x, y = a * client.x, client.y
        if offsets:
            x, y = x - x.mean(axis=0), y - y.mean()
        A = A + x.T @ x / len(y)
        b = b + x.T @ y / len(y)
        c = c + y @ y / len(y)
    k = len(clients)
    return A / k, b / k, c / k


def linear_global_loss(clients: Sequence[ToyClient], w, p: float = 0.0, offsets: bool = False) -> np.ndarray:
    """Mean over clients of the training loss of the global model ``w`` (shape (..., d)).

    Without offsets ``q = 0``; with offsets each client uses its best ``q`` for that ``w`` (exact, in
    closed form), so this is the floor the learned offsets of :func:`linear_fedavg` can reach. At
    ``w = 0`` exactly an offset has no effect; the formula ignores that single point.
    """
    A, b, c = _quadratic(clients, p, offsets)
    w = np.asarray(w, dtype=np.float64)
    return np.einsum("...i,ij,...j->...", w, A, w) - 2.0 * w @ b + c


def loss_by_sum(clients: Sequence[ToyClient], sums, p: float = 0.0,
                offsets: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The global loss against the sum of the two entries of ``w`` (the x-axis of DisTrans' Fig. 2b).

    For each ``s`` in ``sums`` the lowest global loss over all ``w`` with ``w_1 + w_2 = s`` (exact: a
    one-dimensional quadratic). Returns ``(loss, w)`` with shapes (S,) and (S, 2).
    """
    A, b, c = _quadratic(clients, p, offsets)
    if A.shape != (2, 2):
        raise ValueError("loss_by_sum needs two-dimensional inputs")
    sums = np.asarray(sums, dtype=np.float64).ravel()
    base = sums[:, None] * np.array([0.5, 0.5])                          # (S, 2) on the line w_1 = w_2
    d = np.array([1.0, -1.0]) / np.sqrt(2.0)                             # direction keeping the sum fixed
    t = (d @ b - base @ A @ d) / (d @ A @ d)                             # (S,) minimiser along d
    w = base + t[:, None] * d
    return linear_global_loss(clients, w, p, offsets), w


def fedavg_summary(result: LinearFedAvg, window: int = 10) -> dict[str, float]:
    """Headline numbers of a run: ``final_loss`` (mean over the last ``window`` rounds), ``jitter``
    (their standard deviation), ``drift`` (mean client drift over those rounds), ``converged``."""
    _check_positive(window=window)
    tail = result.loss[-window:]
    return {"final_loss": float(tail.mean()), "jitter": float(tail.std()),
            "drift": float(result.drift[-window:].mean()), "converged": result.converged}


# ----------------------------------------------------------------------------- figures

def _axes(ax, figsize=(5.0, 3.6)):
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=figsize, layout="constrained")
    return ax


def plot_cosine_curves(w_grid, curves: dict[str, np.ndarray], w_true=None, title: str | None = None, ax=None):
    """Fig. 2a: each client's loss against ``w``, solid without offset, dashed with its best offset.

    ``curves`` is the output of :func:`cosine_loss_curves`; ``w_true`` marks the clients' true ``w``.
    """
    ax = _axes(ax)
    for k, (plain, offset) in enumerate(zip(curves["plain"], curves["offset"])):
        line, = ax.plot(w_grid, plain, label=f"client {k + 1}, no offset")
        ax.plot(w_grid, offset, "--", color=line.get_color(), label=f"client {k + 1}, with offset")
        if w_true is not None:
            ax.axvline(w_true[k], color=line.get_color(), lw=0.8, alpha=0.5)
    ax.set(xlabel="model parameter w (unitless)", ylabel="training loss (mean squared error)")
    ax.set_title(title or "loss against w", fontsize=10)
    ax.legend(fontsize="small")
    return ax


def plot_fedavg_rounds(runs: dict[str, LinearFedAvg], title: str | None = None, log: bool = True, ax=None):
    """Global training loss against the round, one line per labelled run."""
    ax = _axes(ax)
    for label, run in runs.items():
        ax.plot(np.arange(len(run.loss)), run.loss, label=label)
    ax.set(xlabel="round", ylabel="global training loss (MSE" + (", log scale)" if log else ")"),
           yscale="log" if log else "linear")
    ax.set_title(title or "FedAvg: loss per round", fontsize=10)
    ax.legend(fontsize="small")
    return ax


def plot_loss_by_sum(clients: Sequence[ToyClient], sums, p: float, runs: dict[str, LinearFedAvg],
                     title: str | None = None, log: bool = True, ax=None):
    """Fig. 2b: the lowest global loss for each value of ``w_1 + w_2``, without and with offsets (lines),
    and the FedAvg trajectories ``(sum of w_r, loss_r)`` on top, one marker per round: ``{label: run}``."""
    ax = _axes(ax)
    for offsets, style in ((False, "-"), (True, "--")):
        loss, _ = loss_by_sum(clients, sums, p, offsets)
        ax.plot(sums, loss, style, color="0.4", label=f"best loss for this sum, {'with' if offsets else 'no'} offsets")
    for i, (label, run) in enumerate(runs.items()):
        ax.plot(run.w.sum(axis=1), run.loss, "o-", ms=6 - 2.5 * (i % 2), mfc="none" if i % 2 == 0 else None,
                lw=0.6, alpha=0.8, label=f"FedAvg, {label}")
    ax.set(xlabel="w_1 + w_2 of the global model (unitless)",
           ylabel="global training loss (MSE" + (", log scale)" if log else ")"), yscale="log" if log else "linear")
    ax.set_title(title or "loss against the global w", fontsize=10)
    ax.legend(fontsize="small")
    return ax
