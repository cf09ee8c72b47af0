"""DisTrans (Yuan, Hui, Yang, Liu, Chen and Zhang, "Addressing Heterogeneity in Federated Learning via
Distributional Transformation", ECCV 2022): every client owns an offset ``t_i`` with the input's shape,
trained jointly with a double-input-channel model and added to its inputs at test time too.

How it differs from FedAvg
--------------------------
- The model is :class:`DoubleChannel` around the run's backbone: the shared backbone sees both
  ``(1 - a) x + a t`` and ``(1 + a) x - a t`` (Eq. 1; the two average back to x), the two feature
  vectors are concatenated and one linear layer maps them to the logits (``head="linear"``, default).
  Section 4.1 describes "a dense layer concatenating two channels' outputs, and a logits layer"; its
  Table 7 settles what that is: the double model is larger than the single one by exactly
  feature-dim x classes weights (ResNet-18: 5,120 = 512 x 10), i.e. the logits layer reads the
  concatenation and nothing else is added, which is also the authors' code. ``head="dense"`` is the other
  reading: Linear(2D, D) with ReLU, then the backbone's own head (it trains markedly slower here).
  The backbone runs once per channel (``passes=2``, default, as the authors' code does), so batch norm
  normalises each channel with its own batch statistics and updates its running statistics twice per
  batch; ``passes=1`` batches both channels into one pass (one set of statistics for the two).
  ``channels=1`` is the single-input-channel ablation (Table 3): the backbone on ``(1 - a) x + a t`` alone.
- Per mini-batch (Algorithm 1): one SGD step on the offset with the model fixed (batch-norm running
  statistics included), then one step on the model with the offset fixed. ``joint=True`` is the
  authors' code: one backward pass, both stepped together.
  The offset is the model's trained input (:meth:`~fedlab_core.algorithms.base.Algorithm.trained_inputs`): the
  base local step takes these two steps, in the loop and in the batched executor alike.
- The server averages the models as FedAvg does, weighted by the clients' sample counts (the paper does
  not say; ``sample_weighted=False`` is the authors' code's plain mean), and aggregates the offsets
  (Section 4.4):
  ``none`` (every client keeps its own), ``avg`` (one global mean offset, sent to everyone),
  ``nn`` (a server network, below) or ``nn+no`` (default): ``nn`` when the split's DH is below
  ``dh_threshold`` (0.5), ``none`` otherwise. Offsets travel only when the server uses them, and their
  bytes are counted; ``nn`` also uploads the client's class counts (10 floats for 10 classes).
- ``predict`` for a client adds the offset the client holds when training ends (``test_offset``). The
  paper's Algorithm 1 ends with the server updating every client's offset by the aggregation and outputs
  those offsets; its text: "each client adds its personalized offset to each testing input". The
  authors' code likewise sets the server's aggregated offset on each client before evaluating. So the
  default, ``"sent"``, is the offset the server sends after the last round: the global mean under
  ``avg`` ("the same global offset for all clients", Section 4.4), the network's answer under ``nn``, the
  client's own under ``none``. ``"local"`` is the offset the client trained itself in its last round,
  under every aggregation. The global test set has no client; it is scored with the mean of the
  clients' test offsets, an evaluator's view that the paper does not define. The paper's metric is the
  client accuracy.

The offset network (``nn``)
---------------------------
The server maps a client's class vector ``e_i`` (entry j: the fraction of class j's training samples
that sit on client i, from the uploaded counts) to an aggregated offset ``t'_i``. Each round it takes
one SGD step (lr ``server_lr``) on the regression ``sum_i ||t_i - t'_i||_2`` over the round's clients
(the authors' code steps once per client instead), then sends each of them its new answer.
Two forms (``nn_input``):

- ``"class"`` (default): ``t'_i = g(e_i)``, a network of the class vector alone, as the authors' code
  (``hyperMACFed.py``) has it and as the paper's architecture sentence reads ("a single-input-channel
  generator with four convolutional layers"). ``e`` -> Linear(N, 100) -> ReLU -> Linear(100, H*W) gives
  one map, the single input channel; four 3x3 convolutions (16 channels, ReLU between) give the offset.
  Clients with similar class vectors get similar offsets, and the network moves wherever the clients'
  offsets pull it. (The code's generator is a larger DCGAN-style one.)
- ``"class+offset"``: the paper's text, which also feeds the network "a client's offset": ``t'_i =
  g(e_i, t_i)``, the map stacked with the offset's channels, the convolutions' output added to the
  offset, the last convolution starting at zero, and the regression on ``||t_i - g(e_i, t_i^prev)||``
  against what the server sent last round. Starting from the identity, one step a round leaves it
  there in practice: at the book's scale it sends each client back its own offset, so it behaves as
  ``none``.

How far the offsets move: each upload carries the diagnostic ``offset_change`` (for the log, not counted as
communication), the relative distance of the client's offset from its initial noise, ``||t - t0|| / ||t0||``;
the run's log records its mean over the round's clients. At
lr 1e-3 an offset moves by the input gradient of a mean loss times 1e-3 per step, which is tiny; a chapter
that wants offsets that learn at its scale sets ``offset_lr`` and shows this curve.

Defaults: the paper's ``a = 0.3``, offset lr 1e-3, one local epoch; the model's lr is the run's (the
paper: 5e-3, the ``Training`` used when none is given). Offsets start as uniform noise in [0, 1), the
range of this library's images (the authors' code: ``torch.rand`` then the images' normalisation).
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..data.federation import ClientData, Federation
from ..data.partition import dh_of
from ..params import OneOf, Range
from .base import Algorithm, FlatState, Message, Training, weighted_mean

AGGREGATIONS = ("none", "avg", "nn", "nn+no")
NN_INPUTS = ("class", "class+offset")
TEST_OFFSETS = ("sent", "local")


def shift(x: torch.Tensor, t: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The two channels of Eq. 1: ``((1 - a) x + a t, (1 + a) x - a t)``; their mean is x."""
    return (1 - alpha) * x + alpha * t, (1 + alpha) * x - alpha * t


class DoubleChannel(nn.Module):
    """A backbone (with ``features``/``head``) applied to the two offset channels of its input.

    Parameters
    ----------
    backbone : any model of :mod:`fedlab_core.models`.
    alpha : the offset's weight a in Eq. 1.
    channels : 2 (DisTrans) or 1 (the single-input-channel ablation).
    head : "linear" (concatenation -> Linear(2D, classes): the paper's Table 7 and the authors' code) or
        "dense" (concatenation -> Linear(2D, D) -> ReLU -> the backbone's head).
    passes : 2 (one backbone pass per channel, each normalised by its own batch statistics: the authors'
        code) or 1 (both channels batched into one pass).

    The offset is the attribute ``offset`` ((C, H, W), or None for zeros); it is not a module entry, so
    it never enters the model's state or its average.
    """

    def __init__(self, backbone: nn.Module, alpha: float = 0.3, channels: int = 2, head: str = "linear",
                 passes: int = 2):
        super().__init__()
        if channels not in (1, 2):
            raise ValueError(f"channels must be 1 or 2, got {channels!r}")
        if head not in ("dense", "linear"):
            raise ValueError(f"head must be 'dense' or 'linear', got {head!r}")
        if passes not in (1, 2):
            raise ValueError(f"passes must be 1 or 2, got {passes!r}")
        self.backbone, self.alpha, self.channels, self.head_kind = backbone, alpha, channels, head
        self.passes = passes
        dim = backbone.feature_dim
        self.offset: torch.Tensor | None = None
        self.dense = nn.Linear(2 * dim, dim) if channels == 2 and head == "dense" else None
        if channels == 2 and head == "linear":  # the logits layer reads both channels' features
            backbone.head = nn.Linear(2 * dim, backbone.head.out_features)
        self.feature_dim = 2 * dim if channels == 2 and head == "linear" else dim
        self.to(next(backbone.parameters()).device)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, feature_dim), with the current offset."""
        t = torch.zeros_like(x[0]) if self.offset is None else self.offset  # (C, H, W)
        first, second = shift(x, t, self.alpha)
        if self.channels == 1:
            return self.backbone.features(first)
        if self.passes == 2:  # batch norm normalises each channel with its own statistics
            z = torch.cat([self.backbone.features(first), self.backbone.features(second)], dim=1)  # (B, 2D)
        else:  # one pass: batch norm sees both channels as one batch
            z = torch.cat(self.backbone.features(torch.cat([first, second])).chunk(2), dim=1)  # (B, 2D)
        return z if self.dense is None else F.relu(self.dense(z))

    def head(self, z: torch.Tensor) -> torch.Tensor:
        return self.backbone.head(z)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class OffsetNetwork(nn.Module):
    """g(e) or g(e, t): a client's class vector e (N,), and with ``with_offset`` its offset t (C, H, W), to an
    aggregated offset (C, H, W); see the module doc."""

    def __init__(self, num_classes: int, shape: tuple[int, int, int], hidden: int = 100, width: int = 16,
                 with_offset: bool = False):
        super().__init__()
        c, h, w = shape
        self.shape, self.with_offset = shape, with_offset
        self.embed = nn.Sequential(nn.Linear(num_classes, hidden), nn.ReLU(), nn.Linear(hidden, h * w))
        self.convs = nn.Sequential(
            nn.Conv2d(1 + c * with_offset, width, 3, padding=1), nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1), nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1), nn.ReLU(),
            nn.Conv2d(width, c, 3, padding=1))
        if with_offset:  # a correction added to the offset, starting from the identity
            nn.init.zeros_(self.convs[-1].weight)
            nn.init.zeros_(self.convs[-1].bias)

    def forward(self, e: torch.Tensor, t: torch.Tensor | None = None) -> torch.Tensor:
        """e (K, N) and, with an offset input, t (K, C, H, W) -> (K, C, H, W)."""
        _, h, w = self.shape
        plane = self.embed(e).view(-1, 1, h, w)  # (K, 1, H, W)
        if not self.with_offset:
            return self.convs(plane)
        return t + self.convs(torch.cat([t, plane], dim=1))


class DisTrans(Algorithm):
    """FedAvg of a double-input-channel model plus one trained input offset per client.

    Parameters
    ----------
    training : the model's local training (default: the paper's SGD lr 5e-3, one epoch).
    alpha : the offset weight a (paper: 0.3; its code's non-IID script: 0.2).
    offset_lr : SGD learning rate of the offset step (paper: 1e-3).
    aggregation : "none", "avg", "nn" or "nn+no" (default: ``nn`` below ``dh_threshold``, else ``none``).
    dh_threshold : the DH at which ``nn+no`` switches to ``none``.
    joint : one backward pass for offset and model (the authors' code) instead of the paper's
        alternating steps.
    channels, head, passes : the model's structure (see :class:`DoubleChannel`).
    server_lr : SGD learning rate of the offset network (the code's 1e-2, with its bounded generator, sends
        ours diverging on 28x28 offsets: the regression loss of ten random offsets goes 154 -> 1166 in one
        step; at 1e-3 it falls 154 -> 92 -> 84).
    nn_input : "class" (the network sees the class vector: the code) or "class+offset" (also the offset:
        the paper's text); see the module doc.
    test_offset : "sent" (the offset the server sends after the last round: the paper's Algorithm 1 and
        the code) or "local" (the client's own trained offset).
    sample_weighted : the server's model mean weighted by sample counts (default) or plain (the authors'
        code).
    """

    name = "distrans"
    batched = True
    shares = (          # see the module documentation
        "its offset (an input-shaped tensor) under the avg and nn aggregations, and its class counts under nn; "
        "nothing more under none")
    paper_training = Training(lr=5e-3)  # Section 5.1: SGD, model lr 5e-3, one local epoch
    constraints = {"alpha": Range(0, 1), "offset_lr": Range(0), "aggregation": OneOf(*AGGREGATIONS),
                   "dh_threshold": Range(0, 1), "channels": OneOf(1, 2), "head": OneOf("dense", "linear"),
                   "server_lr": Range(0), "passes": OneOf(1, 2), "nn_input": OneOf(*NN_INPUTS),
                   "test_offset": OneOf(*TEST_OFFSETS)}

    def __init__(self, training: Training | None = None, alpha: float = 0.3, offset_lr: float = 1e-3,
                 aggregation: str = "nn+no", dh_threshold: float = 0.5, joint: bool = False, channels: int = 2,
                 head: str = "linear", server_lr: float = 1e-3, passes: int = 2, sample_weighted: bool = True,
                 nn_input: str = "class", test_offset: str = "sent"):
        super().__init__(training)
        self.alpha, self.offset_lr, self.aggregation = alpha, offset_lr, aggregation
        self.dh_threshold, self.joint, self.channels, self.head = dh_threshold, joint, channels, head
        self.server_lr, self.passes, self.sample_weighted = server_lr, passes, sample_weighted
        self.nn_input, self.test_offset = nn_input, test_offset

    # ------------------------------------------------------------------ protocol

    def init(self, model: nn.Module, federation: Federation) -> dict[str, Any]:
        wrapped = DoubleChannel(model, self.alpha, self.channels, self.head, self.passes)
        server = super().init(wrapped, federation)
        self.dh = dh_of(federation.class_counts, federation.num_classes)
        self.mode = self.aggregation
        if self.aggregation == "nn+no":
            self.mode = "nn" if self.dh < self.dh_threshold else "none"
        self.offset_seed = int(torch.randint(2 ** 62, (1,)))  # from the run's seeded initialisation stream
        if self.mode == "nn":
            self.net = OffsetNetwork(federation.num_classes, federation.input_shape,
                                     with_offset=self.nn_input == "class+offset").to(self.device)
            self.net_state = FlatState(self.net)
            k = federation.num_clients
            server.update(net=self.net_state.get(),
                          counts=torch.zeros(k, federation.num_classes, device=self.device),   # (K, N)
                          inputs=torch.zeros(k, *federation.input_shape, device=self.device),  # (K, C, H, W)
                          sent=torch.zeros(k, *federation.input_shape, device=self.device),    # (K, C, H, W)
                          has_sent=torch.zeros(k, dtype=torch.bool, device=self.device))       # (K,)
        return server

    def init_client(self, cid: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(self.offset_seed + cid)
        offset = torch.rand(self.federation.input_shape, generator=g).to(self.device)  # (C, H, W)
        return {"offset": offset, "cid": cid}

    def server_message(self, server_state: dict[str, Any], cid: int) -> Message:
        tensors = {"weights": server_state["weights"]}
        if self.mode == "avg" and "offset" in server_state:
            tensors["offset"] = server_state["offset"]
        elif self.mode == "nn" and bool(server_state["has_sent"][cid]):
            tensors["offset"] = server_state["sent"][cid]
        return Message(tensors)

    def start(self, message: Message, client_state: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The received model, and the offset the training starts from (the server's, else the client's own) as
        the model's trained input."""
        super().start(message, client_state)
        begin = message.tensors.get("offset", client_state["offset"])
        self._offset = begin.detach().clone().requires_grad_(True)  # (C, H, W), the offset being trained
        self.model.offset = self._offset
        return {}

    def trained_inputs(self) -> tuple[dict[str, float], bool]:
        """The offset, stepped before the model's step on each batch (Algorithm 1), or with it (``joint``)."""
        return {"offset": self.offset_lr}, self.joint

    def finish(self, data: ClientData, loss: float, client_state: dict[str, Any]) -> tuple[Message, dict[str, Any]]:
        client_state["offset"] = self._offset.detach().clone()
        upload = self.upload(data, loss, client_state)
        initial = self.init_client(data.cid)["offset"]
        upload.diagnostics["offset_change"] = float((client_state["offset"] - initial).norm() / initial.norm())
        if self.mode in ("avg", "nn"):
            upload.tensors["offset"] = client_state["offset"]
        if self.mode == "nn":
            upload.tensors["class_counts"] = torch.bincount(data.y_train, minlength=self.federation.num_classes).float()
        self.model.offset = None
        return upload, client_state

    def aggregate(self, server_state: dict[str, Any], uploads: list[tuple[int, Message]],
                  round_idx: int) -> dict[str, Any]:
        if self.sample_weighted:
            server = super().aggregate(server_state, uploads, round_idx)
        else:
            server = {**server_state, "weights": weighted_mean([m.tensors["weights"] for _, m in uploads],
                                                               [1.0] * len(uploads))}
        if self.mode == "avg":
            server["offset"] = torch.stack([m.tensors["offset"] for _, m in uploads]).mean(0)
        elif self.mode == "nn":
            server.update(self._aggregate_nn(server_state, uploads))
        return server

    def _aggregate_nn(self, server_state: dict[str, Any], uploads: list[tuple[int, Message]]) -> dict[str, Any]:
        counts = server_state["counts"].clone()
        ids = torch.tensor([cid for cid, _ in uploads], device=self.device)
        offsets = torch.stack([m.tensors["offset"] for _, m in uploads])  # (K, C, H, W)
        counts[ids] = torch.stack([m.tensors["class_counts"] for _, m in uploads])
        e = counts / counts.sum(0).clamp(min=1)  # (clients, N): share of each class's samples per client
        self.net_state.set(server_state["net"])
        if self.net.with_offset:  # the pairs (t_i, what the server answered last time), for the clients it answered
            seen = server_state["has_sent"][ids]  # (K,)
            pairs = (e[ids[seen]], server_state["inputs"][ids[seen]]), offsets[seen]
        else:  # the pairs (e_i, t_i)
            seen, pairs = ids, ((e[ids],), offsets)
        if len(pairs[1]):
            opt = torch.optim.SGD(self.net.parameters(), lr=self.server_lr)
            opt.zero_grad(set_to_none=True)
            (pairs[1] - self.net(*pairs[0])).flatten(1).norm(dim=1).sum().backward()
            opt.step()
        with torch.no_grad():
            answer = self.net(e[ids], offsets if self.net.with_offset else None)  # (K, C, H, W)
        inputs, sent, has_sent = (server_state[k].clone() for k in ("inputs", "sent", "has_sent"))
        inputs[ids], sent[ids], has_sent[ids] = offsets, answer, True
        return {"net": self.net_state.get(), "counts": counts, "inputs": inputs, "sent": sent, "has_sent": has_sent}

    def test_offset_of(self, server_state: dict[str, Any], client_state: dict[str, Any]) -> torch.Tensor:
        """The offset the client adds to its test inputs (``test_offset``, see the module doc), (C, H, W)."""
        if self.test_offset == "sent":
            if self.mode == "avg" and "offset" in server_state:
                return server_state["offset"]
            if self.mode == "nn" and "cid" in client_state and bool(server_state["has_sent"][client_state["cid"]]):
                return server_state["sent"][client_state["cid"]]
        return client_state["offset"]

    @contextlib.contextmanager
    def shifted(self, server_state: dict[str, Any], client_state: dict[str, Any] | None):
        """The model with the client's test offset (no client state: zero offset) for the block."""
        self.model.offset = self.test_offset_of(server_state, client_state) if client_state else None
        try:
            yield
        finally:
            self.model.offset = None

    def predict(self, server_state: dict[str, Any], client_state: dict[str, Any] | None,
                x: torch.Tensor) -> torch.Tensor:
        """Logits of the global model on x shifted by the client's test offset."""
        with self.shifted(server_state, client_state):
            return super().predict(server_state, client_state, x)

    def embed(self, server_state: dict[str, Any], client_state: dict[str, Any] | None,
              x: torch.Tensor) -> torch.Tensor:
        """Representations of x shifted by the client's test offset."""
        with self.shifted(server_state, client_state):
            return super().embed(server_state, client_state, x)

    def predict_global(self, server_state: dict[str, Any], client_states: dict[int, dict[str, Any]],
                       x: torch.Tensor) -> torch.Tensor:
        """The global test set with the mean of the clients' test offsets."""
        mean = torch.stack([self.test_offset_of(server_state, s) for s in client_states.values()]).mean(0)
        return self.predict(server_state, {"offset": mean}, x)


# ---------------------------------------------------------------------- communication overhead (Table 7)

def communication_overhead(backbone: nn.Module, input_shape: tuple[int, int, int], head: str = "linear",
                           serialized: bool = False) -> dict[str, float]:
    """What DisTrans adds to one model upload: the wider double-input-channel model and the offset.

    Parameters
    ----------
    backbone : a model of :mod:`fedlab_core.models` (left unchanged; the classes are its head's outputs).
    input_shape : (C, H, W) of one input, the offset's shape.
    head : the double model's head, as in :class:`DoubleChannel`.
    serialized : also give the size of each model's state dict as written by ``torch.save`` (in memory).

    Bytes are :func:`~fedlab_core.models.state_nbytes`: every floating-point state entry (parameters and
    batch-norm running statistics), which is what this library's engine sends. The single model is
    ``DoubleChannel(channels=1)``, whose state is the backbone's. Returns ``single_bytes``,
    ``double_bytes``, ``offset_bytes`` (C*H*W times the element size), ``extra_bytes`` (double - single
    + offset), ``overhead`` (extra / single, a fraction), ``single_parameters``, ``double_parameters``
    and, with ``serialized``, ``single_file_bytes`` and ``double_file_bytes``.
    """
    import copy
    import io
    import math

    from ..models import count_parameters, state_nbytes

    single = DoubleChannel(backbone, channels=1)  # wraps without changing the backbone
    double = DoubleChannel(copy.deepcopy(backbone), channels=2, head=head)  # replaces the copy's head
    dtype = next(backbone.parameters()).dtype
    out = {"single_bytes": state_nbytes(single), "double_bytes": state_nbytes(double),
           "offset_bytes": math.prod(input_shape) * torch.finfo(dtype).bits // 8,
           "single_parameters": count_parameters(single), "double_parameters": count_parameters(double)}
    out["extra_bytes"] = out["double_bytes"] - out["single_bytes"] + out["offset_bytes"]
    out["overhead"] = out["extra_bytes"] / out["single_bytes"]
    if serialized:
        for name, model in (("single", single), ("double", double)):
            buffer = io.BytesIO()
            torch.save(model.state_dict(), buffer)
            out[f"{name}_file_bytes"] = buffer.tell()
    return out


def trained_offsets(sim, state) -> list:
    """Each client's offset at the end of a run (its final `state`, `sim` the run's simulation), as nested lists
    rounded to 1e-6: what a figure of the offsets draws, stored by :func:`fedlab_core.runs.measured` (with the
    source ``"algorithms/distrans.py::trained_offsets"``) in place of the run's final state."""
    return [state.clients[c]["offset"].double().cpu().numpy().round(6).tolist()
            for c in range(sim.federation.num_clients)]
