"""PartialFed (Sun, Huo, Yang, Bai, "PartialFed: Cross-Domain Personalized Federated Learning via Partial
Initialization", NeurIPS 2021), the fixed-strategy variant PartialFed-Fix.

Each round a client initialises only part of its model from the global model and keeps the rest from its
own model of the previous round; it trains, then uploads its whole model, which the server averages as
FedAvg does (so, unlike FedBN, every entry is sent and the global model is complete). A client's first
round starts from the global model entirely. ``predict`` with a client state uses the client's last
trained model (the personalised model); without one, the global model.

Default strategy (``global_patterns=None``): every entry except batch norm is loaded from the global model;
batch-norm weights, biases and running statistics (found by module type) are kept from the client's
previous model. This split is our choice: PartialFed-Fix keeps a hand-picked set of layers, and the
layer choice of the paper's classification experiments is not reproduced here; for feature shift, which
PartialFed targets, the layers that carry a domain's feature statistics are the normalisation layers, so
they are the ones kept. The paper's adaptive variant (PartialFed-Adaptive, a learned per-layer choice)
is not implemented. The default strategy refuses a model without batch norm (it would silently be FedAvg
with a local evaluation): pass ``keep_patterns=("head.*",)`` to keep the classifier local instead. A pattern
that matches no entry of the model is refused too.

Local training: the paper's settings could not be checked (there is no public code); FedAvg's are used.

Parameters: ``global_patterns`` (glob patterns on state-dict names loaded from the global model; None:
all but batch norm) and ``keep_patterns`` (entries kept local whatever ``global_patterns`` says).
"""
from __future__ import annotations

import fnmatch
from typing import Any

import torch

from ..models import BATCH_NORM, require_layers
from .base import Algorithm, FlatState, Training
from .fedbn import batch_norm_entries


class PartialFed(Algorithm):
    """FedAvg with partial initialisation of the local model from the global one.

    Parameters
    ----------
    global_patterns : entries loaded from the global model each round (None: every non-batch-norm entry).
    keep_patterns : entries always kept from the client's previous model.
    """

    name = "partialfed"
    batched = True

    def __init__(self, training: Training | None = None, global_patterns: tuple[str, ...] | None = None,
                 keep_patterns: tuple[str, ...] = ()):
        super().__init__(training)
        self.global_patterns = None if global_patterns is None else tuple(global_patterns)
        self.keep_patterns = tuple(keep_patterns)

    def check_model(self, model) -> None:
        if self.global_patterns is None and not self.keep_patterns:
            require_layers(model, BATCH_NORM, self.name, "keeps each client's batch-norm layers by default "
                           "(give global_patterns or keep_patterns to keep other entries)")
        names = list(model.state_dict())
        for label, patterns in (("global_patterns", self.global_patterns or ()), ("keep_patterns", self.keep_patterns)):
            for p in patterns:
                if not any(fnmatch.fnmatch(n, p) for n in names):
                    raise ValueError(f"{self.name!r} parameter {label!r}: pattern {p!r} matches no entry of "
                                     f"{type(model).__name__} (its entries: {', '.join(names)})")

    def init(self, model, federation) -> dict[str, Any]:
        server = super().init(model, federation)
        bn = set(batch_norm_entries(model))
        match = lambda name, patterns: any(fnmatch.fnmatch(name, p) for p in patterns)

        def from_global(name: str) -> bool:
            chosen = name not in bn if self.global_patterns is None else match(name, self.global_patterns)
            return chosen and not match(name, self.keep_patterns)

        self.kept = FlatState(model, keep=lambda n: n in self.shared.names and not from_global(n))
        return server

    def start(self, message, client_state) -> dict[str, torch.Tensor]:
        context = super().start(message, client_state)
        if "model" in client_state and self.kept.size:
            # overwrite the entries this client keeps with its previous values
            previous = client_state["model"]  # (shared.size,)
            self.kept.set(torch.cat([self.shared.view(previous, n).reshape(-1) for n in self.kept.names]))
        return context

    def finish(self, data, loss, client_state):
        client_state = {**client_state, "model": self.shared.get()}
        return self.upload(data, loss, client_state), client_state

    @torch.no_grad()
    def predict(self, server_state, client_state, x):
        if not client_state or "model" not in client_state:
            return super().predict(server_state, client_state, x)
        self.shared.set(client_state["model"])
        self.model.eval()
        return self.model(x)
