"""Compressed communication backends, by name.

  get_backend()                 the accelerator's default (onebit_backend())
  get_backend("mpi")            MpiBackend over MPI.COMM_WORLD
  get_backend("hierarchical")   full precision inside a node, 1 bit between nodes
                                (hierarchical.py; "mpi_hierarchical" over MPI)
  register_backend("mine", factory)   add a vendor's backend
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

from ..wire import WIRE_FORMAT_VERSION
from .base import CompressedAllreduceBase, padded_size
from .compressed import CompressedBackend
from .contract import CompressedAllreduce, missing_members

_FACTORIES: Dict[str, Callable[..., CompressedAllreduce]] = {}

# DeepSpeed's backend names, as they appear in every 1-bit config. Its NCCL,
# HCCL and CCL backends are torch.distributed collectives on that device's
# process group, which is what "compressed" is (on whatever group torch has).
DEEPSPEED_NAMES = {"nccl": "compressed", "hccl": "compressed", "ccl": "compressed",
                   "xccl": "compressed", "gloo": "compressed"}


def backend_name(name: Optional[str]) -> str:
    """The registered backend `name` means (None: the accelerator's default;
    DeepSpeed's names map to their equivalents). Raises ValueError for an
    unknown name, so a config fails where it is read, not at the first
    multi-rank step."""
    if name is None:
        from ..accelerator import get_accelerator

        name = get_accelerator().onebit_backend()
    if not isinstance(name, str):
        raise ValueError(f"comm_backend_name must be a string or None, got {name!r}")
    key = DEEPSPEED_NAMES.get(name.lower(), name.lower())
    if key not in _FACTORIES:
        raise ValueError(f"unknown onebit backend {name!r}; known: {sorted(_FACTORIES)} "
                         f"(DeepSpeed's {sorted(DEEPSPEED_NAMES)} mean 'compressed')")
    return key


def register_backend(name: str, factory: Callable[..., CompressedAllreduce]) -> None:
    """Make `get_backend(name, group=..., **kw)` call `factory(group=..., **kw)`,
    which must return a CompressedAllreduce (contract.py)."""
    _FACTORIES[name.lower()] = factory


def _mpi_factory(group=None, **kw):
    from .mpi import MpiBackend

    if group is not None:
        raise ValueError("the mpi backend takes an MPI communicator (comm=...), not a torch group")
    return MpiBackend(**kw)


def _hierarchical_factory(**kw):
    from .hierarchical import torch_hierarchical

    return torch_hierarchical(**kw)


def _mpi_hierarchical_factory(group=None, **kw):
    from .hierarchical import mpi_hierarchical

    if group is not None:
        raise ValueError("the mpi_hierarchical backend takes an MPI communicator (comm=...), "
                         "not a torch group")
    return mpi_hierarchical(**kw)


register_backend("compressed", CompressedBackend)
register_backend("mpi", _mpi_factory)
register_backend("hierarchical", _hierarchical_factory)
register_backend("mpi_hierarchical", _mpi_hierarchical_factory)
_BUILT_IN_FACTORIES = tuple(_FACTORIES.values())


def is_built_in(name: str) -> bool:
    """Whether backend `name` is onebit's own (not a vendor's registered in its
    place): its factory takes CompressedAllreduceBase's options beside the
    contract's (agree_every_call)."""
    return any(_FACTORIES.get(backend_name(name)) is f for f in _BUILT_IN_FACTORIES)


def get_backend(name: Optional[str] = None, group=None, **kwargs) -> CompressedAllreduce:
    """A compressed backend by name (None: the accelerator's `onebit_backend()`).
    A TypeError names what a registered factory's backend lacks."""
    key = backend_name(name)
    backend = _FACTORIES[key](group=group, **kwargs)
    missing = missing_members(backend)
    if missing:
        raise TypeError(f"the {key!r} backend ({type(backend).__name__}) lacks {', '.join(missing)} "
                        "of onebit.backends.contract.CompressedAllreduce")
    return backend


def __getattr__(name):  # MpiBackend without importing mpi4py at package import
    if name == "MpiBackend":
        from .mpi import MpiBackend

        return MpiBackend
    raise AttributeError(name)


__all__ = ["backend_name", "CompressedAllreduce", "CompressedAllreduceBase", "CompressedBackend", "MpiBackend", "get_backend",
           "register_backend", "padded_size", "WIRE_FORMAT_VERSION"]
