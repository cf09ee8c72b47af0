"""FedAvg (McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized Data",
AISTATS 2017): local SGD, then the sample-weighted mean of every floating-point state entry.

The machinery lives in :class:`fedlab_core.algorithms.base.Algorithm`, which every other algorithm
extends; this module only names it. Local training as the paper's MNIST CNN runs it (Table 2): batch
10, five local epochs, plain SGD; the paper tunes the rate for each setting and states no single value
(0.05 here is ours).
"""
from .base import Algorithm


class FedAvg(Algorithm):
    """Federated averaging, weighted by each client's number of training samples."""

    name = "fedavg"
    batched = True
