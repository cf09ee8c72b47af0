"""Lab 4's checks accept the toy's offset loss, best offset and local steps, and reject the common mistakes."""
import numpy as np
import pytest

from fedlab_core import toys
from fedlab_core.labs import LabCheckError
from fedlab_core.labs import distrans_offsets as checks


def loss(x, y, w, q, p):
    w, q = np.broadcast_arrays(np.asarray(w, dtype=float), np.asarray(q, dtype=float))
    return np.mean((np.cos(w[..., None] * ((1 + p) * x + q[..., None])) - y) ** 2, axis=-1)


def best(x, y, w_grid, q_grid, p, loss):
    table = loss(x, y, np.asarray(w_grid)[:, None], np.asarray(q_grid)[None, :], p)
    pick = np.argmin(table, axis=1)
    return np.asarray(q_grid)[pick], table[np.arange(len(pick)), pick]


def steps(w, q, x, y, p, lr, lr_offset, num_steps, offset_gradient=lambda r, w: 2 * r.mean() * w, fresh=True,
          sign=1.0):
    a = 1 + p
    for _ in range(num_steps):
        old_q = q
        q = q - lr_offset * offset_gradient(a * x @ w + q @ w - y, w)
        used = q if fresh else old_q
        residual = a * x @ w + used @ w - y
        w = w - sign * lr * 2 * ((a * x + used) * residual[:, None]).mean(axis=0)
    return w, q


def test_correct_answers_pass(capsys):
    checks.check_cosine_offset_loss(loss)
    checks.check_best_offset(best, loss)
    checks.check_local_steps(steps)
    assert capsys.readouterr().out.count("✔") == 3


@pytest.mark.parametrize("wrong, message", [
    (lambda x, y, w, q, p: loss(x, y, w, q, p) * len(y), "sum of the squared errors"),
    (lambda x, y, w, q, p: loss(x, y, w, q, 0.0), "scale the input"),
    (lambda x, y, w, q, p: np.mean((np.cos(np.multiply.outer(np.broadcast_arrays(w, q)[0], np.ones_like(x))
                                           * np.broadcast_arrays(w, q)[1][..., None]) - y) ** 2, axis=-1),
     "replaced the input"),
    (lambda x, y, w, q, p: np.mean((np.cos(np.asarray(w)[..., None] * ((1 + p) * x + np.asarray(q)[..., None]))
                                    - y) ** 2, axis=0), "expected"),
])
def test_offset_loss_mistakes_are_named(wrong, message):
    with pytest.raises(LabCheckError, match=message):
        checks.check_cosine_offset_loss(wrong)


def over_w_axis(x, y, w_grid, q_grid, p, loss):
    table = loss(x, y, np.asarray(w_grid)[:, None], np.asarray(q_grid)[None, :], p)
    return np.asarray(q_grid)[np.argmin(table, axis=0)], table.min(axis=0)


def indices(x, y, w_grid, q_grid, p, loss):
    table = loss(x, y, np.asarray(w_grid)[:, None], np.asarray(q_grid)[None, :], p)
    return np.argmin(table, axis=1).astype(float), table.min(axis=1)


@pytest.mark.parametrize("wrong, message", [(over_w_axis, "one offset per w"), (indices, "grid indices"),
                                            (lambda *args: best(*args)[0], "pair")])
def test_best_offset_mistakes_are_named(wrong, message):
    with pytest.raises(LabCheckError, match=message):
        checks.check_best_offset(wrong, loss)


@pytest.mark.parametrize("wrong, message", [
    (lambda *a: steps(*a, offset_gradient=lambda r, w: 2 * r.mean()), "chain rule"),
    (lambda *a: steps(*a, fresh=False), "offset just updated"),
    (lambda *a: steps(*a, sign=-1.0), "model after one step"),
    (lambda *a: steps(*a, offset_gradient=lambda r, w: r.mean() * w), "offset after one step"),
])
def test_local_steps_mistakes_are_named(wrong, message):
    with pytest.raises(LabCheckError, match=message):
        checks.check_local_steps(wrong)


def test_fedavg_with_the_library_steps_is_the_library_run():
    clients = toys.linear_clients(seed=1)
    ours = checks.fedavg_with(steps, clients, num_rounds=4, steps=3, lr=0.05, lr_offset=0.05, p=0.0, offsets=True)
    run = toys.linear_fedavg(clients, num_rounds=4, local_steps=3, offsets=True, batch_size=None, window=2)
    np.testing.assert_allclose(ours, run.loss, rtol=1e-10)
    plain = checks.fedavg_with(steps, clients, num_rounds=4, steps=3, lr=0.05, lr_offset=0.05, p=0.0, offsets=False)
    assert plain[-1] > ours[-1]
