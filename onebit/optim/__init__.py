"""The communication-compressed optimizers."""
from .adam import OnebitAdam
from .base import OnebitOptimizer
from .lamb import OnebitLamb
from .zoadam import ZeroOneAdam

__all__ = ["OnebitAdam", "OnebitLamb", "ZeroOneAdam", "OnebitOptimizer"]
