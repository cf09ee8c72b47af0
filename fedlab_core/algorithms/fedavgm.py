"""FedAvgM (Hsu, Qi and Brown, "Measuring the Effects of Non-Identical Data Distribution for Federated
Visual Classification", arXiv:1909.06335, 2019): FedAvg with momentum on the server.

The server treats the change of the global model as a pseudo-gradient,
``d = w_global - weighted_mean(uploads)``, accumulates it with heavy-ball momentum, ``v = beta v + d``,
and steps ``w = w_global - server_lr * v``. With ``server_momentum = 0`` and ``server_lr = 1`` this is
FedAvg. Defaults: ``server_momentum = 0.9`` (the usual choice of the paper's sweep, and FedRDN's),
``server_lr = 1.0``; local training as the paper's CIFAR-10 runs: batch 64, one local epoch (it sweeps
the client rate and states no single value: 0.05 is ours).

Momentum applies to parameters only: floating-point buffers (batch-norm running statistics) are
statistics, not optimisation variables, so they are plainly averaged as in FedAvg.
"""
from __future__ import annotations

from typing import Any

import torch

from ..params import Range
from .base import Algorithm, Training, weighted_mean


class FedAvgM(Algorithm):
    """FedAvg with server momentum.

    Parameters
    ----------
    training : local training settings.
    server_momentum : beta, the momentum of the server's pseudo-gradient.
    server_lr : the server's step size on the momentum buffer.
    """

    name = "fedavgm"
    batched = True
    paper_training = Training(batch_size=64, local_epochs=1, lr=0.05)
    constraints = {"server_momentum": Range(0, 1, high_open=True), "server_lr": Range(0, low_open=True)}

    def __init__(self, training: Training | None = None, server_momentum: float = 0.9, server_lr: float = 1.0):
        super().__init__(training)
        self.server_momentum = server_momentum
        self.server_lr = server_lr

    def init(self, model, federation) -> dict[str, Any]:
        state = super().init(model, federation)
        self.param_mask = self.shared.parameter_mask(model)  # (P,) bool
        return {**state, "momentum": torch.zeros_like(state["weights"])}

    def aggregate(self, server_state, uploads, round_idx) -> dict[str, Any]:
        w = server_state["weights"]  # (P,)
        mean = weighted_mean([m.tensors["weights"] for _, m in uploads], [m.num_samples for _, m in uploads])
        d = (w - mean) * self.param_mask  # pseudo-gradient; zero on buffers so v stays zero there
        v = self.server_momentum * server_state["momentum"] + d
        new = torch.where(self.param_mask, w - self.server_lr * v, mean)
        return {**server_state, "weights": new, "momentum": v}
