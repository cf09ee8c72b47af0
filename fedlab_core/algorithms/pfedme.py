"""pFedMe (Dinh, Tran, Nguyen, "Personalized Federated Learning with Moreau Envelopes", NeurIPS 2020).

Each client keeps a personal model theta regularised towards its local copy w of the global model by
lam/2 ||theta - w||^2 (a Moreau envelope). Per mini-batch D (Algorithm 1):

    K times:  theta <- theta - personal_lr * (grad f(theta; D) + lam (theta - w))   (approximate prox)
    then:     w     <- w - lr * lam (w - theta)

theta starts each round from the received global model and is warm-started from batch to batch. The
client uploads w; the server mixes, w_global <- (1 - beta) w_global + beta * mean_i w_i, with the
paper's unweighted mean over the sampled clients (Algorithm 1); the authors' code weights the mean by
the clients' sample counts (``serverbase.py``), which ``sample_weighted=True`` does.
``predict`` with a client state uses the client's personal theta; without one, the global w.

Defaults as the paper's MNIST comparison runs them (github CharlieDinh/pFedMe, README's commands):
``lam=15``, ``K=5``, ``beta=1.0``, ``personal_lr=0.09``, and the local training eta = lr = 0.005 over
R = 20 local iterations of one batch of 20 each (``local_steps=20``), so that the pull eta * lam is
0.075. pFedMe's updates are plain gradient steps: momentum and weight decay do not apply.
"""
from __future__ import annotations

from typing import Any

import torch

from ..params import Range
from .base import Algorithm, Training, copy_all, weighted_mean


class PFedMe(Algorithm):
    """Personalised FL with Moreau envelopes.

    Parameters
    ----------
    lam : strength of the pull of the personal model towards the local copy of the global model.
    personal_lr : learning rate of the K inner steps on the personal model.
    K : inner steps per mini-batch.
    beta : server mixing: 1 replaces the global model by the clients' mean.
    sample_weighted : weight the clients' mean by their sample counts instead of uniformly.
    """

    name = "pfedme"
    batched = True
    paper_training = Training(lr=0.005, batch_size=20, local_steps=20)
    constraints = {"lam": Range(0, low_open=True), "personal_lr": Range(0, low_open=True), "K": Range(1),
                   "beta": Range(0, low_open=True)}

    def __init__(self, training: Training | None = None, lam: float = 15.0, personal_lr: float = 0.09,
                 K: int = 5, beta: float = 1.0, sample_weighted: bool = False):
        super().__init__(training)
        self.lam, self.personal_lr, self.K, self.beta = lam, personal_lr, K, beta
        self.sample_weighted = sample_weighted

    def start(self, message, client_state) -> dict[str, torch.Tensor]:
        """theta <- w_global (the received weights), and the local copy w of each parameter beside it."""
        context = super().start(message, client_state)
        self._anchor = {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}
        return context

    def carried(self) -> dict[str, torch.Tensor]:
        return self._anchor  # the local copy w, by parameter

    def finish(self, data, loss, client_state):
        client_state = {**client_state, "personal": self.shared.get()}  # theta, with its BN statistics
        params = dict(self.model.named_parameters())
        copy_all([params[n] for n in self._anchor], list(self._anchor.values()))  # the upload is w
        return self.upload(data, loss, client_state), client_state

    def step_rule(self, params, carried, gradient, lr):
        """Algorithm 1 on one batch: K proximal steps on theta (`params`) towards w (`carried`), then w's step;
        the loss is the data loss of theta before the batch's inner steps."""
        first = None
        for _ in range(self.K):
            grads, loss = gradient(params)
            first = loss if first is None else first
            params = {n: p - self.personal_lr * (grads[n] + self.lam * (p - carried[n])) for n, p in params.items()}
        factor = lr * self.lam
        carried = {n: w - factor * (w - params[n]) for n, w in carried.items()}
        return params, carried, first

    def train_step(self, x, y, opt, client_state) -> torch.Tensor:
        """:meth:`step_rule` on the workspace model: each inner step's theta put into its parameters, the loss's
        gradients read from them."""
        params = {n: p for n, p in self.model.named_parameters() if p.requires_grad}

        def gradient(theta):
            copy_all(list(params.values()), list(theta.values()))
            self.model.zero_grad(set_to_none=True)
            loss = self.loss(x, y, client_state)
            loss.backward()
            self.before_step(client_state)
            return {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in params.items()}, loss.detach()

        theta, self._anchor, first = self.step_rule({n: p.detach() for n, p in params.items()}, self._anchor,
                                                    gradient, self.training.lr)
        copy_all(list(params.values()), list(theta.values()))
        return first

    def aggregate(self, server_state, uploads, round_idx: int) -> dict[str, Any]:
        weights = [m.num_samples if self.sample_weighted else 1.0 for _, m in uploads]
        mean = weighted_mean([m.tensors["weights"] for _, m in uploads], weights)
        mixed = (1 - self.beta) * server_state["weights"] + self.beta * mean
        return {**server_state, "weights": mixed}

    @torch.no_grad()
    def predict(self, server_state, client_state, x):
        if not client_state or "personal" not in client_state:
            return super().predict(server_state, client_state, x)
        self.shared.set(client_state["personal"])
        self.model.eval()
        return self.model(x)
