"""The DisTrans toy problems (Sec. 3, Fig. 2): the cosine losses and brute-force offsets, the linear
FedAvg with and without offsets, the closed-form global loss, determinism and bad input."""
import numpy as np
import pytest

from fedlab_core import toys as T

W_GRID = np.linspace(0.0, 4.0, 401)


# ----------------------------------------------------------------------------- (a) cos(w x)

def test_noiseless_cosine_loss_is_zero_exactly_at_each_clients_true_w():
    clients = T.cosine_clients((1.0, 2.5), num_samples=300, noise=0.0, seed=1)
    losses = np.stack([T.cosine_loss(c, W_GRID) for c in clients])
    assert W_GRID[np.argmin(losses, axis=1)] == pytest.approx([1.0, 2.5])
    assert losses.min(axis=1) == pytest.approx([0.0, 0.0], abs=1e-12)
    assert (losses[0] > 0).sum() == W_GRID.size - 1                 # nothing else fits


def test_cosine_loss_broadcasts_w_against_q():
    client = T.cosine_clients((1.5,), num_samples=50, seed=0)[0]
    w, q = np.array([0.5, 1.0, 2.0]), np.array([-0.3, 0.0, 0.7, 1.1])
    table = T.cosine_loss(client, w[:, None], p=0.2, q=q[None, :])
    assert table.shape == (3, 4)
    direct = np.mean((np.cos(2.0 * (1.2 * client.x + 0.7)) - client.y) ** 2)
    assert table[2, 2] == pytest.approx(direct)


def test_brute_force_offset_is_the_minimiser_of_a_much_finer_search():
    client = T.cosine_clients((1.0, 2.0), num_samples=200, noise=0.1, seed=3)[1]
    w = np.array([0.3, 0.8, 1.3, 2.7, 3.5])
    q_best, loss = T.best_offset(client, w, p=0.1, q_points=512)
    assert np.all(np.abs(q_best) <= np.pi / w)                      # one period of the loss in q
    # the returned loss is the loss at the returned q
    assert loss == pytest.approx(T.cosine_loss(client, w, p=0.1, q=q_best))
    # and no q in a fine grid over a whole period 2 pi / w (the loss repeats beyond it) does meaningfully better
    best_fine = np.array([T.cosine_loss(client, w_i, p=0.1, q=np.linspace(-np.pi / w_i, np.pi / w_i, 20001)).min()
                          for w_i in w])
    assert np.all(loss >= best_fine - 1e-12)
    assert loss == pytest.approx(best_fine, abs=1e-3)
    # a fixed grid is searched as given
    coarse = np.linspace(-4.0, 4.0, 201)
    q_fixed, loss_fixed = T.best_offset(client, w, p=0.1, q_grid=coarse)
    assert np.isin(q_fixed, coarse).all()
    assert loss_fixed == pytest.approx(T.cosine_loss(client, w[:, None], 0.1, coarse[None, :]).min(axis=1))


def test_brute_force_offset_undoes_an_input_shift():
    # client observes x + 0.75 but its label is cos(1.6 x): the offset q = -0.75 fits exactly
    client = T.cosine_clients((1.6,), num_samples=200, noise=0.0, seed=0, shifts=(0.75,))[0]
    q_best, loss = T.best_offset(client, np.array([1.6]), q_grid=np.linspace(-2, 2, 401))
    assert q_best[0] == pytest.approx(-0.75)
    assert loss[0] == pytest.approx(0.0, abs=1e-12)
    assert T.cosine_loss(client, 1.6) > 0.1                         # without the offset it does not


def test_offset_curves_never_exceed_the_plain_curves_and_p_rescales_w():
    clients = T.cosine_clients((1.0, 2.0), num_samples=150, noise=0.0, seed=0)
    curves = T.cosine_loss_curves(clients, W_GRID, p=0.0, q_grid=np.linspace(-3, 3, 121))   # holds q = 0
    assert np.all(curves["offset"] <= curves["plain"] + 1e-12)
    assert curves["q"].shape == curves["offset"].shape == (2, W_GRID.size)
    # the data see w (1 + p): with p = 0.25 the minima move to w_k / 1.25
    scaled = T.cosine_loss_curves(clients, W_GRID, p=0.25, q_points=64)
    assert W_GRID[np.argmin(scaled["offset"], axis=1)] == pytest.approx([0.8, 1.6])


def test_curve_consistency_hand_example():
    w = np.array([0.0, 1.0, 2.0, 3.0])
    losses = np.array([[1.0, 0.0, 1.0, 2.0],
                       [3.0, 2.0, 0.0, 1.0]])
    out = T.curve_consistency(w, losses)
    assert out["argmin_gap"] == 1.0
    assert out["mean_abs_gap"] == pytest.approx((2 + 2 + 1 + 1) / 4)
    assert out["relative_gap"] == pytest.approx(1.5 / losses.mean())
    assert T.curve_consistency(w, np.stack([losses[0]] * 2)) == {"argmin_gap": 0.0, "mean_abs_gap": 0.0,
                                                               "relative_gap": 0.0}


def test_offsets_make_shifted_clients_consistent_but_not_clients_with_different_w():
    shifted = T.cosine_clients((1.5, 1.5), num_samples=400, noise=0.0, seed=0, shifts=(0.0, 1.0))
    curves = T.cosine_loss_curves(shifted, W_GRID, q_points=128)
    plain, offset = (T.curve_consistency(W_GRID, curves[k]) for k in ("plain", "offset"))
    assert plain["argmin_gap"] > 0.5 and offset["argmin_gap"] < 0.05
    assert offset["relative_gap"] < 0.3 * plain["relative_gap"]
    different = T.cosine_clients((1.0, 2.0), num_samples=400, noise=0.0, seed=0)
    curves = T.cosine_loss_curves(different, W_GRID, q_points=128)
    assert T.curve_consistency(W_GRID, curves["offset"])["argmin_gap"] == pytest.approx(1.0)  # a phase cannot help


# ----------------------------------------------------------------------------- (b) linear FedAvg

def test_a_local_step_updates_the_offset_first_then_the_model():
    """Algorithm 1 of DisTrans on one client and one full-batch step, against finite differences."""
    clients = T.linear_clients(((1.0, 2.0),), num_samples=50, noise=0.1, seed=0, shifts=((0.5, -0.5),))
    c, p, lr, lr_q = clients[0], 0.2, 0.05, 0.3
    run = T.linear_fedavg(clients, num_rounds=2, local_steps=1, lr=lr, offsets=True, p=p, lr_offset=lr_q,
                          batch_size=None, window=1)

    def loss(w, q):
        return np.mean(((1 + p) * c.x @ w + q @ w - c.y) ** 2)

    def grad(f, v, h=1e-6):
        return np.array([(f(v + h * e) - f(v - h * e)) / (2 * h) for e in np.eye(v.size)])

    w, q = run.w[1], run.q[1, 0]                                     # after round 1
    q_new = q - lr_q * grad(lambda q_: loss(w, q_), q)
    w_new = w - lr * grad(lambda w_: loss(w_, q_new), w)
    assert run.q[2, 0] == pytest.approx(q_new, abs=1e-7)
    assert run.w[2] == pytest.approx(w_new, abs=1e-7)
    assert run.client_loss[2, 0] == pytest.approx(loss(w_new, q_new))


def test_fedavg_on_identical_clients_recovers_the_true_w():
    w_true = (1.5, -0.5)
    clients = T.linear_clients((w_true, w_true), num_samples=200, noise=0.0, seed=0)
    run = T.linear_fedavg(clients, num_rounds=40, local_steps=5, lr=0.05, batch_size=16, seed=0)
    assert run.w[-1] == pytest.approx(w_true, abs=1e-4)
    assert run.loss[-1] < 1e-8 and run.converged
    assert run.drift[-1] < 1e-4
    assert run.w.shape == (41, 2) and run.q.shape == (41, 2, 2) and run.client_loss.shape == (41, 2)
    assert np.all(run.q == 0.0)                                      # no offsets asked for


def test_one_local_full_batch_step_is_gradient_descent_to_the_closed_form_optimum():
    clients = T.linear_clients(((1.0, 2.0), (-2.0, 0.5)), num_samples=300, noise=0.1, seed=2)
    run = T.linear_fedavg(clients, num_rounds=300, local_steps=1, lr=0.1, batch_size=None)
    A = sum(c.x.T @ c.x / len(c.y) for c in clients) / 2
    b = sum(c.x.T @ c.y / len(c.y) for c in clients) / 2
    w_star = np.linalg.solve(A, b)
    assert run.w[-1] == pytest.approx(w_star, abs=1e-6)
    assert run.loss[-1] == pytest.approx(T.linear_global_loss(clients, w_star), rel=1e-9)
    assert run.converged
    # the optimum is where the sum-profile bottoms out
    loss, w = T.loss_by_sum(clients, [w_star.sum()])
    assert w[0] == pytest.approx(w_star) and loss[0] == pytest.approx(T.linear_global_loss(clients, w_star))


def test_loss_by_sum_is_the_minimum_along_each_line_of_constant_sum():
    clients = T.linear_clients(((1.0, 2.0), (-2.0, 0.5)), num_samples=100, noise=0.1, seed=0)
    sums = np.array([-1.0, 0.5, 2.0])
    for offsets in (False, True):
        loss, w = T.loss_by_sum(clients, sums, p=0.2, offsets=offsets)
        assert w.sum(axis=1) == pytest.approx(sums)
        for s, best in zip(sums, loss):
            v = np.linspace(-10, 10, 20001)                                          # w = (s + v, s - v) / 2
            line = np.stack([(s + v) / 2, (s - v) / 2], axis=1)
            assert best == pytest.approx(T.linear_global_loss(clients, line, p=0.2, offsets=offsets).min(), rel=1e-6)


def test_global_loss_with_offsets_uses_each_clients_best_offset():
    clients = T.linear_clients(((1.0, 2.0), (-2.0, 0.5)), num_samples=100, noise=0.1, seed=4,
                               shifts=((0.5, 0.0), (0.0, -1.0)))
    w, p = np.array([0.7, -1.2]), 0.3
    # the best q makes w.q absorb the mean residual: q_k = bias_k w / |w|^2
    per_client = []
    for c in clients:
        bias = np.mean(c.y - (1 + p) * c.x @ w)
        q = bias * w / (w @ w)
        per_client.append(np.mean(((1 + p) * c.x @ w + q @ w - c.y) ** 2))
    assert T.linear_global_loss(clients, w, p, offsets=True) == pytest.approx(np.mean(per_client))
    assert T.linear_global_loss(clients, w, p, offsets=True) < T.linear_global_loss(clients, w, p, offsets=False)


def test_offsets_fix_shifted_inputs_in_fedavg():
    clients = T.linear_clients(((1.0, 2.0), (1.0, 2.0)), num_samples=200, noise=0.1, seed=0,
                               shifts=((1.0, -1.0), (-1.0, 2.0)))
    plain = T.linear_fedavg(clients, num_rounds=60, local_steps=10, lr=0.05, batch_size=None)
    offset = T.linear_fedavg(clients, num_rounds=60, local_steps=10, lr=0.05, offsets=True, batch_size=None)
    assert offset.loss[-1] < 0.02 < 1.0 < plain.loss[-1]             # noise level 0.01 against a bias it cannot fit
    assert offset.w[-1] == pytest.approx([1.0, 2.0], abs=0.05)
    for k, m in enumerate(((1.0, -1.0), (-1.0, 2.0))):               # w.q_k cancels w.m_k
        assert offset.q[-1, k] @ offset.w[-1] == pytest.approx(-np.dot([1.0, 2.0], m), abs=0.05)
    assert offset.drift[-1] < 0.1 * plain.drift[-1]


def test_offsets_cannot_remove_the_floor_set_by_different_w():
    clients = T.linear_clients(((1.0, 2.0), (-2.0, 0.5)), num_samples=200, noise=0.1, seed=0)
    floor_plain = T.loss_by_sum(clients, np.linspace(-3, 3, 601))[0].min()
    floor_offset = T.loss_by_sum(clients, np.linspace(-3, 3, 601), offsets=True)[0].min()
    assert floor_offset <= floor_plain <= 1.05 * floor_offset         # a constant cannot fit a slope
    assert floor_plain > 0.9 * np.sum((np.subtract((1.0, 2.0), (-2.0, 0.5)) / 2) ** 2)   # |w1 - w2|^2 / 4
    for offsets, floor in ((False, floor_plain), (True, floor_offset)):
        run = T.linear_fedavg(clients, num_rounds=60, local_steps=10, lr=0.05, offsets=offsets, batch_size=None)
        assert run.converged                                          # FedAvg converges either way ...
        assert floor <= run.loss[-1] < 1.02 * floor                   # ... to (about) the floor


def test_toys_are_deterministic_by_seed():
    a = T.linear_clients(((1.0, 2.0), (-2.0, 0.5)), seed=5)
    b = T.linear_clients(((1.0, 2.0), (-2.0, 0.5)), seed=5)
    assert all(np.array_equal(x.x, y.x) and np.array_equal(x.y, y.y) for x, y in zip(a, b))
    run_a = T.linear_fedavg(a, num_rounds=20, offsets=True, seed=7)
    run_b = T.linear_fedavg(b, num_rounds=20, offsets=True, seed=7)
    assert np.array_equal(run_a.loss, run_b.loss) and np.array_equal(run_a.q, run_b.q)
    assert not np.array_equal(run_a.loss, T.linear_fedavg(a, num_rounds=20, offsets=True, seed=8).loss)
    c1, c2 = T.cosine_clients(seed=3), T.cosine_clients(seed=3)
    assert np.array_equal(T.cosine_loss_curves(c1, W_GRID[::10])["offset"],
                          T.cosine_loss_curves(c2, W_GRID[::10])["offset"])
    assert not np.array_equal(c1[0].x, T.cosine_clients(seed=4)[0].x)


def test_fedavg_summary_reads_the_last_window():
    clients = T.linear_clients(((1.0, 2.0), (-2.0, 0.5)), seed=0)
    run = T.linear_fedavg(clients, num_rounds=20, window=5)
    summary = T.fedavg_summary(run, window=5)
    assert summary["final_loss"] == pytest.approx(run.loss[-5:].mean())
    assert summary["jitter"] == pytest.approx(run.loss[-5:].std())
    assert summary["converged"] == run.converged


@pytest.mark.parametrize("kwargs,match", [
    ({"num_rounds": 0}, "num_rounds"),
    ({"local_steps": 0}, "local_steps"),
    ({"lr": -0.1}, "lr"),
    ({"batch_size": 0}, "batch_size"),
    ({"offsets": True, "lr_offset": 0.0}, "lr_offset"),
    ({"num_rounds": 15, "window": 10}, "window"),
])
def test_linear_fedavg_rejects_bad_settings(kwargs, match):
    clients = T.linear_clients(seed=0)
    with pytest.raises(ValueError, match=match):
        T.linear_fedavg(clients, **kwargs)


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="num_samples"):
        T.cosine_clients(num_samples=0)
    with pytest.raises(ValueError, match="noise"):
        T.linear_clients(noise=-1.0)
    with pytest.raises(ValueError, match="shifts"):
        T.linear_clients(shifts=(1.0, 2.0, 3.0))
    with pytest.raises(ValueError, match="losses"):
        T.curve_consistency(W_GRID, np.zeros((1, W_GRID.size)))
    with pytest.raises(ValueError, match="w_grid"):
        T.best_offset(T.cosine_clients()[0], [])
    with pytest.raises(ValueError, match="clients"):
        T.linear_fedavg([])
    with pytest.raises(ValueError, match="two-dimensional"):
        T.loss_by_sum(T.linear_clients(((1.0, 2.0, 3.0),)), [0.0])
