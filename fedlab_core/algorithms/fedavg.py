"""FedAvg (McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized Data",
AISTATS 2017): local SGD, then the sample-weighted mean of every floating-point state entry.

The machinery lives in :class:`fedlab_core.algorithms.base.Algorithm`, which every other algorithm
extends; this module only names it.
"""
from .base import Algorithm


class FedAvg(Algorithm):
    """Federated averaging, weighted by each client's number of training samples."""

    name = "fedavg"
