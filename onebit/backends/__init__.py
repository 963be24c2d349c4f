"""Compressed communication backends, by name.

  get_backend()                 the accelerator's default (onebit_backend())
  get_backend("mpi")            MpiBackend over MPI.COMM_WORLD
  register_backend("mine", factory)   add a vendor's backend
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

from .base import WIRE_FORMAT_VERSION, CompressedAllreduceBase, padded_size
from .compressed import CompressedBackend

_FACTORIES: Dict[str, Callable[..., CompressedAllreduceBase]] = {}


def register_backend(name: str, factory: Callable[..., CompressedAllreduceBase]) -> None:
    """Make `get_backend(name, group=..., **kw)` call `factory(group=..., **kw)`."""
    _FACTORIES[name.lower()] = factory


def _mpi_factory(group=None, **kw):
    from .mpi import MpiBackend

    if group is not None:
        raise ValueError("the mpi backend takes an MPI communicator (comm=...), not a torch group")
    return MpiBackend(**kw)


register_backend("compressed", CompressedBackend)
register_backend("mpi", _mpi_factory)


def get_backend(name: Optional[str] = None, group=None, **kwargs) -> CompressedAllreduceBase:
    """A compressed backend by name (None: the accelerator's `onebit_backend()`)."""
    if name is None:
        from ..accelerator import get_accelerator

        name = get_accelerator().onebit_backend()
    factory = _FACTORIES.get(name.lower())
    if factory is None:
        raise ValueError(f"unknown onebit backend {name!r}; known: {sorted(_FACTORIES)}")
    return factory(group=group, **kwargs)


def __getattr__(name):  # MpiBackend without importing mpi4py at package import
    if name == "MpiBackend":
        from .mpi import MpiBackend

        return MpiBackend
    raise AttributeError(name)


__all__ = ["CompressedAllreduceBase", "CompressedBackend", "MpiBackend", "get_backend",
           "register_backend", "padded_size", "WIRE_FORMAT_VERSION"]
