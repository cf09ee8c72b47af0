"""Data-level plug-ins that compose with any algorithm; :data:`AUGMENTS` maps names to classes."""
from .advprop import AdvProp
from .base import Augment
from .fedrdn import FedRDN
from .mixup import Mixup
from .naivemix import NaiveMix
from .normalize import Normalize
from .ot_align import OTAlign

AUGMENTS: dict[str, type[Augment]] = {cls.name: cls for cls in (Augment, Mixup, AdvProp, NaiveMix, Normalize, OTAlign, FedRDN)}

__all__ = ["AUGMENTS", "AdvProp", "Augment", "FedRDN", "Mixup", "NaiveMix", "Normalize", "OTAlign"]
