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

Runs trained together (:func:`fedlab_core.engine.run_together`): the clients of several runs, a grid's rates and
seeds, step together too, grouped at each step by their batch's shape and their run's rates; each run's numbers
are those it has alone (on a GPU because each step maps a fixed :data:`WIDTH` of clients).

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

# clients trained together at most, bounding the memory of their stacked models and batches: on a CPU the gain
# stops early; a GPU needs many clients at once to be busy (LeNet-5 at batch 32: about 1 GB of activations)
CHUNK = {"cpu": 32, "cuda": 1024}
# On a GPU the kernels a mapped step runs depend on its shape, the number of clients in it included, so a client's
# floats would depend on which others step with it (another run's, in runs trained together). There every step
# maps exactly WIDTH clients, padded with copies of the first: a client's numbers depend on its own batches alone.
# On a CPU they do already (measured: runs trained together are the runs trained alone, bit for bit), so a
# step maps the clients it has.
WIDTH = {"cuda": 128}


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


Task = tuple[Algorithm, ClientData, Message, dict[str, Any], torch.Generator]


def local_updates(tasks: list[Task], chunk: int | None = None) -> list[tuple[bool, Any]]:
    """Each task's ``algorithm.local_update(message, client_state, data, rng)``, as (algorithm, data, message,
    client state, rng), computed `chunk` clients at a time (None: the device's :data:`CHUNK`). The tasks' algorithms may be several runs' (runs
    trained together, :func:`run_together`): one class with the same settings but for the local training's
    rates, each run's workspace model of one architecture. Returns ``(True, (upload, new client state))`` or
    ``(False, exception)`` per task, in order; an error in a chunk's training fails that chunk's clients."""
    if chunk is None and tasks:
        chunk = CHUNK.get(next(tasks[0][0].model.parameters()).device.type, CHUNK["cpu"])
    out = []
    for s in range(0, len(tasks), chunk or 1):
        out += _chunk(tasks[s:s + chunk])
    return out


def _chunk(tasks: list[Task]) -> list[tuple[bool, Any]]:
    """:func:`local_updates` for clients trained together: start each, draw its batches, train all, finish each."""
    results: list[Any] = [None] * len(tasks)
    live, starts, contexts, batches = [], [], [], []
    for i, (algorithm, data, message, state, rng) in enumerate(tasks):
        try:
            contexts.append(algorithm.start(message, state))
            params = dict(algorithm.model.named_parameters())
            starts.append({n: p.detach().clone() for n, p in params.items() if p.requires_grad})
            # the loop's draws in the loop's order: a pass's permutation, then each batch's transform
            transform = TRAIN_TRANSFORMS[algorithm.training.train_transform]
            batches.append([(x if transform is None else transform(x, rng), y) for x, y in algorithm.batches(data, rng)])
            live.append(i)
        except Exception as err:
            results[i] = (False, err)
    if not live:
        return results
    try:
        trained, totals = _train([tasks[i][0] for i in live], starts, contexts, batches)
    except Exception as err:
        return [(False, err) if i in live else r for i, r in enumerate(results)]
    for j, i in enumerate(live):
        algorithm, data, message, state, _ = tasks[i]
        try:
            algorithm.start(message, state)  # the client's whole starting model, then its trained parameters
            params = dict(algorithm.model.named_parameters())
            with torch.no_grad():
                for n, v in trained.items():
                    params[n].copy_(v[j])
            results[i] = (True, algorithm.finish(data, mean_loss(totals[j], len(batches[j])), state))
        except Exception as err:
            results[i] = (False, err)
    return results


def _rates(algorithm: Algorithm) -> tuple[float, float, float]:
    """The local training's rates: what may differ between the runs trained together."""
    t = algorithm.training
    return t.lr, t.momentum, t.weight_decay


def _stepper(algorithm: Algorithm, names: list[str], lr: float, momentum: float, weight_decay: float):
    """One client's SGD step (torch.optim.SGD's arithmetic, op for op), mapped over clients: (parameters,
    momenta, correction context, x, y) stacked by client, to new parameters, momenta and losses."""
    loss_module = _Loss(algorithm)

    def step(p, m, context, x, y):
        grads, loss = grad_and_value(lambda q: functional_call(loss_module, {f"model.{n}": v for n, v in q.items()},
                                                               (x, y)))(p)
        grads = algorithm.correct(grads, p, context)
        new_p, new_m = {}, {}
        for n in names:
            g = grads[n]
            if weight_decay:
                g = g.add(p[n], alpha=weight_decay)
            if momentum:  # the buffer starts at zero: its first step is the gradient, as SGD's clone is
                g = new_m[n] = (m[n] * momentum).add(g)
            new_p[n] = p[n].add(g, alpha=-lr)
        return new_p, new_m, loss

    return vmap(step)


def _train(algorithms: list[Algorithm], starts: list[dict[str, torch.Tensor]],
           contexts: list[dict[str, torch.Tensor]], batches: list[list[tuple[torch.Tensor, torch.Tensor]]]
           ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The clients' trained parameters, stacked (clients, *shape) by name, and their summed step losses
    (clients,): every client's optimiser steps on its own batches, from its own start, at its run's rates.
    At each step the clients that have a batch step together, one mapped program per batch shape and rates."""
    names = list(starts[0])
    first = algorithms[0]
    for algorithm in algorithms:
        algorithm.model.train()
    steppers = {rates: _stepper(first, names, *rates) for rates in dict.fromkeys(map(_rates, algorithms))}
    params = {n: torch.stack([s[n] for s in starts]) for n in names}
    momenta = {n: torch.zeros_like(v) for n, v in params.items()} if any(r[1] for r in steppers) else {}
    context = {k: torch.stack([c[k] for c in contexts]) for k in contexts[0]}
    totals = torch.zeros(len(batches), device=params[names[0]].device)
    width, everyone = WIDTH.get(totals.device.type), list(range(len(batches)))
    for s in range(max(len(b) for b in batches)):
        groups: dict[tuple, list[int]] = {}  # clients with a batch at this step, by its shape and their rates
        for c, client_batches in enumerate(batches):
            if s < len(client_batches):
                x, y = client_batches[s]
                groups.setdefault((x.shape, y.shape, _rates(algorithms[c])), []).append(c)
        for (_, _, rates), group in groups.items():
            momentum = momenta if rates[1] else {}
            for call in ([group] if width is None else [group[i:i + width] for i in range(0, len(group), width)]):
                n = len(call)
                if width is not None:
                    call = call + call[:1] * (width - n)
                x = torch.stack([batches[c][s][0] for c in call])
                y = torch.stack([batches[c][s][1] for c in call])
                if call == everyone:  # every client steps: no gather, no scatter
                    params, new_m, loss = steppers[rates](params, momentum, context, x, y)
                    momenta.update(new_m)
                    totals += loss
                    continue
                index = torch.tensor(call, device=totals.device)
                pick = lambda d: {k: v.index_select(0, index) for k, v in d.items()}
                new_p, new_m, loss = steppers[rates](pick(params), pick(momentum), pick(context), x, y)
                index = index[:n]  # the padding's results are dropped
                for d, new in ((params, new_p), (momenta, new_m)):
                    for k, v in new.items():
                        d[k] = d[k].index_copy(0, index, v[:n])
                totals[index] += loss[:n]
    return params, totals
