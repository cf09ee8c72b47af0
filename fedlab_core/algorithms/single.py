"""Single: every client trains its own model on its own data and never communicates; the lower
reference of Table 2 in Chen, Frikha, Krompass, Tresp, "FRAug: Tackling Federated Learning with Non-IID
Features via Representation Augmentation" (ICCV 2023). No hyperparameters beyond the shared :class:`Training`.

Every client starts from the same initial weights and trains `local_epochs` per round when sampled.
Messages are empty (0 bytes), so the log's ``train_loss`` is NaN; each client keeps its last mean loss
in its state instead. ``predict`` with a client state uses that client's model; the global test set is
scored by the ensemble of all clients' models (the mean of their softmax outputs), an evaluation view
that needs no server.
"""
from __future__ import annotations

from typing import Any

import torch

from .base import Algorithm, Message


class Single(Algorithm):
    """Local training only, one model per client."""

    name = "single"

    def init(self, model, federation) -> dict[str, Any]:
        self._initial = super().init(model, federation)["weights"]
        return {}  # there is no global model

    def init_client(self, cid: int) -> dict[str, Any]:
        # one tensor shared by all clients is safe: models are replaced after training, never written in place
        return {"model": self._initial}

    def server_message(self, server_state, cid: int) -> Message:
        return Message()

    def local_update(self, message, client_state, data, rng):
        self.shared.set(client_state["model"])
        loss = self.train_local(data, rng, client_state)
        return Message(), {**client_state, "model": self.shared.get(), "loss": loss}

    def aggregate(self, server_state, uploads, round_idx: int) -> dict[str, Any]:
        return server_state

    @torch.no_grad()
    def predict(self, server_state, client_state, x):
        self.shared.set(client_state["model"])
        self.model.eval()
        return self.model(x)

    def predict_global(self, server_state, client_states, x):
        return self.ensemble(server_state, client_states, x)
