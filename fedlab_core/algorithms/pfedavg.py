"""pFedAvg: FedAvg, then local fine-tuning of the global model for evaluation; the "pFedAvg" baseline of
Table 2 in Chen, Frikha, Krompass, Tresp, "FRAug: Tackling Federated Learning with Non-IID Features via
Representation Augmentation" (ICCV 2023), which gives no further detail.

Default: ``finetune_epochs=1`` pass over the client's training data, with the shared :class:`Training`
(optimiser, learning rate, batch size). Training is FedAvg unchanged; fine-tuning only changes what
``predict`` returns for a client, never the global model. A client's fine-tuned model is computed the
first time it is needed after each round and cached in the algorithm instance (not the client state, so
checkpoints stay the size of FedAvg's); its randomness comes from a generator seeded by (round, client),
so it does not depend on when or how often evaluation runs.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import torch

from ..params import Range
from .base import Algorithm, Training


def finetune_seed(round_idx: int, cid: int) -> int:
    """The seed of client `cid`'s fine-tuning generator after round `round_idx`."""
    return int(np.random.SeedSequence([round_idx, cid, 0x9FEDA]).generate_state(1, np.uint64)[0] >> 1)


class PFedAvg(Algorithm):
    """FedAvg whose per-client predictions come from the global model fine-tuned on the client's data.

    Parameters
    ----------
    finetune_epochs : passes over the client's training data when fine-tuning.
    """

    name = "pfedavg"
    batched = True
    paper_training = Training(lr=0.01, momentum=0.5, batch_size=64, local_steps=20)  # FRAug's code, Digits
    constraints = {"finetune_epochs": Range(0)}

    def __init__(self, training: Training | None = None, finetune_epochs: int = 1):
        super().__init__(training)
        self.finetune_epochs = finetune_epochs

    def init(self, model, federation) -> dict[str, Any]:
        self._cache: dict[tuple[int, int], torch.Tensor] = {}
        return {**super().init(model, federation), "round": 0}

    def init_client(self, cid: int) -> dict[str, Any]:
        # predict sees only the client state, and fine-tuning needs the client's data
        return {**super().init_client(cid), "cid": cid}

    def aggregate(self, server_state, uploads, round_idx: int) -> dict[str, Any]:
        return {**super().aggregate(server_state, uploads, round_idx), "round": round_idx}

    def finetune(self, server_state: dict[str, Any], cid: int) -> torch.Tensor:
        """Client `cid`'s personalised weights: the global model after `finetune_epochs` local passes."""
        key = (server_state["round"], cid)
        if key not in self._cache:
            self._cache = {k: v for k, v in self._cache.items() if k[0] == key[0]}  # drop older rounds
            self.load(server_state["weights"], None)
            seed = finetune_seed(*key)
            devices = [self.device] if self.device.type == "cuda" else []
            training = self.training
            self.training = replace(training, local_epochs=self.finetune_epochs, local_steps=0)
            try:
                # draws from torch's global streams (augmentations) are seeded too, then restored
                with torch.random.fork_rng(devices=devices), torch.enable_grad():
                    torch.default_generator.manual_seed(seed)
                    if devices:
                        torch.cuda.manual_seed(seed)
                    self.train_local(self.federation.clients[cid], torch.Generator().manual_seed(seed), {"cid": cid})
            finally:
                self.training = training
            self._cache[key] = self.shared.get()
        return self._cache[key]

    @torch.no_grad()
    def predict(self, server_state, client_state, x):
        if client_state is None or "cid" not in client_state:
            return super().predict(server_state, client_state, x)
        self.shared.set(self.finetune(server_state, client_state["cid"]))
        self.model.eval()
        return self.model(x)
