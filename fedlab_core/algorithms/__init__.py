"""Federated algorithms, one file each; :data:`ALGORITHMS` maps names to classes."""
from .base import Algorithm, FlatState, Message, NonFiniteLossError, Training, weighted_mean
from .fedavg import FedAvg

ALGORITHMS: dict[str, type[Algorithm]] = {
    "fedavg": FedAvg,
}

__all__ = ["ALGORITHMS", "Algorithm", "FedAvg", "FlatState", "Message", "NonFiniteLossError", "Training",
           "weighted_mean"]
