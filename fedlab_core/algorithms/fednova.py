"""FedNova (Wang, Liu, Liang, Joshi and Poor, "Tackling the Objective Inconsistency Problem in
Heterogeneous Federated Optimization", NeurIPS 2020): normalised averaging of local updates.

Clients that run more local steps move further and would bias FedAvg towards their own objective.
Client i reports its number of local steps tau_i; the server normalises its update by
``a_i = ||a_i||_1``, the total weight its local optimiser gave the gradients:

    a_i = tau_i                                              (plain SGD)
    a_i = [tau_i - rho (1 - rho^tau_i) / (1 - rho)] / (1 - rho)   (SGD with momentum rho)

and steps ``w = w_global - tau_eff * sum_i p_i (w_global - w_i) / a_i`` with ``p_i = n_i / sum_j n_j``
over the round's clients and ``tau_eff = sum_i p_i a_i`` (the paper's default). With equal a_i this is
FedAvg. No hyperparameters of its own.

Normalisation applies to parameters; batch-norm running statistics are averaged as in FedAvg. The
reference code normalises and sends ``model.parameters()`` only (its VGG-11 has no batch norm, so it
never meets a buffer); averaging the buffers is our choice. For Adam the paper gives no a_i; we use
tau_i (the update is then a step-count normalisation only).

Local training as the reference runs CIFAR-10 (github JYWa/FedNova, ``launch_exp.sh``): SGD, lr 0.02,
momentum 0.9, weight decay 1e-4, batch 32, two local epochs (it also decays the rate at rounds 50 and
75, which is not done here).
"""
from __future__ import annotations

from typing import Any

import torch

from .base import Algorithm, Message, Training, local_steps_taken, weighted_mean


def nova_norm(tau: int, rho: float) -> float:
    """a_i = ||a_i||_1 for `tau` local steps of SGD with momentum `rho` (tau itself when rho = 0)."""
    if rho == 0.0:
        return float(tau)
    return (tau - rho * (1.0 - rho ** tau) / (1.0 - rho)) / (1.0 - rho)


class FedNova(Algorithm):
    """Federated normalised averaging.

    Parameters
    ----------
    training : local training settings; its momentum (reset every round) enters a_i.
    """

    name = "fednova"
    batched = True
    paper_training = Training(lr=0.02, momentum=0.9, weight_decay=1e-4, batch_size=32, local_epochs=2)

    def __init__(self, training: Training | None = None):
        super().__init__(training)

    def init(self, model, federation) -> dict[str, Any]:
        state = super().init(model, federation)
        self.param_mask = self.shared.parameter_mask(model)  # (P,) bool
        return state

    def finish(self, data, loss, client_state):
        upload, client_state = super().finish(data, loss, client_state)
        # tau_i: the server needs it to normalise
        upload.metrics["local_steps"] = local_steps_taken(data.num_train, self.training)
        return upload, client_state

    def aggregate(self, server_state, uploads: list[tuple[int, Message]], round_idx) -> dict[str, Any]:
        w = server_state["weights"]  # (P,)
        n = torch.tensor([m.num_samples for _, m in uploads], dtype=torch.float64)
        p = (n / n.sum()).tolist()
        rho = self.training.momentum if self.training.optimizer == "sgd" else 0.0
        a = [nova_norm(int(m.metrics["local_steps"]), rho) for _, m in uploads]
        tau_eff = sum(pi * ai for pi, ai in zip(p, a))
        step = torch.zeros_like(w)  # sum_i p_i d_i, (P,)
        for pi, ai, (_, m) in zip(p, a, uploads):
            if ai > 0:  # a client that took no step moved nowhere
                step.add_(w - m.tensors["weights"], alpha=pi / ai)
        mean = weighted_mean([m.tensors["weights"] for _, m in uploads], n.tolist())  # buffers: FedAvg
        new = torch.where(self.param_mask, w - tau_eff * step, mean)
        return {**server_state, "weights": new}
