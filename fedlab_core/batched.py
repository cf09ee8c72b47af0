"""The batched executor: a round's sampled clients trained together, as one vectorised program.

The loop (:func:`fedlab_core.engine._train_client`) runs one client's :meth:`Algorithm.local_update` after
another. Here, for an algorithm that declares ``batched`` (its local update is :meth:`Algorithm.start`, the
base :meth:`Algorithm.train_local`, then :meth:`Algorithm.finish`), every client in a chunk of the round's
clients takes each optimiser step at once: one ``torch.func.vmap`` of ``grad`` over ``functional_call`` of
the algorithm's own :meth:`Algorithm.loss`, its :meth:`Algorithm.correct` (FedProx's proximal pull) and SGD
with the run's momentum and weight decay, written functionally. Nothing of a method is stated twice: the
start, the loss, the gradient correction and the upload are the algorithm's own.

What matches the loop: each client draws its mini-batches with :meth:`Algorithm.batches` (and its training
transform) from its own generator, in the loop's order, so its batches are the loop's batches. Clients with
fewer batches (unequal shards) stop early: at each step only the clients that still have a batch of that
size take it (clients whose batches differ in size at a step, such as a pass's shorter last batch, step in
separate groups), so a finished client's parameters and momentum are never touched, weight decay included.
Each client's mean loss is summed step by step in the loop's order. Only the floats differ: vectorised
kernels may sum in another order than the loop's (on a CPU, LeNet-5's parameters agree to about 1e-7 after
a few rounds, an MLP's bit for bit, the losses to about 1e-7 relative), so a run's
:class:`~fedlab_core.runs.RunConfig` says which executor it used and the key tells them apart.
Batched runs are deterministic: the same run gives the same bits.

Not batched so far (the run trains in the loop, and says so once): methods with a local step of their own,
augmentations (they act inside the step), Adam, and models with buffers (batch-norm statistics would need
per-client handling) or dropout (it draws from the global stream per client).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from .algorithms.base import Algorithm, Message, mean_loss
from .data.federation import ClientData
from .data.transforms import TRAIN_TRANSFORMS

CHUNK = 32  # clients trained together at most: bounds the memory of their stacked models and batches


def unsupported(algorithm: Algorithm, model: nn.Module) -> str | None:
    """Why the batched executor cannot train this run's clients, in a few words; None when it can.
    `algorithm.augment` is the run's augmentation (None: none)."""
    if not algorithm.batched:
        return f"{algorithm.name!r} has a local step of its own"
    if algorithm.augment is not None:
        return f"augmentation {type(algorithm.augment).__name__} acts inside the local step"
    if algorithm.training.optimizer != "sgd":
        return f"optimizer {algorithm.training.optimizer!r} is not batched yet (sgd is)"
    if any(True for _ in model.buffers()):
        return f"{type(model).__name__} has buffers (batch-norm statistics), which are not batched yet"
    if any(isinstance(m, nn.modules.dropout._DropoutNd) for m in model.modules()):
        return f"{type(model).__name__} has dropout, which draws from the global stream"
    return None


class _Loss(nn.Module):
    """The algorithm's loss as a module over the workspace model, so that ``functional_call`` can put any
    parameters into the model while :meth:`Algorithm.loss` runs."""

    def __init__(self, algorithm: Algorithm):
        super().__init__()
        self.model = algorithm.model
        self.algorithm = algorithm

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.algorithm.loss(x, y, {})  # a batched method's loss reads only the model and the batch


def local_updates(algorithm: Algorithm, tasks: list[tuple[ClientData, Message, dict[str, Any], torch.Generator]],
                  chunk: int = CHUNK) -> list[tuple[bool, Any]]:
    """Each task's ``algorithm.local_update(message, client_state, data, rng)``, as (data, message, client
    state, rng), computed `chunk` clients at a time. Returns ``(True, (upload, new client state))`` or
    ``(False, exception)`` per task, in order; an error in a chunk's training fails that chunk's clients."""
    out = []
    for s in range(0, len(tasks), chunk):
        out += _chunk(algorithm, tasks[s:s + chunk])
    return out


def _chunk(algorithm: Algorithm, tasks: list[tuple]) -> list[tuple[bool, Any]]:
    """:func:`local_updates` for clients trained together: start each, draw its batches, train all, finish each."""
    model = algorithm.model
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    transform = TRAIN_TRANSFORMS[algorithm.training.train_transform]
    results: list[Any] = [None] * len(tasks)
    live, starts, contexts, batches = [], [], [], []
    for i, (data, message, state, rng) in enumerate(tasks):
        try:
            contexts.append(algorithm.start(message, state))
            params = dict(model.named_parameters())
            starts.append({n: params[n].detach().clone() for n in names})
            # the loop's draws in the loop's order: a pass's permutation, then each batch's transform
            batches.append([(x if transform is None else transform(x, rng), y) for x, y in algorithm.batches(data, rng)])
            live.append(i)
        except Exception as err:
            results[i] = (False, err)
    if not live:
        return results
    try:
        trained, totals = _train(algorithm, names, starts, contexts, batches)
    except Exception as err:
        return [(False, err) if i in live else r for i, r in enumerate(results)]
    params = dict(model.named_parameters())
    for j, i in enumerate(live):
        data, message, state, _ = tasks[i]
        try:
            algorithm.start(message, state)  # the client's whole starting model, then its trained parameters
            with torch.no_grad():
                for n in names:
                    params[n].copy_(trained[n][j])
            results[i] = (True, algorithm.finish(data, mean_loss(totals[j], len(batches[j])), state))
        except Exception as err:
            results[i] = (False, err)
    return results


def _train(algorithm: Algorithm, names: list[str], starts: list[dict[str, torch.Tensor]],
           contexts: list[dict[str, torch.Tensor]], batches: list[list[tuple[torch.Tensor, torch.Tensor]]]
           ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The clients' trained parameters, stacked (clients, *shape) by name, and their summed step losses
    (clients,): every client's optimiser steps on its own batches, from its own start."""
    t = algorithm.training
    loss_module = _Loss(algorithm)
    algorithm.model.train()

    def step(p, m, context, x, y):
        """One client's SGD step (torch.optim.SGD's arithmetic, op for op): new parameters, momentum, loss."""
        grads, loss = grad_and_value(lambda q: functional_call(loss_module, {f"model.{n}": v for n, v in q.items()},
                                                               (x, y)))(p)
        grads = algorithm.correct(grads, p, context)
        new_p, new_m = {}, {}
        for n in names:
            g = grads[n]
            if t.weight_decay:
                g = g.add(p[n], alpha=t.weight_decay)
            if t.momentum:  # the buffer starts at zero: its first step is the gradient, as SGD's clone is
                g = new_m[n] = (m[n] * t.momentum).add(g)
            new_p[n] = p[n].add(g, alpha=-t.lr)
        return new_p, new_m, loss

    stepped = vmap(step)
    params = {n: torch.stack([s[n] for s in starts]) for n in names}
    momenta = {n: torch.zeros_like(v) for n, v in params.items()} if t.momentum else {}
    context = {k: torch.stack([c[k] for c in contexts]) for k in contexts[0]}
    totals = torch.zeros(len(batches), device=params[names[0]].device)
    for s in range(max(len(b) for b in batches)):
        groups: dict[tuple, list[int]] = {}  # clients with a batch at this step, by its shape
        for c, client_batches in enumerate(batches):
            if s < len(client_batches):
                x, y = client_batches[s]
                groups.setdefault((x.shape, y.shape), []).append(c)
        for group in groups.values():
            x = torch.stack([batches[c][s][0] for c in group])
            y = torch.stack([batches[c][s][1] for c in group])
            if len(group) == len(batches):  # every client steps: no gather, no scatter
                params, momenta, loss = stepped(params, momenta, context, x, y)
                totals += loss
                continue
            index = torch.tensor(group, device=totals.device)
            pick = lambda d: {k: v.index_select(0, index) for k, v in d.items()}
            new_p, new_m, loss = stepped(pick(params), pick(momenta), pick(context), x, y)
            for d, new in ((params, new_p), (momenta, new_m)):
                for k, v in new.items():
                    d[k] = d[k].index_copy(0, index, v)
            totals[index] += loss
    return params, totals
