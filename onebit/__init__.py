"""onebit: communication-compressed 1-bit optimizers for data-parallel PyTorch.

See docs/design.md for the layers: kernels -> op builders -> accelerator ->
compressed backends -> optimizers.
"""
__version__ = "0.1.0"

from .accelerator import get_accelerator, set_accelerator  # noqa: E402,F401
from .optim import OnebitAdam, OnebitLamb, ZeroOneAdam  # noqa: E402,F401
from .ddp import OnebitHookState, ddp_comm_hook  # noqa: E402,F401
from .config import build_optimizer, build_scheduler  # noqa: E402,F401
from .collectives import CommunicationError  # noqa: E402,F401
from .agreement import ReplicaDivergenceError  # noqa: E402,F401
from .diloco import DiLoCo, SteppedOuterLR  # noqa: E402,F401
from . import amp  # noqa: E402,F401
