"""The algorithm protocol: the seam between the engine and every federated method.

The engine (``fedlab_core.engine``) knows nothing about any method. Each round it asks the algorithm
for the message a sampled client receives (:meth:`Algorithm.server_message`), runs the client's
:meth:`Algorithm.local_update`, collects the uploads and hands them to :meth:`Algorithm.aggregate`.
Evaluation goes through :meth:`Algorithm.predict`. Everything that crosses the network is a
:class:`Message`, whose bytes the engine counts; the server side sees nothing else.

:class:`Algorithm` is FedAvg's machinery (McMahan et al., AISTATS 2017): local SGD on a workspace
model, uploads of the flattened weights, sample-weighted averaging of every floating-point state
entry (batch-norm running statistics included). Other methods subclass it and override only the
hooks where they differ.
"""
from __future__ import annotations

import contextlib
import fnmatch
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..data.federation import ClientData, Federation
from ..data.transforms import TRAIN_TRANSFORMS
from ..params import Configurable


class NonFiniteLossError(FloatingPointError):
    """A client's training loss became NaN or infinite; the run stops."""


class ClientsFailedError(RuntimeError):
    """Every client sampled in a round raised during its update; the run stops and is not cached."""


@dataclass
class Message:
    """What one client sends or receives in one round.

    tensors : named tensors (weights, control variates, offsets, statistics).
    num_samples : the sender's training-set size, the aggregation weight (8 bytes when set).
    metrics : scalar training metrics such as the mean local loss (8 bytes each).
    diagnostics : scalars for the run's log that a deployment would not send (DisTrans's offset_change);
        not counted in the bytes. The engine logs each one's mean over the round's clients.
    """

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    num_samples: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    diagnostics: dict[str, float] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        tensor_bytes = sum(t.numel() * t.element_size() for t in self.tensors.values())
        return tensor_bytes + 8 * len(self.metrics) + (8 if self.num_samples else 0)


@dataclass(frozen=True)
class Training:
    """How a client trains locally. Each algorithm declares its paper's as ``paper_training``; a run's
    config overrides any field of it."""

    local_epochs: int = 1       # passes over the local data per round
    local_steps: int = 0        # if > 0: this many mini-batches per round instead of epochs
    batch_size: int = 32        # mini-batch size
    optimizer: str = "sgd"      # "sgd" or "adam"
    lr: float = 0.05            # local learning rate
    momentum: float = 0.0       # SGD momentum (reset every round)
    weight_decay: float = 0.0   # L2 penalty
    train_transform: str = "none"  # random transform of every training batch (see fedlab_core.data.transforms)


def pass_slices(n: int, batch_size: int) -> list[slice]:
    """The mini-batches of one shuffled pass over `n` samples, as slices of the permutation; a trailing
    batch of one sample is dropped (batch norm cannot train on it)."""
    return [slice(s, min(s + batch_size, n)) for s in range(0, n, batch_size) if not (n - s == 1 and n > 1)]


def local_samples(n: int, training: Training) -> int:
    """The samples one client with `n` training samples goes through in a round of
    :meth:`Algorithm.batches`: `local_epochs` passes, or `local_steps` mini-batches."""
    sizes = [b.stop - b.start for b in pass_slices(n, training.batch_size)]
    if not training.local_steps:
        return training.local_epochs * sum(sizes)
    full, rest = divmod(training.local_steps, len(sizes)) if sizes else (0, 0)
    return full * sum(sizes) + sum(sizes[:rest])


def local_steps_taken(n: int, training: Training) -> int:
    """The optimiser steps one client with `n` training samples takes in a round of :meth:`Algorithm.batches`:
    a step per mini-batch of its `local_epochs` passes, or `local_steps` (none without a batch to draw)."""
    per_pass = len(pass_slices(n, training.batch_size))
    if training.local_steps:
        return training.local_steps if per_pass else 0
    return training.local_epochs * per_pass


@contextlib.contextmanager
def frozen_statistics(model: nn.Module):
    """Batch norm normalises with the batch as in training but leaves its running statistics alone."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    saved = [(m.momentum, m.num_batches_tracked.clone() if m.num_batches_tracked is not None else None)
             for m in norms]
    for m in norms:
        m.momentum = 0.0  # running = (1 - 0) * running + 0 * batch
    try:
        yield
    finally:
        for m, (momentum, tracked) in zip(norms, saved):
            m.momentum = momentum
            if tracked is not None:
                m.num_batches_tracked.copy_(tracked)


class FlatState:
    """A view of some of a module's floating-point state entries as one flat vector.

    Parameters
    ----------
    model : the module.
    keep : predicate on state-dict names; entries for which it is False are left out.
    """

    def __init__(self, model: nn.Module, keep=lambda name: True):
        state = model.state_dict(keep_vars=True)
        self.names = [k for k, v in state.items() if v.is_floating_point() and keep(k)]
        self._tensors = [state[k].data for k in self.names]
        self._numels = [t.numel() for t in self._tensors]
        self.size = sum(self._numels)

    def get(self) -> torch.Tensor:
        """The entries concatenated into a new (size,) tensor."""
        if not self._tensors:
            return torch.zeros(0)
        return torch.cat([t.reshape(-1) for t in self._tensors])

    def view(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        """The part of a (size,) vector that holds entry `name`, shaped like that entry (a view)."""
        i = self.names.index(name)
        start = sum(self._numels[:i])
        return flat[start:start + self._numels[i]].view_as(self._tensors[i])

    def parameter_mask(self, model: nn.Module) -> torch.Tensor:
        """A (size,) bool vector: True where the vector holds a parameter, False for buffers.

        Server-side optimisers (momentum, normalised averaging, control variates) act on parameters;
        buffers such as batch-norm running statistics are averaged as FedAvg does.
        """
        params = {name for name, _ in model.named_parameters()}
        mask = torch.zeros(self.size, dtype=torch.bool)
        for name in self.names:
            if name in params:
                self.view(mask, name).fill_(True)
        return mask.to(next(model.parameters()).device)

    def set(self, flat: torch.Tensor) -> None:
        """Copy a (size,) vector back into the module's entries."""
        copy_all(self._tensors, [chunk.view_as(t) for t, chunk in zip(self._tensors, flat.split(self._numels))])


@torch.no_grad()
def copy_all(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``t.copy_(s)`` for each pair, as one fused copy per pair of types (``torch._foreach_copy_``): on a GPU a few
    launches for a model's entries, not one each; the same bits as the copies one by one."""
    groups: dict[tuple, tuple[list, list]] = {}
    for t, s in zip(targets, sources, strict=True):
        group = groups.setdefault((t.dtype, s.dtype, t.device, s.device), ([], []))
        group[0].append(t)
        group[1].append(s)
    for ts, ss in groups.values():
        torch._foreach_copy_(ts, ss)


def padded_sum(each: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """A padded batch's per-sample terms `each` (B,) summed over its `real` samples (B,) bool and divided by the
    full batch size B, as a loss on the batched executor's padded batches is (it rescales the loss and its gradients
    to the real samples); the padding adds nothing, not even a gradient."""
    return torch.where(real, each, 0.0).sum() / len(real)


def mean_loss(total: torch.Tensor, steps: int) -> float:
    """A local update's mean training loss from its summed step losses; raises
    :class:`NonFiniteLossError` when it is NaN or infinite."""
    loss = (total / max(steps, 1)).item()
    if not math.isfinite(loss):
        raise NonFiniteLossError(f"training loss is {loss}")
    return loss


def weighted_mean(vectors: list[torch.Tensor], weights: Iterable[float]) -> torch.Tensor:
    """sum_k w_k v_k / sum_k w_k for equally shaped tensors (accumulated in place: no stacked copy)."""
    weights = [float(w) for w in weights]
    total = sum(weights)
    out = torch.zeros_like(vectors[0])
    for w, v in zip(weights, vectors):
        out.add_(v, alpha=w / total)
    return out


class Algorithm(Configurable):
    """FedAvg, and the hooks every other algorithm overrides.

    Class attributes
    ----------------
    name : registry name.
    local_patterns : glob patterns of state-dict names that never leave the client (e.g. FedBN's
        ``"*bn*"``); they live in the client state and are never averaged.
    constraints : the ranges and allowed values of the constructor's parameters (their types are the
        annotations); see :mod:`fedlab_core.params`. Constructing an algorithm checks its arguments.
    paper_training : the local training its paper uses (cited beside it): the default when neither the
        constructor nor a run's config says otherwise. Every algorithm states its own.
    global_model : whether the method has a global model to score on the global test set; methods
        without one (FedBN, Single, pFedHN, FedProto) are scored on the clients' own test sets only.
    shares : what a client sends beyond its model weights, in words ("" for nothing more), for the
        book's privacy notes; the byte counts of every message say how much.
    batched : whether the batched executor (:mod:`fedlab_core.batched`) can train the method's clients: its
        local update is :meth:`start`, this class's :meth:`train_local` (optimiser steps on :meth:`loss`, a loss
        that reads the model, the batch and :meth:`frozen_models`, with the gradients :meth:`correct` gives),
        then :meth:`finish`. On the batched executor's padded batches the loss's `client_state` is ``{"real": (B,)
        bool}``; the padding's logits of the model's forward are replaced by constants of zero loss, and a loss
        that computes its logits otherwise (MOON, FedAwS) sums its real samples' terms over B itself. Every trained
        parameter must be reached by the loss (the executor steps it, weight decay included, where the loop's
        optimiser skips a parameter without a gradient): one it never reaches is not trained (FedAwS's head bias).
        Each class says so itself: a subclass is not batched unless it sets it (FRAug is FedBN with a step of its
        own).
    """

    name = "fedavg"
    local_patterns: tuple[str, ...] = ()
    # McMahan et al. 2017, Table 2 (MNIST CNN): B = 10, E = 5; the paper tunes the rate per setting and
    # states no single value: 0.05 is ours
    paper_training: ClassVar[Training] = Training(local_epochs=5, batch_size=10, lr=0.05)
    global_model: ClassVar[bool] = True
    shares: ClassVar[str] = ""
    batched: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.batched = cls.__dict__.get("batched", False)  # not inherited: see the class's notes

    def __init__(self, training: Training | None = None):
        self.training = training or self.paper_training
        self.augment = None  # set by the engine; None means no augmentation
        self.num_rounds = 1  # the run's number of rounds R, set by the engine (schedules such as FRAug's use it)

    # ------------------------------------------------------------------ protocol

    def init(self, model: nn.Module, federation: Federation) -> dict[str, Any]:
        """Take the workspace model and return the initial server state."""
        self.model = model
        self.federation = federation
        self.device = next(model.parameters()).device
        is_local = lambda name: any(fnmatch.fnmatch(name, p) for p in self.local_patterns)
        self.shared = FlatState(model, keep=lambda n: not is_local(n))
        self.local = FlatState(model, keep=is_local)
        return {"weights": self.shared.get()}

    def init_client(self, cid: int) -> dict[str, Any]:
        """What client `cid` keeps between rounds (here: its local entries, if any)."""
        return {"local": self.local.get()} if self.local.size else {}

    def server_message(self, server_state: dict[str, Any], cid: int) -> Message:
        """What client `cid` receives at the start of a round."""
        return Message({"weights": server_state["weights"]})

    def local_update(self, message: Message, client_state: dict[str, Any], data: ClientData,
                     rng: torch.Generator) -> tuple[Message, dict[str, Any]]:
        """Train on the client's data and return (upload, new client state): :meth:`start`, :meth:`train_local`,
        :meth:`finish`."""
        self.start(message, client_state)
        return self.finish(data, self.train_local(data, rng, client_state), client_state)

    def start(self, message: Message, client_state: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Put the model a client's local training starts from into the workspace model (here the received
        global weights, with the client's local entries) and return the tensors its steps read besides the
        parameters and the batch: the `context` of :meth:`correct` (here none)."""
        self.load(message.tensors["weights"], client_state)
        return {}

    def finish(self, data: ClientData, loss: float, client_state: dict[str, Any]) -> tuple[Message, dict[str, Any]]:
        """(upload, new client state) from the trained workspace model and the mean training loss."""
        return self.upload(data, loss, client_state), client_state

    def aggregate(self, server_state: dict[str, Any], uploads: list[tuple[int, Message]],
                  round_idx: int) -> dict[str, Any]:
        """New server state from the round's uploads, as (client id, message) pairs."""
        weights = weighted_mean([m.tensors["weights"] for _, m in uploads], [m.num_samples for _, m in uploads])
        return {**server_state, "weights": weights}

    @torch.no_grad()
    def predict(self, server_state: dict[str, Any], client_state: dict[str, Any] | None,
                x: torch.Tensor) -> torch.Tensor:
        """Logits (B, classes) for inputs x (B, C, H, W): the global model, with the client's
        local entries when a client state is given."""
        self.load(server_state["weights"], client_state)
        self.model.eval()
        return self.model(x)

    @torch.no_grad()
    def embed(self, server_state: dict[str, Any], client_state: dict[str, Any] | None,
              x: torch.Tensor) -> torch.Tensor:
        """Representations ``features(x)`` (B, D) of the model that :meth:`predict` uses."""
        self.load(server_state["weights"], client_state)
        self.model.eval()
        return self.model.features(x)

    def predict_global(self, server_state: dict[str, Any], client_states: dict[int, dict[str, Any]],
                       x: torch.Tensor) -> torch.Tensor:
        """Logits for the global test set. Default: :meth:`predict` with no client state (the global model).

        This is the evaluator's view, not a server step: methods that have no global model (FedBN,
        Single) override it to score the clients' ensemble from every client's state.
        """
        return self.predict(server_state, None, x)

    @torch.no_grad()
    def ensemble(self, server_state: dict[str, Any], client_states: dict[int, dict[str, Any]],
                 x: torch.Tensor) -> torch.Tensor:
        """Log of the mean of the clients' softmax outputs (B, classes): an ensemble of personal models."""
        probs = sum(self.predict(server_state, s, x).softmax(1) for s in client_states.values())
        return (probs / len(client_states)).clamp_min(1e-12).log()

    # ------------------------------------------------------------------ building blocks

    def load(self, weights: torch.Tensor, client_state: dict[str, Any] | None) -> None:
        """Put global weights (and the client's local entries) into the workspace model."""
        self.shared.set(weights)
        if client_state and "local" in client_state:
            self.local.set(client_state["local"])

    def upload(self, data: ClientData, loss: float, client_state: dict[str, Any]) -> Message:
        """The default upload: the trained shared weights; local entries go to the client state."""
        if self.local.size:
            client_state["local"] = self.local.get()
        return Message({"weights": self.shared.get()}, num_samples=data.num_train, metrics={"loss": loss})

    def make_optimizer(self, params) -> torch.optim.Optimizer:
        t = self.training
        if t.optimizer == "adam":
            return torch.optim.Adam(params, lr=t.lr, weight_decay=t.weight_decay)
        return torch.optim.SGD(params, lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)

    def batches(self, data: ClientData, rng: torch.Generator):
        """Mini-batches (x, y) for one round: `local_epochs` shuffled passes, or `local_steps` batches.

        A trailing batch of one sample is dropped (batch norm cannot train on it).
        """
        t, n = self.training, data.num_train
        passes = math.inf if t.local_steps else t.local_epochs
        steps, done = 0, 0
        while done < passes:
            perm = torch.randperm(n, generator=rng).to(data.x_train.device)
            xs, ys = data.x_train[perm], data.y_train[perm]  # one gather per pass
            for batch in pass_slices(n, t.batch_size):
                yield xs[batch], ys[batch]
                steps += 1
                if steps == t.local_steps:
                    return
            done += 1

    def train_local(self, data: ClientData, rng: torch.Generator, client_state: dict[str, Any]) -> float:
        """Run the local optimisation; returns the mean training loss."""
        self.model.train()
        opt = self.make_optimizer(self.model.parameters())
        total, steps = torch.zeros((), device=self.device), 0
        transform = TRAIN_TRANSFORMS[self.training.train_transform]
        for x, y in self.batches(data, rng):
            if transform is not None:
                x = transform(x, rng)
            if self.augment is not None:
                x, y = self.augment.train_batch(self.model, x, y, data.cid, rng)
            draws = self.draws(x, y, rng)
            total += self.train_step(x, y, opt, {**client_state, "draws": draws} if draws else client_state).detach()
            steps += 1
        return mean_loss(total, steps)

    def train_step(self, x: torch.Tensor, y: torch.Tensor, opt: torch.optim.Optimizer,
                   client_state: dict[str, Any]) -> torch.Tensor:
        """One optimiser step on one mini-batch; returns the loss. The inputs the client trains
        (:meth:`trained_inputs`) take a plain SGD step on the same batch first, with the model and its batch-norm
        statistics fixed, and stay fixed during the model's step; or, joint, they step on the gradients of the
        model step's own backward pass."""
        rates, joint = self.trained_inputs()
        inputs = {name: getattr(self.model, name) for name in rates}  # leaves that require grad
        if inputs and not joint:
            with frozen_statistics(self.model):
                grads = torch.autograd.grad(self.loss(x, y, client_state), list(inputs.values()))
            with torch.no_grad():
                for (name, t), grad in zip(inputs.items(), grads):
                    t -= rates[name] * grad
            for name, t in inputs.items():
                setattr(self.model, name, t.detach())
        for t in inputs.values():
            t.grad = None
        opt.zero_grad(set_to_none=True)
        loss = self.loss(x, y, client_state)
        loss.backward()
        self.before_step(client_state)
        opt.step()
        with torch.no_grad():
            for name, t in inputs.items():
                if joint:
                    t -= rates[name] * t.grad
                setattr(self.model, name, t)
        return loss

    def loss(self, x: torch.Tensor, y: torch.Tensor, client_state: dict[str, Any]) -> torch.Tensor:
        """The local objective on one batch; y holds class ids or soft targets (B, classes)."""
        return F.cross_entropy(self.model(x), y)

    def draws(self, x: torch.Tensor, y: torch.Tensor, rng: torch.Generator) -> dict[str, torch.Tensor]:
        """The random tensors the method's :meth:`loss` reads on one batch (FedFA's coins and noise), by name, each
        with the batch's samples along its first dimension, drawn from the client's generator right after the
        batch's transforms; the loss finds them in ``client_state["draws"]``. Drawn before the step, not inside the
        forward pass, so that the batched executor draws them in the loop's order and pads them like the batch.
        Here none."""
        return {}

    def trained_inputs(self) -> tuple[dict[str, float], bool]:
        """The tensors besides the parameters that a client trains (DisTrans's offset), by the attribute of the
        model that holds each (a leaf that requires grad, put there by :meth:`start`), with the rate of their
        plain SGD step; and whether they step on the model step's gradients (joint) rather than before it (see
        :meth:`train_step`). Here none."""
        return {}, False

    def carried(self) -> dict[str, torch.Tensor]:
        """Tensors besides the model that a client's steps update, by name, as :meth:`start` left them: under a step
        rule of the method's own (:meth:`step_rule`: pFedMe's local copy w of each parameter), or else in its
        :meth:`loss`, which on the batched executor finds the client's in ``client_state["carried"]`` and puts their
        new values there (FedFA's momentum statistics); the batched executor carries them client by client and puts
        their trained values back before :meth:`finish`. Here none."""
        return {}

    def step_rule(self, params: dict[str, torch.Tensor], carried: dict[str, torch.Tensor], gradient, lr
                  ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor]:
        """A local step of the method's own on one batch (pFedMe's proximal steps), written on tensors so that
        both executors run it: from the trainable `params` and the :meth:`carried` tensors, by name, and
        `gradient(params)`, which returns the loss's gradients by name (corrected by :meth:`correct`) and the loss,
        returns the new params, the new carried tensors and the step's loss; `lr` is the local rate (a float, or a
        float64 tensor in the batched executor). A method that defines it has its :meth:`train_step` run it in the
        loop. Here none: the step is the optimiser's on :meth:`loss`."""
        raise NotImplementedError

    def frozen_models(self) -> dict[str, nn.Module]:
        """Modules besides the model that :meth:`loss` runs without training them and whose weights are the
        client's (MOON's global and previous models), by name; the batched executor puts each client's weights
        into them from the context :meth:`start` returns, under ``"<name>.<entry>"``. Here none."""
        return {}

    def before_step(self, client_state: dict[str, Any]) -> None:
        """Gradient corrections between backward and the optimiser step (SCAFFOLD, FedProx)."""

    def correct(self, grads: dict[str, torch.Tensor], params: dict[str, torch.Tensor],
                context: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The gradients the optimiser steps on, from the loss's gradients `grads` of the trainable `params`
        (by name) and the update's `context` (what :meth:`start` returned); here `grads`. Pure (no in-place
        change), so both executors use it: the loop from :meth:`before_step`, the batched one mapped over
        clients (FedProx's proximal pull)."""
        return grads
