"""FRAug's motivation study (Chen et al., ICCV 2023, Table 1): a client's feature extractor trained on a
tenth of its data is a worse bottleneck than its head. The experiment trains each client alone on a small
stratified share of its data, freezes the features, fine-tunes only the head on all of it, and scores both.

An experiment of the book, not part of the algorithm: it runs the Single baseline through :mod:`fedlab_core.runs`.
"""
from __future__ import annotations

import copy
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from .kernels import deterministic
from .runs import measured, one_thread

if TYPE_CHECKING:
    import pandas as pd

    from .engine import Simulation, SimulationState


def head_finetuning(config, fraction: float = 0.1, epochs: int = 20, device: str | torch.device = "auto",
                    batch: int = 256) -> "pd.DataFrame":
    """FRAug's Table 1 on the split of `config`: every client trains the model alone (the Single baseline,
    with the config's local training and rounds) on a class-stratified `fraction` of its training data; then
    the feature extractor is frozen and only the head is fine-tuned for `epochs` passes on the embeddings of
    all the client's training data (SGD, the config's learning rate and momentum, batches of the config's
    size). Both models are scored on the client's test set. Images go through the model `batch` at a time,
    on `device` ("auto": CUDA when there is a GPU).

    The Single run is an ordinary run, read from the archive or the cache like any other, and what is measured
    on its final state is stored (:func:`~fedlab_core.runs.measured`: computed once, then read). Its config holds
    the rest of each client's training data out as a monitored validation set (``validation_monitor = 1 -
    fraction``, ``validation_source = "share"`` whatever `config` says), which is the data the head is then
    fine-tuned on together with the `fraction` trained on.

    Returns one row per client: ``client`` (its domain or id), ``trained_on`` and ``finetuned_on`` (image
    counts), ``before`` and ``after`` (test accuracy).
    """
    import pandas as pd

    if not 0 < fraction < 1:
        raise ValueError(f"fraction: must be in (0, 1), got {fraction}")
    # the rest of each client's own data is held out, whatever validation set the chapter's runs monitor
    single = config.replace(algorithm="single", validation_monitor=1 - fraction, validation_source="share")
    rows = measured("fraug_head_finetuning", single, partial(finetuned_heads, config=single, epochs=epochs, batch=batch),
                    settings={"epochs": epochs, "batch": batch}, sources=("finetune.py::finetuned_heads",),
                    device=device)
    return pd.DataFrame(rows)


def finetuned_heads(sim: Simulation, state: SimulationState, config, epochs: int, batch: int) -> list[dict[str, Any]]:
    """:func:`head_finetuning`'s measurement of the trained Single run `config` (`state` its final state, `sim`
    its simulation; the config gives the head's optimiser, batches and seed): one row per client."""
    algo, rows = sim.algorithm, []
    with one_thread(), deterministic(sim.federation.x_test.device):   # as the run itself computed
        for c in sim.federation.clients:
            x_all, y_all = torch.cat([c.x_train, c.x_val]), torch.cat([c.y_train, c.y_val])
            algo.shared.set(state.clients[c.cid]["model"])
            model = algo.model.eval()
            with torch.no_grad():   # (n, F) embeddings with the frozen statistics, and the logits before
                z, z_test = (torch.cat([model.features(xb) for xb in x.split(batch)]) for x in (x_all, c.x_test))
                before = float((model.head(z_test).argmax(1) == c.y_test).float().mean())
            head = copy.deepcopy(model.head)
            opt = torch.optim.SGD(head.parameters(), lr=config.lr, momentum=config.momentum)
            rng = torch.Generator().manual_seed(config.seed * 100_003 + c.cid)
            for _ in range(epochs):
                for idx in torch.randperm(len(z), generator=rng).split(config.batch_size):
                    idx = idx.to(z.device)
                    opt.zero_grad(set_to_none=True)
                    F.cross_entropy(head(z[idx]), y_all[idx]).backward()
                    opt.step()
            with torch.no_grad():
                after = float((head(z_test).argmax(1) == c.y_test).float().mean())
            rows.append({"client": c.domain or c.cid, "trained_on": c.num_train, "finetuned_on": len(y_all),
                         "before": before, "after": after})
    return rows
