"""MOON (Li, He and Song, "Model-Contrastive Federated Learning", CVPR 2021): FedAvg whose local
objective adds a contrastive term between representations of three models.

Client loss on a batch: ``CE + mu * l_con`` with

    l_con = -log( exp(sim(z, z_glob)/T) / (exp(sim(z, z_glob)/T) + exp(sim(z, z_prev)/T)) )

averaged over the batch, where ``sim`` is the cosine similarity, ``z`` the representation of the model
being trained, ``z_glob`` that of the global model the client received this round and ``z_prev`` that of
the client's own model at the end of its previous participation (both frozen, in eval mode). The term
pulls the local representation towards the global one and pushes it away from the stale local one.

Defaults as the paper and its code run CIFAR-10 (github QinbinLi/MOON, ``main.py`` and README): ``mu =
5`` (1 on CIFAR-100 and Tiny-ImageNet), ``T = 0.5``; SGD lr 0.01, momentum 0.9, weight decay 1e-5,
batch 64, 10 local epochs.

The projection head
-------------------
The paper's network has three parts: a base encoder, a projection head and an output layer. Its code
(``ModelFedCon``) makes the head ``Linear(D, D)``, ReLU, ``Linear(D, 256)``, puts the output layer on the
projection (``Linear(256, classes)``) and contrasts the projections. ``projection_dim = 256`` (the
default) builds that on any backbone of :mod:`fedlab_core.models` (``D`` the input size of its linear
head, which the new output layer replaces): the head is part of the model, averaged like every other
layer. ``projection_dim = 0`` is the head-less form, an option: the contrast is on ``features(x)``, the
input of the backbone's own linear head, with no extra parameters.

Differences from the paper
--------------------------
- On a client's first participation there is no previous local model; as in the authors' code the
  global model stands in for it, so ``l_con = log 2`` with zero gradient and the first round is FedAvg.

Batched (:mod:`fedlab_core.batched`): the global and previous models are :meth:`MOON.frozen_models`, each
client's put into them from the context :meth:`MOON.start` returns; on a padded batch the loss sums its real
samples' terms only (``client_state["real"]``).

Memory: every client keeps a full copy of its last local model (every floating-point state entry) in
its client state, i.e. one model per client, as in the authors' code. Server side: FedAvg.
"""
from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..params import Range
from .base import Algorithm, FlatState, Training, padded_sum


def model_contrastive_loss(z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor,
                           temperature: float, reduction: str = "mean") -> torch.Tensor:
    """MOON's ``l_con``, averaged over the batch (``reduction="none"``: per sample, (B,)).

    Parameters
    ----------
    z : (B, D) representations of the model being trained.
    z_glob : (B, D) representations of the global model (the positive pair).
    z_prev : (B, D) representations of the previous local model (the negative pair).
    temperature : T.
    """
    pos = F.cosine_similarity(z, z_glob, dim=1)  # (B,)
    neg = F.cosine_similarity(z, z_prev, dim=1)  # (B,)
    logits = torch.stack([pos, neg], dim=1) / temperature  # (B, 2)
    # -log softmax of the positive column: cross-entropy with every target at index 0
    return F.cross_entropy(logits, torch.zeros(len(z), dtype=torch.long, device=z.device), reduction=reduction)


class ProjectionHead(nn.Module):
    """MOON's projection head and output layer on a ``D``-dimensional representation:
    ``project(z) = l2(relu(l1(z)))``, ``(B, D) -> (B, out_dim)``, and ``forward(z) = l3(project(z))``, the
    class scores ``(B, classes)``."""

    def __init__(self, in_dim: int, out_dim: int, num_classes: int):
        super().__init__()
        self.l1, self.l2 = nn.Linear(in_dim, in_dim), nn.Linear(in_dim, out_dim)
        self.l3 = nn.Linear(out_dim, num_classes)

    def project(self, z: torch.Tensor) -> torch.Tensor:
        return self.l2(F.relu(self.l1(z)))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.l3(self.project(z))


def _frozen_copy(model: nn.Module) -> nn.Module:
    frozen = copy.deepcopy(model).eval()
    frozen.requires_grad_(False)
    return frozen


class MOON(Algorithm):
    """FedAvg with MOON's model-contrastive term in the local objective.

    Parameters
    ----------
    training : local training settings.
    mu : weight of the contrastive term.
    temperature : T in ``l_con``.
    projection_dim : output size of the projection head (the paper's code's 256); 0: no head, the
        contrast is on ``features(x)``.
    """

    name = "moon"
    batched = True
    paper_training = Training(lr=0.01, momentum=0.9, weight_decay=1e-5, batch_size=64, local_epochs=10)
    constraints = {"mu": Range(0), "temperature": Range(0, low_open=True), "projection_dim": Range(0)}

    def __init__(self, training: Training | None = None, mu: float = 5.0, temperature: float = 0.5,
                 projection_dim: int = 256):
        super().__init__(training)
        self.mu = mu
        self.temperature = temperature
        self.projection_dim = projection_dim

    def init(self, model, federation):
        if self.projection_dim and not isinstance(model.head, ProjectionHead):
            # the output layer moves onto the projection; drawn from the run's model-initialisation stream
            linear = model.head
            model.head = ProjectionHead(linear.in_features, self.projection_dim, linear.out_features).to(
                linear.weight.device)
        server = super().init(model, federation)
        self.whole = FlatState(model)  # every float entry: what "the previous local model" is
        # Frozen workspaces for the global and previous models (their weights come from the states)
        self.global_copy, self.previous_copy = _frozen_copy(model), _frozen_copy(model)
        self._global_flat, self._previous_flat = FlatState(self.global_copy), FlatState(self.previous_copy)
        return server

    def start(self, message, client_state):
        """The received global model into the workspace and the global copy, the client's previous model (the
        global one on its first participation) into the previous copy; returns their entries by name (the
        context the batched executor puts into each client's copies: :meth:`frozen_models`)."""
        super().start(message, client_state)
        weights = message.tensors["weights"]  # no local entries: every float entry of the model
        previous = client_state.get("previous", weights)
        self._global_flat.set(weights)
        self._previous_flat.set(previous)
        return {**{f"global_copy.{n}": self.whole.view(weights, n) for n in self.whole.names},
                **{f"previous_copy.{n}": self.whole.view(previous, n) for n in self.whole.names}}

    def finish(self, data, loss, client_state):
        client_state["previous"] = self.whole.get()
        return super().finish(data, loss, client_state)

    def frozen_models(self) -> dict[str, nn.Module]:
        return {"global_copy": self.global_copy, "previous_copy": self.previous_copy}

    def representation(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """What the contrastive term compares: the projection (B, projection_dim), or features(x) (B, D)."""
        z = model.features(x)
        return model.head.project(z) if self.projection_dim else z

    def loss(self, x: torch.Tensor, y: torch.Tensor, client_state: dict[str, Any]) -> torch.Tensor:
        h = self.model.features(x)  # (B, D)
        if self.projection_dim:
            z = self.model.head.project(h)  # (B, projection_dim)
            logits = self.model.head.l3(z)
        else:
            z, logits = h, self.model.head(h)
        with torch.no_grad():
            z_glob = self.representation(self.global_copy, x)
            z_prev = self.representation(self.previous_copy, x)
        real = client_state.get("real")  # the batched executor's padded batch: which of its samples are real
        if real is None:
            return F.cross_entropy(logits, y) + self.mu * model_contrastive_loss(z, z_glob, z_prev, self.temperature)
        each = (F.cross_entropy(logits, y, reduction="none")
                + self.mu * model_contrastive_loss(z, z_glob, z_prev, self.temperature, reduction="none"))
        return padded_sum(each, real)
