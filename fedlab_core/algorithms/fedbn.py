"""FedBN (Li, Jiang, Zhang, Kamp, Dou, "FedBN: Federated Learning on Non-IID Features via Local Batch
Normalization", ICLR 2021): FedAvg in which every batch-norm parameter and running statistic stays on its
client; only the other entries are sent and averaged.

Batch-norm layers are found by module type, not by name: the models here name them ``conv.1``, ``fc.4``,
``layer2.0.downsample.1``..., which no glob on names catches. No hyperparameters of its own. A model
without batch norm is refused: FedBN on it would silently be FedAvg. Local training as the authors'
code runs Digits (github med-air/FedBN, ``fed_digits.py``): SGD, lr 0.01, batch 32, one local epoch.

There is no global FedBN model: per-client accuracy is FedBN's metric, and the global test set is not
scored (``global_model`` False).
"""
from __future__ import annotations

from typing import Any

from torch import nn

from ..models import BATCH_NORM, require_layers
from .base import Algorithm, Training


def batch_norm_entries(model: nn.Module) -> list[str]:
    """State-dict names of every entry owned by a batch-norm module (weights, biases, statistics)."""
    names = []
    for name in model.state_dict():
        owner = model.get_submodule(name.rpartition(".")[0])
        if isinstance(owner, nn.modules.batchnorm._BatchNorm):
            names.append(name)
    return names


class FedBN(Algorithm):
    """FedAvg with client-local batch norm."""

    name = "fedbn"
    paper_training = Training(lr=0.01, batch_size=32, local_epochs=1)
    global_model = False
    batched = True

    def init(self, model: nn.Module, federation) -> dict[str, Any]:
        # exact names are valid glob patterns; set before the base class splits the state
        self.local_patterns = tuple(batch_norm_entries(model))
        return super().init(model, federation)

    def check_model(self, model: nn.Module) -> None:
        require_layers(model, BATCH_NORM, self.name, "keeps each client's batch-norm layers local")
