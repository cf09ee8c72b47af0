"""Lab 3's checks accept SCAFFOLD's three formulas written correctly (and, assembled, the library's
Scaffold), and reject the common mistakes: flipped signs, forgotten terms, wrong normalisations, the mean
over the sampled clients where all N clients are due, and arguments changed in place."""
import pytest
import torch

from fedlab_core.labs import LabCheckError
from fedlab_core.labs import scaffold as checks


def corrected_gradient(grad, c, c_i):
    return grad + c - c_i


def control_update(c_i, c, w_global, w_local, num_steps, lr):
    return c_i - c + (w_global - w_local) / (num_steps * lr)


def server_update(w, c, delta_ws, delta_cs, num_clients, server_lr):
    return w + server_lr * torch.stack(delta_ws).mean(0), c + torch.stack(delta_cs).sum(0) / num_clients


def test_correct_answers_pass(capsys):
    checks.check_corrected_gradient(corrected_gradient)
    checks.check_control_update(control_update)
    checks.check_server_update(server_update)
    checks.check_scaffold(corrected_gradient, control_update, server_update)
    assert capsys.readouterr().out.count("✔") == 4


def test_numpy_and_list_answers_pass(capsys):
    checks.check_corrected_gradient(lambda g, c, c_i: (g + c - c_i).numpy())
    checks.check_control_update(lambda *args: control_update(*args).tolist())
    checks.check_server_update(lambda *args: [t.numpy() for t in server_update(*args)])
    assert capsys.readouterr().out.count("✔") == 3


# ---------------------------------------------------------------------------------------- task 1


def grad_in_place_on_c(grad, c, c_i):
    c.sub_(c_i)
    return grad + c


@pytest.mark.parametrize("wrong, message", [
    (lambda g, c, c_i: g - c + c_i, "flipped"),
    (lambda g, c, c_i: g + c, "c_i is missing"),
    (lambda g, c, c_i: g - c_i, "server's c is missing"),
    (lambda g, c, c_i: g, "unchanged"),
    (grad_in_place_on_c, "in place"),
    (lambda g, c, c_i: (g + c - c_i).reshape(-1), "shaped like grad"),
])
def test_corrected_gradient_mistakes_are_named(wrong, message):
    with pytest.raises(LabCheckError, match=message):
        checks.check_corrected_gradient(wrong)


# ---------------------------------------------------------------------------------------- task 2


def control_in_place(c_i, c, w_global, w_local, num_steps, lr):
    return c_i.sub_(c).add_((w_global - w_local) / (num_steps * lr))


@pytest.mark.parametrize("wrong, message", [
    (lambda c_i, c, wg, wl, k, lr: c_i - c + (wl - wg) / (k * lr), "wrong sign"),
    (lambda c_i, c, wg, wl, k, lr: c_i + (wg - wl) / (k * lr), "c is missing"),
    (lambda c_i, c, wg, wl, k, lr: c_i + c + (wg - wl) / (k * lr), "added where it is subtracted"),
    (lambda c_i, c, wg, wl, k, lr: c_i - c + (wg - wl) / k, "divided by K only"),
    (lambda c_i, c, wg, wl, k, lr: c_i - c + (wg - wl) / lr, "divided by lr only"),
    (lambda c_i, c, wg, wl, k, lr: -c + (wg - wl) / (k * lr), "returned the change"),
    (control_in_place, "in place"),
])
def test_control_update_mistakes_are_named(wrong, message):
    with pytest.raises(LabCheckError, match=message):
        checks.check_control_update(wrong)


# ---------------------------------------------------------------------------------------- task 3


def c_mean_over_sampled(w, c, delta_ws, delta_cs, num_clients, server_lr):
    return w + server_lr * torch.stack(delta_ws).mean(0), c + torch.stack(delta_cs).mean(0)


def w_divided_by_n(w, c, delta_ws, delta_cs, num_clients, server_lr):
    return w + server_lr * torch.stack(delta_ws).sum(0) / num_clients, c + torch.stack(delta_cs).sum(0) / num_clients


def w_without_server_lr(w, c, delta_ws, delta_cs, num_clients, server_lr):
    return w + torch.stack(delta_ws).mean(0), c + torch.stack(delta_cs).sum(0) / num_clients


def w_summed(w, c, delta_ws, delta_cs, num_clients, server_lr):
    return w + server_lr * torch.stack(delta_ws).sum(0), c + torch.stack(delta_cs).sum(0) / num_clients


def c_without_old_c(w, c, delta_ws, delta_cs, num_clients, server_lr):
    return w + server_lr * torch.stack(delta_ws).mean(0), torch.stack(delta_cs).sum(0) / num_clients


def c_subtracted(w, c, delta_ws, delta_cs, num_clients, server_lr):
    return w + server_lr * torch.stack(delta_ws).mean(0), c - torch.stack(delta_cs).sum(0) / num_clients


def c_with_server_lr(w, c, delta_ws, delta_cs, num_clients, server_lr):
    return (w + server_lr * torch.stack(delta_ws).mean(0),
            c + server_lr * torch.stack(delta_cs).sum(0) / num_clients)


def returns_a_dict(w, c, delta_ws, delta_cs, num_clients, server_lr):
    new_w, new_c = server_update(w, c, delta_ws, delta_cs, num_clients, server_lr)
    return {"weights": new_w, "control": new_c}


def w_in_place(w, c, delta_ws, delta_cs, num_clients, server_lr):
    w += server_lr * torch.stack(delta_ws).mean(0)
    return w, c + torch.stack(delta_cs).sum(0) / num_clients


@pytest.mark.parametrize("wrong, message", [
    (c_mean_over_sampled, "mean over the 3 sampled"),
    (w_divided_by_n, "divided the summed updates by N"),
    (w_without_server_lr, "forgot server_lr"),
    (w_summed, "sum of the updates"),
    (c_without_old_c, "lost the old c"),
    (c_subtracted, "subtracted the changes"),
    (c_with_server_lr, "server_lr scales the weights"),
    (returns_a_dict, "pair"),
    (w_in_place, "in place"),
])
def test_server_update_mistakes_are_named(wrong, message):
    with pytest.raises(LabCheckError, match=message):
        checks.check_server_update(wrong)


# ---------------------------------------------------------------------------------------- assembled


def test_assembled_check_catches_a_wrong_server_variate():
    with pytest.raises(LabCheckError, match="round 1.*server's control variate"):
        checks.check_scaffold(corrected_gradient, control_update, c_mean_over_sampled)


def test_assembled_check_catches_a_flipped_correction():
    with pytest.raises(LabCheckError, match="round 2"):
        checks.check_scaffold(lambda g, c, c_i: g - c + c_i, control_update, server_update)


def test_fedavg_mode_sends_the_model_only():
    """With control=False the class is FedAvg: no correction, variates stay zero, FedAvg's bytes."""
    from fedlab_core.algorithms import Training
    from fedlab_core.engine import Simulation

    built = checks._workspace(num_clients=4)
    algo = checks.StudentScaffold(corrected_gradient, control_update, server_update,
                                  Training(lr=0.1, local_steps=3, batch_size=16), control=False)
    sim = Simulation(algo, built.federation, built.model, seed=0, num_rounds=2, progress=False)
    state = sim.run()
    assert all(not s["control"].any() for s in state.clients.values())
    assert not state.server["control"].any()
    size = state.server["weights"].numel() * 4
    assert state.rows[-1]["bytes_down"] == 4 * size
    assert len(algo.drift) == 2 and algo.drift[0]["spread"] > 0
