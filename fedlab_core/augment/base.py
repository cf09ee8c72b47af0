"""The augmentation protocol: data-level plug-ins that compose with any algorithm.

An augmentation may (0) change the model before training (AdvProp's auxiliary batch norm); (1) run a
set-up exchange before training (FedRDN's statistics, OT alignment's barycenters), returning the
messages it sent so the engine counts their bytes, and may transform the federation's data (OT
alignment maps every client's train and test images there, once); (2) transform each training
mini-batch (mixup, AdvProp, FedRDN); (3) transform evaluation inputs per client (FedRDN's own
statistics). The base class does nothing, which is the "none" augmentation.
"""
from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from ..algorithms.base import Message
from ..data.federation import Federation
from ..params import Configurable


class Augment(Configurable):
    """No augmentation; the hooks others override. Constructing one checks its arguments against its
    ``constraints`` and annotations (:mod:`fedlab_core.params`). ``shares`` says in words what a client
    sends for it beyond the algorithm's messages ("" for nothing). ``batched`` says whether :meth:`train_batch`
    reads only the batch and the client's generator (not the model, nor torch's global stream), so that the
    batched executor (:mod:`fedlab_core.batched`) can apply it as the batches are drawn."""

    name = "none"
    shares = ""
    not_settings = ()
    batched: ClassVar[bool] = True

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """Before the algorithm sees the model: return it, or a wrapper around it."""
        return model

    def setup(self, federation: Federation, seed: int) -> tuple[Federation, list[Message], list[Message]]:
        """Before round 1: return (federation to train on, messages sent up, messages sent down)."""
        return federation, [], []

    def train_batch(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, cid: int,
                    rng: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Transform one training batch of client `cid`; y may become soft targets (B, classes)."""
        return x, y

    def eval_input(self, x: torch.Tensor, cid: int | None) -> torch.Tensor:
        """Transform evaluation inputs of client `cid` (None: the global test set)."""
        return x
