"""Federated algorithms, one file each; :data:`ALGORITHMS` maps names to classes."""
from .base import Algorithm, ClientsFailedError, FlatState, Message, NonFiniteLossError, Training, weighted_mean
from .central import Centralised
from .distrans import DisTrans
from .fedavg import FedAvg
from .fedavgm import FedAvgM
from .fedaws import FedAwS
from .fedbn import FedBN
from .fedfa import FedFA
from .fednova import FedNova
from .fedproto import FedProto, FedProtoShared
from .fedprox import FedProx
from .fraug import FRAug
from .moon import MOON
from .partialfed import PartialFed
from .pfedavg import PFedAvg
from .pfedhn import PFedHN
from .pfedme import PFedMe
from .scaffold import Scaffold
from .single import Single

ALGORITHMS: dict[str, type[Algorithm]] = {cls.name: cls for cls in (
    FedAvg, FedProx, FedAvgM, FedNova, Scaffold, MOON, FedBN, PFedMe, PFedHN, FedAwS, FedProto, FedProtoShared,
    FedFA, PartialFed, PFedAvg, Single, Centralised, DisTrans, FRAug,
)}

__all__ = ["ALGORITHMS", "Algorithm", "ClientsFailedError", "FlatState", "Message", "NonFiniteLossError", "Training",
           "weighted_mean", *(cls.__name__ for cls in ALGORITHMS.values())]
