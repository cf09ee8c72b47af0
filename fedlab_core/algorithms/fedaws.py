"""FedAwS (Yu, Rawat, Menon and Kumar, "Federated Learning with Only Positive Labels", ICML 2020):
federated averaging with a server-side spread-out regulariser on the class embeddings.

Each client sees the positives of its own class(es) only, so a softmax over all classes degenerates
(every class embedding collapses onto the same point). FedAwS changes two things in FedAvg:

- Client loss: only the positive term of the paper's cosine contrastive loss,
  ``max(0, positive_margin - cos(g(x), w_y))^2``, on the L2-normalised representation ``g(x) =
  features(x)`` and the normalised class embedding ``w_y`` = row y of the head weight (the head bias is
  not used). No negative class enters a client's loss.
- Server: the shared weights are averaged as in FedAvg, except the class embeddings: row c is the
  count-weighted mean over the clients that hold class c (the paper's server collects ``w_c`` from the
  owners of class c; rows no participating client holds keep their value). Then one gradient step of
  the spread-out regulariser on the normalised class embeddings,

      reg_sp(W) = sum_{c != c'} max(0, margin - ||w_c - w_c'||^2)^2,
      W <- W - server_lr * spreadout_weight * grad reg_sp(W).

Prediction scores classes by cosine similarity, ``cos(g(x), w_c)``, so logits lie in [-1, 1] (the
reported cross-entropy is not comparable with other methods; accuracies are).

Defaults: ``spreadout_weight = 1`` (lambda), ``server_lr = 0.1`` (our choice; the paper steps the server
with the learning rate of its setting), ``positive_margin = 0.9`` (the paper's positive margin),
``margin = 0.9`` (nu) and one server step a round (``server_steps``), the paper's algorithm as we read
it: there is no public code, and its exact nu could not be checked. Public re-implementations differ:
FedRepo and fluke take 30 to 100 server steps a round on a cosine margin. With squared distances
between unit vectors (range [0, 4]) nu = 0.9 pushes two class embeddings apart until their cosine falls
below 0.55; ``margin=2`` asks for orthogonal classes. Local training: the paper's settings could not
be checked; FedAvg's are used.

Simplification: the paper sends each client only its own class embedding; here every client receives
the full weights (``(C - 1) * D`` more floats down per client), which does not change the training
because a client's loss never touches another class's row.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..params import Range
from .base import Algorithm, Training, padded_sum, weighted_mean


def spreadout_regulariser(w: torch.Tensor, margin: float) -> torch.Tensor:
    """``sum_{c != c'} max(0, margin - ||w_c - w_c'||^2)^2`` over the L2-normalised rows of w (C, D)."""
    w = F.normalize(w, dim=1)
    d = (w[:, None, :] - w[None, :, :]).pow(2).sum(-1)  # (C, C) squared distances; no sqrt: smooth at 0
    off_diagonal = ~torch.eye(len(w), dtype=torch.bool, device=w.device)
    return F.relu(margin - d[off_diagonal]).pow(2).sum()


def spreadout_step(w: torch.Tensor, lr: float, margin: float) -> torch.Tensor:
    """One gradient step of :func:`spreadout_regulariser` on w (C, D); returns the new (C, D) tensor."""
    w = w.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        (grad,) = torch.autograd.grad(spreadout_regulariser(w, margin), w)
    return (w - lr * grad).detach()


def positive_loss(z: torch.Tensor, w: torch.Tensor, y: torch.Tensor, positive_margin: float,
                  reduction: str = "mean") -> torch.Tensor:
    """Mean over the batch of ``max(0, positive_margin - cos(z_i, w_{y_i}))^2``; z (B, D), w (C, D), y (B,).
    ``reduction="none"``: each sample's term, (B,)."""
    cos = (F.normalize(z, dim=1) * F.normalize(w, dim=1)[y]).sum(1)  # (B,)
    each = F.relu(positive_margin - cos).pow(2)
    return each.mean() if reduction == "mean" else each


class FedAwS(Algorithm):
    """FedAvg with positive-only local losses and a spread-out step on the class embeddings.

    Parameters
    ----------
    training : local training settings.
    spreadout_weight : lambda, the weight of the spread-out regulariser.
    server_lr : learning rate of the server's step on the class embeddings.
    server_steps : spread-out gradient steps the server takes each round.
    margin : nu, the squared-distance margin of the spread-out regulariser.
    positive_margin : the cosine margin of the positive loss.
    """

    name = "fedaws"
    batched = True
    constraints = {"spreadout_weight": Range(0), "server_lr": Range(0), "server_steps": Range(1),
                   "margin": Range(0), "positive_margin": Range(-1, 1)}

    def __init__(self, training: Training | None = None, spreadout_weight: float = 1.0, server_lr: float = 0.1,
                 server_steps: int = 1, margin: float = 0.9, positive_margin: float = 0.9):
        super().__init__(training)
        self.spreadout_weight = spreadout_weight
        self.server_lr = server_lr
        self.server_steps = server_steps
        self.margin = margin
        self.positive_margin = positive_margin

    def init(self, model, federation):
        server = super().init(model, federation)
        # the state-dict name of the class embeddings (a wrapper may prefix it)
        self.embedding_name = next(f"{n}.weight" for n, m in model.named_modules() if m is model.head)
        if self.embedding_name not in self.shared.names:
            raise ValueError(f"FedAwS needs shared class embeddings; {self.embedding_name!r} is declared local")
        if getattr(model.head, "bias", None) is not None:  # nothing reads it: not trained (no weight decay either)
            model.head.bias.requires_grad_(False)
        return server

    def finish(self, data, loss, client_state):
        upload, client_state = super().finish(data, loss, client_state)
        # which class embeddings this client trained (the server knows each client's class in the paper)
        upload.tensors["class_counts"] = torch.bincount(data.y_train, minlength=self.federation.num_classes).float()
        return upload, client_state

    def loss(self, x: torch.Tensor, y: torch.Tensor, client_state: dict[str, Any]) -> torch.Tensor:
        labels = y if y.dim() == 1 else y.argmax(1)  # (B,) soft targets: the dominant class
        real = client_state.get("real")  # the batched executor's padded batch: which of its samples are real
        z, w = self.model.features(x), self.model.head.weight
        if real is None:
            return positive_loss(z, w, labels, self.positive_margin)
        each = positive_loss(z, w, labels, self.positive_margin, reduction="none")
        return padded_sum(each, real)

    def aggregate(self, server_state, uploads, round_idx):
        weights = weighted_mean([m.tensors["weights"] for _, m in uploads], [m.num_samples for _, m in uploads])
        old = self.shared.view(server_state["weights"], self.embedding_name)  # (C, D)
        rows = torch.zeros_like(old)
        totals = torch.zeros(len(old), device=old.device)  # (C,)
        for _, m in uploads:
            counts = m.tensors["class_counts"].to(old.device)  # (C,)
            rows += counts[:, None] * self.shared.view(m.tensors["weights"], self.embedding_name)
            totals += counts
        held = totals > 0
        embeddings = old.clone()
        embeddings[held] = rows[held] / totals[held, None]
        lr = self.server_lr * self.spreadout_weight
        for _ in range(self.server_steps):
            embeddings = spreadout_step(embeddings, lr, self.margin)
        self.shared.view(weights, self.embedding_name).copy_(embeddings)
        return {**server_state, "weights": weights}

    @torch.no_grad()
    def predict(self, server_state, client_state, x):
        self.load(server_state["weights"], client_state)
        self.model.eval()
        z = F.normalize(self.model.features(x), dim=1)  # (B, D)
        return z @ F.normalize(self.model.head.weight, dim=1).T  # (B, C) cosine similarities
