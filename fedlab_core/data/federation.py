"""A dataset split across clients, held as tensors: what the engine trains on."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np
import torch

from . import partition as P
from .base import Dataset, digest


@dataclass
class ClientData:
    """Client `cid`'s training and test tensors (x: (n, C, H, W) float32, y: (n,) int64), and a validation
    set beside them when one is monitored (:func:`hold_out` with ``keep_test``, or :func:`monitor_unused`)."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    cid: int = 0
    domain: str | None = None
    x_val: torch.Tensor | None = None
    y_val: torch.Tensor | None = None

    @property
    def num_train(self) -> int:
        return int(self.y_train.shape[0])

    def to(self, device: torch.device | str) -> "ClientData":
        val = {} if self.x_val is None else {"x_val": self.x_val.to(device), "y_val": self.y_val.to(device)}
        return replace(self, x_train=self.x_train.to(device), y_train=self.y_train.to(device),
                       x_test=self.x_test.to(device), y_test=self.y_test.to(device), **val)


@dataclass
class Federation:
    """Per-client train/test tensors, the whole (global) test set and the split's metadata.

    Attributes
    ----------
    clients : one :class:`ClientData` per client.
    x_test, y_test : the global test set, never split (the union of the per-client test sets).
    num_classes, input_shape : of the dataset; input_shape is (C, H, W).
    class_counts : (clients, classes) numpy array of training samples per class per client.
    scheme : the partition scheme that made it.
    domains : domain names when the dataset has domains.
    data_checksum : digest of the dataset as its loader read it (before any subsampling or split).
    """

    clients: list[ClientData]
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    input_shape: tuple[int, int, int]
    class_counts: np.ndarray
    scheme: str
    dataset: str
    domains: Sequence[str] | None = None
    data_checksum: str = ""

    def split_hash(self) -> str:
        """Digest of every client's training and test tensors, in client order: the same data split the
        same way gives the same hash."""
        return digest(*(t for c in self.clients for t in (c.x_train, c.y_train, c.x_test, c.y_test)))

    @property
    def num_clients(self) -> int:
        return len(self.clients)

    @property
    def dh(self) -> float:
        """Distributional heterogeneity (DisTrans Eq. 3-4) of the training split."""
        return P.dh_of(self.class_counts, self.num_classes)

    @property
    def class_fractions(self) -> np.ndarray:
        """(clients, classes): entry (i, c) is the fraction of class c's training data held by client i."""
        totals = self.class_counts.sum(axis=0, keepdims=True)
        return self.class_counts / np.maximum(totals, 1)

    def to(self, device: torch.device | str) -> "Federation":
        return replace(self, clients=[c.to(device) for c in self.clients],
                       x_test=self.x_test.to(device), y_test=self.y_test.to(device))

    def __repr__(self) -> str:
        sizes = [c.num_train for c in self.clients]
        return (f"Federation({self.dataset!r}, scheme={self.scheme!r}, clients={self.num_clients}, "
                f"train sizes {min(sizes)}..{max(sizes)}, DH={self.dh:.2f})")


def federate(data: Dataset, scheme: str, num_clients: int, seed: int, **options) -> Federation:
    """Split `data` across `num_clients` clients with a scheme of :data:`partition.PARTITIONS`.

    Parameters
    ----------
    data : the dataset (tensors).
    scheme : "iid", "dirichlet", "pathological", "distrans", "one_class", "quantity" or "domain".
    num_clients : number of clients.
    seed : the split is a pure function of the seed.
    options : the scheme's own parameters (alpha, min_size, dh, classes_per_client, beta).
    """
    if scheme not in P.PARTITIONS:
        raise ValueError(f"partition must be one of {sorted(P.PARTITIONS)}, got {scheme!r}")
    y_train, y_test = data.y_train.numpy(), data.y_test.numpy()
    groups_train = groups_test = None
    if scheme == "domain":
        if data.domain_train is None:
            raise ValueError(f"partition 'domain' needs a dataset with domains; {data.name!r} has none")
        groups_train, groups_test = data.domain_train.numpy(), data.domain_test.numpy()
        train_parts = P.domain(groups_train, num_clients, seed)
    else:
        train_parts = P.PARTITIONS[scheme](y_train, num_clients, seed, **options)
    if scheme == "one_class":
        test_parts = P.one_class_test(train_parts, y_train, y_test, seed)
    else:
        test_parts = P.split_test(train_parts, y_train, y_test, seed, groups_train, groups_test)
    names = list(data.domains) if data.domains else None

    def client(i: int) -> ClientData:
        tr, te = torch.as_tensor(train_parts[i]), torch.as_tensor(test_parts[i])
        # a client's domain is named only when the split is by domain (a label split mixes domains)
        dom = names[int(groups_train[train_parts[i][0]])] if groups_train is not None and names and len(train_parts[i]) else None
        return ClientData(data.x_train[tr], data.y_train[tr], data.x_test[te], data.y_test[te], i, dom)

    return Federation(
        clients=[client(i) for i in range(num_clients)],
        x_test=data.x_test, y_test=data.y_test,
        num_classes=data.num_classes, input_shape=data.input_shape,
        class_counts=P.class_counts(train_parts, y_train, data.num_classes),
        scheme=scheme, dataset=data.name, domains=names,
        data_checksum=data.notes.get("checksum") or digest(data.x_train, data.y_train, data.x_test, data.y_test),
    )


def hold_out(federation: Federation, fraction: float, seed: int, keep_test: bool = False) -> Federation:
    """The federation with `fraction` of every client's training data held out (a class-stratified, seeded
    split of its own data); each client trains on the rest, and ``class_counts`` count what is left.

    - ``keep_test=False``, a validation split for tuning: the held-out part is each client's evaluation set,
      and the global evaluation set is their union. No test image is used.
    - ``keep_test=True``, a monitored validation set: the held-out part is the client's ``x_val``/``y_val``,
      scored beside its test set at every evaluation, which keeps its test set.

    Under one class per client (scheme "one_class") a client's held-out part holds its class only, on which a
    model that answers every image with that class scores 100%; as its test set does (:func:`P.one_class_test`),
    it gets as many negatives, drawn from the other clients' held-out parts (images of other classes that no
    client trains on).
    """
    clients, held_parts = [], []
    for i, c in enumerate(federation.clients):
        train, held = (torch.as_tensor(ix) for ix in P.stratified_split(c.y_train.cpu().numpy(), fraction,
                                                                           seed * 100_003 + i))
        clients.append(replace(c, x_train=c.x_train[train], y_train=c.y_train[train]))
        held_parts.append((c.x_train[held], c.y_train[held]))
    if federation.scheme == "one_class":
        pool_x, pool_y = torch.cat([x for x, _ in held_parts]), torch.cat([y for _, y in held_parts])
        rng = P._rng(seed, "validation negatives")
        for i, (x, y) in enumerate(held_parts):
            others = np.flatnonzero(~np.isin(pool_y.cpu().numpy(), y.cpu().numpy()))
            pick = torch.as_tensor(np.sort(rng.choice(others, size=min(len(y), others.size), replace=False)))
            held_parts[i] = (torch.cat([x, pool_x[pick]]), torch.cat([y, pool_y[pick]]))
    for i, (x, y) in enumerate(held_parts):
        clients[i] = replace(clients[i], **({"x_val": x, "y_val": y} if keep_test else {"x_test": x, "y_test": y}))
    counts = np.stack([np.bincount(c.y_train.cpu().numpy(), minlength=federation.num_classes) for c in clients])
    if keep_test:
        return replace(federation, clients=clients, class_counts=counts)
    return replace(federation, clients=clients, x_test=torch.cat([c.x_test for c in clients]),
                   y_test=torch.cat([c.y_test for c in clients]), class_counts=counts)


def monitor_unused(federation: Federation, pool_x: torch.Tensor, pool_y: torch.Tensor, size: float,
                   seed: int, pool_domains: torch.Tensor | None = None) -> Federation:
    """The federation with a monitored validation set per client (``x_val``/``y_val``) drawn from `pool_x`/`pool_y`,
    training images that no client holds (:func:`~fedlab_core.data.unused_training`): no client gives up
    training data, and the validation set is as precise as the test set.

    The pool is first cut to `size` times the global test set's count of every class, then dealt to the clients
    as the test set is (:func:`P.split_test`: each client's share of a class follows its share of that class's
    training data; under one class per client, :func:`P.one_class_test`, with as many negatives). So at
    ``size=1`` a client's validation set has its test set's size and classes. Under the domain split the pool
    carries each image's domain (`pool_domains`, :func:`~fedlab_core.data.unused_domain_images`), and each client
    draws `size` times its test set's count of every class from its own domain's images. Raises ValueError naming
    ``validation_monitor`` when the pool holds too few images of a class (and domain).
    """
    pool_labels = pool_y.cpu().numpy()
    if federation.scheme == "domain":
        return _monitor_domains(federation, pool_x, pool_y, pool_labels, pool_domains, size, seed)
    need = np.rint(size * np.bincount(federation.y_test.cpu().numpy(), minlength=federation.num_classes)).astype(int)
    have = np.bincount(pool_labels, minlength=federation.num_classes)
    if (need > have).any():
        c = int(np.argmax(need - have))
        raise ValueError(f"validation_monitor: {size:g} times the test set needs {need[c]} unused training images of "
                         f"class {c}; only {have[c]} are left out of the training subset (lower max_train_samples "
                         "or validation_monitor)")
    rng = P._rng(seed, "unused validation")
    pick = np.sort(np.concatenate([rng.choice(np.flatnonzero(pool_labels == c), n, replace=False)
                                   for c, n in enumerate(need) if n] or [np.zeros(0, dtype=np.int64)]))
    val_y = pool_labels[pick]
    y_train = np.concatenate([c.y_train.cpu().numpy() for c in federation.clients])
    ends = np.cumsum([c.num_train for c in federation.clients])
    parts = [np.arange(end - c.num_train, end) for c, end in zip(federation.clients, ends)]
    deal = P.one_class_test if federation.scheme == "one_class" else P.split_test
    dealt = deal(parts, y_train, val_y, seed)
    clients = [replace(c, x_val=pool_x[torch.as_tensor(pick[ix])], y_val=pool_y[torch.as_tensor(pick[ix])])
               for c, ix in zip(federation.clients, dealt)]
    return replace(federation, clients=clients)


def _monitor_domains(federation: Federation, pool_x: torch.Tensor, pool_y: torch.Tensor, pool_labels: np.ndarray,
                     pool_domains: torch.Tensor | None, size: float, seed: int) -> Federation:
    """:func:`monitor_unused` under the domain split: each client, in turn, draws `size` times its test set's count
    of every class from its domain's images in the pool that no earlier client drew."""
    if pool_domains is None:
        raise ValueError("validation_source: 'unused' under the domain split needs the pool's domains "
                         "(unused_domain_images)")
    groups, free = pool_domains.cpu().numpy(), np.ones(len(pool_labels), dtype=bool)
    rng = P._rng(seed, "unused validation")
    clients = []
    for c in federation.clients:
        domain = federation.domains.index(c.domain)
        need = np.rint(size * np.bincount(c.y_test.cpu().numpy(), minlength=federation.num_classes)).astype(int)
        picks = []
        for k, n in enumerate(need):
            left = np.flatnonzero((groups == domain) & (pool_labels == k) & free)
            if n > len(left):
                raise ValueError(f"validation_monitor: {size:g} times client {c.cid}'s test set needs {n} unused "
                                 f"training images of class {k} in domain {c.domain!r}; only {len(left)} are left "
                                 "(lower validation_monitor or samples_per_domain)")
            picks.append(rng.choice(left, n, replace=False))
        ix = torch.as_tensor(np.sort(np.concatenate(picks)))
        free[ix.numpy()] = False
        clients.append(replace(c, x_val=pool_x[ix], y_val=pool_y[ix]))
    return replace(federation, clients=clients)
