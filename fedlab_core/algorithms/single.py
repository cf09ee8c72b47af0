"""Single: every client trains its own model on its own data and never communicates; the lower
reference of Table 2 in Chen, Frikha, Krompass, Tresp, "FRAug: Tackling Federated Learning with Non-IID
Features via Representation Augmentation" (ICCV 2023). Local training as FRAug's code runs Digits
(github HaokunChen245/FRAug, ``main.py``): SGD, lr 0.01, momentum 0.5, 20 local steps of batch 64.

Every client starts from the same initial weights and trains `local_epochs` per round when sampled.
Messages are empty (0 bytes), so the log's ``train_loss`` is NaN; each client keeps its last mean loss
in its state instead. ``predict`` uses the client's model; there is no global model, so the global test
set is not scored (``global_model`` False).
"""
from __future__ import annotations

from typing import Any

import torch

from .base import Algorithm, Message, Training


class Single(Algorithm):
    """Local training only, one model per client."""

    name = "single"
    paper_training = Training(lr=0.01, momentum=0.5, batch_size=64, local_steps=20)
    global_model = False
    batched = True

    def init(self, model, federation) -> dict[str, Any]:
        self._initial = super().init(model, federation)["weights"]
        return {}  # there is no global model

    def init_client(self, cid: int) -> dict[str, Any]:
        # one tensor shared by all clients is safe: models are replaced after training, never written in place
        return {"model": self._initial}

    def server_message(self, server_state, cid: int) -> Message:
        return Message()

    def start(self, message, client_state) -> dict[str, torch.Tensor]:
        self.shared.set(client_state["model"])
        return {}

    def finish(self, data, loss, client_state):
        return Message(), {**client_state, "model": self.shared.get(), "loss": loss}

    def aggregate(self, server_state, uploads, round_idx: int) -> dict[str, Any]:
        return server_state

    @torch.no_grad()
    def predict(self, server_state, client_state, x):
        self.shared.set(client_state["model"])
        self.model.eval()
        return self.model(x)

