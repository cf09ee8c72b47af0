"""FedProto (Tan, Long, Liu, Zhou, Lu, Jiang and Zhang, "FedProto: Federated Prototype Learning across
Heterogeneous Clients", AAAI 2022): clients and server exchange class prototypes, the mean
representation (``features(x)``) of each class.

Client k, after local training, computes its prototypes ``C_k(j)`` (the mean of ``features(x)`` over
its training samples of class j, model in eval mode) and uploads them with the per-class counts.
The server's global prototype of class j is the count-weighted mean over the clients that uploaded
class j (the paper's weighting; the code takes the unweighted mean); a class nobody uploaded this round
keeps its previous global prototype. The local loss is

    CE + mu * mean_i d(features(x_i), global_proto[y_i])

where the mean runs over the batch samples whose class has a global prototype (none in round 1).

The paper writes the regulariser as a sum over classes of distances between the client's local
prototype and the global one; its code (github yuetan031/fedproto, ``lib/update.py``) regularises
every sample's representation towards its class's global prototype, as here, with ``nn.MSELoss`` over
the whole batch: a sample whose class has no global prototype is compared with itself and counts in the
denominator with zero. The two means differ by the factor (batch size) / (samples with a prototype),
and only in a round where some class of a client's batch has no global prototype: with every client
taking part, every class a client holds was uploaded in round 1, so from round 2 on the two are the same;
they can differ when clients are sampled and a class's holders have not yet taken part.

Two methods
-----------
- ``fedproto`` (:class:`FedProto`, the paper's method): only prototypes travel; each client keeps its
  own model and predicts with it. There is no global model (``global_model`` False): it is evaluated
  per client, as the paper does. Defaults as the code runs MNIST: ``mu = 1``, SGD lr 0.01, momentum
  0.5, batch 4, one local epoch (github yuetan031/fedproto, README and ``update.py``).
- ``fedproto_shared`` (:class:`FedProtoShared`, how FedRDN's Table 1 uses FedProto): FedAvg plus the
  prototype regulariser; the model is averaged as well and the global model predicts. Defaults are
  FedRDN's Table 1 settings: ``mu = 1``, SGD lr 0.01, weight decay 1e-5, batch 32, five local epochs.

Default ``distance = "mse"``.

The distance
------------
The paper writes the regulariser as a distance between representations and prototypes without fixing
its scale; the authors' code uses ``nn.MSELoss``, the squared difference averaged over the D feature
dimensions. ``distance="mse"`` (default) is that; ``distance="sqeuclidean"`` sums over the dimensions,
D times stronger at the same mu. The two agree up to that factor, and mu = 1 (FedRDN's setting, taken
with the authors' code) is meant on the MSE scale: with the sum, LeNet-5's 84 features and mu = 1 the
regulariser pulls every representation onto the prototypes and the global model stays at chance
(measured on Fashion-MNIST, IID, 10 rounds: 0.10 against 0.71 with the MSE).

Notes: with soft targets (mixup) the regulariser uses each sample's dominant class. Prototypes are computed on the
client's training inputs as it sees them at evaluation (``augment.eval_input``, e.g. FedRDN's own
statistics).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..params import Range, OneOf
from .base import Algorithm, FlatState, Message, Training, padded_sum


def class_means(z: torch.Tensor, y: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-class means of representations.

    Parameters
    ----------
    z : (N, D) representations.
    y : (N,) class ids.

    Returns
    -------
    means : (num_classes, D); zero rows for absent classes.
    counts : (num_classes,) float samples per class.
    """
    sums = torch.zeros(num_classes, z.shape[1], dtype=z.dtype, device=z.device)
    sums.index_add_(0, y, z)
    counts = torch.bincount(y, minlength=num_classes).to(z.dtype)
    return sums / counts.clamp(min=1)[:, None], counts


class FedProto(Algorithm):
    """FedProto: clients share class prototypes only, each keeps and predicts with its own model.

    Parameters
    ----------
    training : local training settings.
    mu : weight of the prototype regulariser.
    distance : "mse" (mean over feature dimensions, the authors' code) or "sqeuclidean" (their sum).
    """

    name = "fedproto"
    batched = True
    shares = "its class prototypes (mean embeddings per class), every round"
    constraints = {"mu": Range(0), "distance": OneOf("mse", "sqeuclidean")}
    paper_training = Training(lr=0.01, momentum=0.5, batch_size=4, local_epochs=1)
    global_model = False
    share_model = False  # the model stays with each client

    def __init__(self, training: Training | None = None, mu: float = 1.0, distance: str = "mse"):
        super().__init__(training)
        self.mu = mu
        self.distance = distance

    def init(self, model, federation):
        server = super().init(model, federation)
        self.whole = FlatState(model)
        num_classes, dim = federation.num_classes, model.feature_dim
        server["prototypes"] = torch.zeros(num_classes, dim, device=self.device)   # (C, D)
        server["proto_counts"] = torch.zeros(num_classes, device=self.device)      # (C,) 0: no prototype yet
        if not self.share_model:
            del server["weights"]
        self.received = Received(num_classes, dim).to(self.device)
        return server

    def init_client(self, cid: int) -> dict[str, Any]:
        if self.share_model:
            return super().init_client(cid)
        return {"model": self.whole.get()}  # every client starts from the same initial model

    def server_message(self, server_state, cid):
        have = torch.nonzero(server_state["proto_counts"] > 0).flatten()  # (k,) classes with a prototype
        tensors = {"prototypes": server_state["prototypes"][have], "classes": have}
        if self.share_model:
            tensors["weights"] = server_state["weights"]
        return Message(tensors)

    def start(self, message, client_state) -> dict[str, torch.Tensor]:
        """The client's starting model, and the global prototypes its loss pulls towards (the context: the
        batched executor puts each client's into :meth:`frozen_models`)."""
        if self.share_model:
            super().start(message, client_state)
        else:
            self.whole.set(client_state["model"])
        with torch.no_grad():
            self.received.prototypes.zero_()
            self.received.known.zero_()
            self.received.prototypes[message.tensors["classes"]] = message.tensors["prototypes"]
            self.received.known[message.tensors["classes"]] = True
        return {f"received.{n}": t.clone() for n, t in self.received.named_buffers()}

    def finish(self, data, loss, client_state):
        means, counts = self.prototypes(data)
        held = torch.nonzero(counts > 0).flatten()  # (k,)
        if self.share_model:
            upload = self.upload(data, loss, client_state)
        else:
            client_state["model"] = self.whole.get()
            upload = Message({}, num_samples=data.num_train, metrics={"loss": loss})
        upload.tensors.update(prototypes=means[held], classes=held, counts=counts[held])
        return upload, client_state

    def frozen_models(self) -> dict[str, nn.Module]:
        return {"received": self.received}

    @torch.no_grad()
    def prototypes(self, data, batch_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
        """(C, D) class means of ``features`` over the client's training set and (C,) counts."""
        self.model.eval()
        x = data.x_train if self.augment is None else self.augment.eval_input(data.x_train, data.cid)
        z = torch.cat([self.model.features(x[s:s + batch_size]) for s in range(0, len(x), batch_size)])
        return class_means(z, data.y_train, self.federation.num_classes)

    def aggregate(self, server_state, uploads, round_idx):
        server = super().aggregate(server_state, uploads, round_idx) if self.share_model else dict(server_state)
        sums = torch.zeros_like(server_state["prototypes"])      # (C, D)
        totals = torch.zeros_like(server_state["proto_counts"])  # (C,)
        for _, m in uploads:
            classes, counts = m.tensors["classes"], m.tensors["counts"]
            sums.index_add_(0, classes, m.tensors["prototypes"] * counts[:, None])
            totals.index_add_(0, classes, counts)
        seen = totals > 0
        prototypes, proto_counts = server_state["prototypes"].clone(), server_state["proto_counts"].clone()
        prototypes[seen] = sums[seen] / totals[seen, None]
        proto_counts[seen] = totals[seen]
        return {**server, "prototypes": prototypes, "proto_counts": proto_counts}

    def loss(self, x: torch.Tensor, y: torch.Tensor, client_state: dict[str, Any]) -> torch.Tensor:
        z = self.model.features(x)  # (B, D)
        labels = y if y.dim() == 1 else y.argmax(1)  # (B,)
        real = client_state.get("real")  # the batched executor's padded batch: which of its samples are real
        if real is None:
            ce = F.cross_entropy(self.model.head(z), y)
            reg = prototype_regulariser(z, labels, self.received.prototypes, self.received.known)
        else:  # summed over the real samples and divided by the full batch, as the executor rescales it
            ce = padded_sum(F.cross_entropy(self.model.head(z), y, reduction="none"), real)
            reg = prototype_regulariser(z, labels, self.received.prototypes, self.received.known, real)
            reg = reg * real.sum() / len(real)
        return ce + self.mu * (reg / z.shape[1] if self.distance == "mse" else reg)

    @torch.no_grad()
    def predict(self, server_state, client_state, x):
        if self.share_model:
            return super().predict(server_state, client_state, x)
        self.whole.set(client_state["model"])
        self.model.eval()
        return self.model(x)


class FedProtoShared(FedProto):
    """FedAvg plus FedProto's prototype regulariser: the model is averaged too (FedRDN's Table 1 use)."""

    name = "fedproto_shared"
    batched = True
    paper_training = Training(lr=0.01, weight_decay=1e-5, batch_size=32, local_epochs=5)  # FedRDN Sec. 4.1
    global_model = True
    share_model = True


def prototype_regulariser(z: torch.Tensor, y: torch.Tensor, prototypes: torch.Tensor,
                          has_prototype: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over samples whose class has a prototype of ``||z_i - prototypes[y_i]||^2`` (0 if none).

    Parameters
    ----------
    z : (B, D) representations; y : (B,) class ids.
    prototypes : (C, D); has_prototype : (C,) bool.
    real : (B,) bool, the samples of a padded batch that count (the batched executor's): the same mean over
        them, computed on the whole batch without a shape that depends on the data.
    """
    if real is not None:
        keep = has_prototype[y] & real  # (B,)
        each = (z - prototypes[y]).pow(2).sum(1)  # (B,)
        return torch.where(keep, each, 0.0).sum() / keep.sum().clamp(min=1)
    keep = has_prototype[y]  # (B,)
    if not keep.any():
        return z.sum() * 0.0  # keeps the graph (and the device) without a branch in the caller
    diff = z[keep] - prototypes[y[keep]]  # (b, D)
    return diff.pow(2).sum(1).mean()


class Received(nn.Module):
    """The global prototypes a client received, which its loss pulls towards, as buffers (a frozen model of the
    batched executor, which puts each client's own into it): ``prototypes`` (C, D) and ``known`` (C,) bool, whether
    a class has one."""

    def __init__(self, num_classes: int, dim: int):
        super().__init__()
        self.register_buffer("prototypes", torch.zeros(num_classes, dim))
        self.register_buffer("known", torch.zeros(num_classes, dtype=torch.bool))
