"""FRAug's motivation study (Chen et al., ICCV 2023, Table 1): a client's feature extractor trained on a
tenth of its data is a worse bottleneck than its head. The experiment trains each client alone on a small
stratified share of its data, freezes the features, fine-tunes only the head on all of it, and scores both.

An experiment of the book, not part of the algorithm: it runs the Single baseline through :mod:`fedlab_core.runs`.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .data import partition as P
from .runs import build, one_thread, resolve_device

if TYPE_CHECKING:
    import pandas as pd


def head_finetuning(config, fraction: float = 0.1, epochs: int = 20, device: str | torch.device = "auto",
                    batch: int = 256) -> "pd.DataFrame":
    """FRAug's Table 1 on the split of `config`: every client trains the model alone (the Single baseline,
    with the config's local training and rounds) on a class-stratified `fraction` of its training data; then
    the feature extractor is frozen and only the head is fine-tuned for `epochs` passes on the embeddings of
    all the client's training data (SGD, the config's learning rate and momentum, batches of the config's
    size). Both models are scored on the client's test set. Images go through the model `batch` at a time,
    on `device` ("auto": CUDA when there is a GPU).

    Returns one row per client: ``client`` (its domain or id), ``trained_on`` and ``finetuned_on`` (image
    counts), ``before`` and ``after`` (test accuracy).
    """
    import pandas as pd

    if not 0 < fraction < 1:
        raise ValueError(f"fraction: must be in (0, 1), got {fraction}")
    with one_thread():
        sim = build(config.replace(algorithm="single"), resolve_device(device), progress=False)
        full = sim.federation
        small = []
        for c in full.clients:
            keep, _ = P.stratified_split(c.y_train.numpy(), 1 - fraction, config.seed * 100_003 + c.cid)
            keep = torch.as_tensor(keep).to(c.y_train.device)
            small.append(dataclasses.replace(c, x_train=c.x_train[keep], y_train=c.y_train[keep]))
        sim.federation = dataclasses.replace(full, clients=small)
        state = sim.run()
        algo, rows = sim.algorithm, []
        for c_full, c in zip(full.clients, small):
            algo.shared.set(state.clients[c.cid]["model"])
            model = algo.model.eval()
            with torch.no_grad():   # (n, F) embeddings with the frozen statistics, and the logits before
                z, z_test = (torch.cat([model.features(xb) for xb in x.split(batch)]) for x in (c_full.x_train, c.x_test))
                before = float((model.head(z_test).argmax(1) == c.y_test).float().mean())
            head = copy.deepcopy(model.head)
            opt = torch.optim.SGD(head.parameters(), lr=config.lr, momentum=config.momentum)
            rng = torch.Generator().manual_seed(config.seed * 100_003 + c.cid)
            for _ in range(epochs):
                for idx in torch.randperm(len(z), generator=rng).split(config.batch_size):
                    idx = idx.to(z.device)
                    opt.zero_grad(set_to_none=True)
                    F.cross_entropy(head(z[idx]), c_full.y_train[idx]).backward()
                    opt.step()
            with torch.no_grad():
                after = float((head(z_test).argmax(1) == c.y_test).float().mean())
            rows.append({"client": c.domain or c.cid, "trained_on": c.num_train, "finetuned_on": c_full.num_train,
                         "before": before, "after": after})
    return pd.DataFrame(rows)
