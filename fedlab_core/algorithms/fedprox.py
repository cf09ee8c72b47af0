"""FedProx (Li, Sahu, Zaheer, Sanjabi, Talwalkar and Smith, "Federated Optimization in Heterogeneous
Networks", MLSys 2020): FedAvg whose local objective adds a proximal term.

Client k minimises ``F_k(w) + mu/2 ||w - w_global||^2``, where ``w_global`` are the weights it received
this round. The term is applied as its gradient, ``grad += mu (w - w_global)``, added between backward
and the optimiser step (:meth:`FedProx.correct`, which both executors use), so the reported training loss
is the plain cross-entropy. Default
``mu = 1`` and the local training of the paper's MNIST experiments: SGD, lr 0.03, batch 10, 20 local
epochs (mu per dataset in the authors' ``plot_final_e20.py``: 1 for Synthetic, MNIST and FEMNIST; rates
and epochs in the paper's Appendix C.2 and run scripts, github litian96/FedProx). FedBN uses mu = 1e-2
on Digits and FedRDN 1e-3: the chapters that follow them set it.

The term covers the shared parameters only; batch-norm running statistics are buffers with no
gradient and are averaged as in FedAvg. Server side: FedAvg.
"""
from __future__ import annotations

from typing import Any

import torch

from ..params import Range
from .base import Algorithm, Training


class FedProx(Algorithm):
    """FedAvg with a proximal term towards the round's global model.

    Parameters
    ----------
    training : local training settings.
    mu : weight of the proximal term ``mu/2 ||w - w_global||^2``.
    """

    name = "fedprox"
    paper_training = Training(lr=0.03, batch_size=10, local_epochs=20)
    constraints = {"mu": Range(0)}
    batched = True

    def __init__(self, training: Training | None = None, mu: float = 1.0):
        super().__init__(training)
        self.mu = mu

    def start(self, message, client_state) -> dict[str, torch.Tensor]:
        super().start(message, client_state)
        w_global = message.tensors["weights"]  # (P,)
        # each trained parameter's slice of the received weights: the anchor of the proximal term
        self._anchors = {name: self.shared.view(w_global, name) for name, p in self.model.named_parameters()
                         if p.requires_grad and name in self.shared.names}
        return self._anchors

    @torch.no_grad()
    def before_step(self, client_state: dict[str, Any]) -> None:
        params = {name: p for name, p in self.model.named_parameters() if name in self._anchors}
        # a parameter the loss did not reach still feels the proximal pull
        grads = {name: torch.zeros_like(p) if p.grad is None else p.grad for name, p in params.items()}
        for name, grad in self.correct(grads, params, self._anchors).items():
            params[name].grad = grad

    def correct(self, grads, params, context):
        return {name: torch.add(g, params[name] - context[name], alpha=self.mu) if name in context else g
                for name, g in grads.items()}
