"""Data-level plug-ins that compose with any algorithm; :data:`AUGMENTS` maps names to classes."""
from .base import Augment

AUGMENTS: dict[str, type[Augment]] = {
    "none": Augment,
}

__all__ = ["AUGMENTS", "Augment"]
