"""The one seam between onebit and a device.

Call sites never name a device: they ask `get_accelerator()`. An accelerator
answers three separate questions, kept apart on purpose:

* which torch.distributed backend moves bytes (`communication_backend_name`:
  gloo, nccl, xccl);
* which onebit compressed backend runs the 1-bit scheme on top
  (`onebit_backend`: 'compressed' by default, 'mpi' or a vendor's name in a
  subclass) -- the collective library and the compression scheme are
  different choices;
* which kernel packs sign bits (`create_op_builder("PackbitsBuilder")`).
"""
from __future__ import annotations

import abc
import contextlib
from typing import Any, Optional

import torch


class EagerGraph:
    """Stand-in graph for devices without graph capture.

    On such devices `capture_to_graph` runs its body eagerly, once, and
    `replay_graph` does nothing: a caller that wants the work done every step
    checks `graphs_supported()` and calls its body directly instead.
    """


class Accelerator(abc.ABC):
    """Interface every accelerator implements (see docs/design.md, "Layers")."""

    name: str = "abstract"

    # ---- devices ---------------------------------------------------------
    @abc.abstractmethod
    def is_available(self) -> bool: ...

    @abc.abstractmethod
    def device_count(self) -> int: ...

    def device_name(self, index: Optional[int] = None) -> str:
        """'cuda', or 'cuda:1' when an index is given."""
        return self.name if index is None else f"{self.name}:{index}"

    def current_device(self) -> int:
        return 0

    def current_device_name(self) -> str:
        return self.device_name(self.current_device())

    def set_device(self, index: int) -> None:
        """Select this process's device; callers pass the *local* rank."""

    def synchronize(self, index: Optional[int] = None) -> None:
        """Wait for all queued work on the device."""

    def bind_thread(self, device: torch.device) -> None:
        """Make `device` the calling thread's current device (a thread
        starts on device 0): a communication thread calls it once, from the
        data's device, before its first launch."""
        if device.type == self.name and device.index is not None:
            self.set_device(device.index)

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self.name

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    # ---- streams and events ---------------------------------------------
    @property
    def Stream(self) -> Any:  # noqa: N802 - DeepSpeed's spelling
        return _HostStream

    @property
    def Event(self) -> Any:  # noqa: N802
        return _HostEvent

    def stream(self, stream: Any):
        """Context manager that makes `stream` current (a no-op on the host)."""
        return contextlib.nullcontext()

    def current_stream(self, index: Optional[int] = None) -> Any:
        return _HostStream()

    # ---- graphs ------------------------------------------------------------
    def graphs_supported(self) -> bool:
        return False

    def create_graph(self) -> Any:
        return EagerGraph()

    def capture_to_graph(self, graph: Any, pool: Any = None, stream: Any = None):
        """Context manager; on devices without graphs the body runs eagerly."""
        return contextlib.nullcontext()

    def replay_graph(self, graph: Any) -> None:
        """Replay a captured graph; a no-op for an `EagerGraph`."""
        if not isinstance(graph, EagerGraph):
            graph.replay()

    # ---- communication -----------------------------------------------------
    @abc.abstractmethod
    def communication_backend_name(self) -> str: ...

    def onebit_backend(self) -> str:
        """Name of the default onebit compressed backend for this device:
        'hierarchical' when the launcher reports more than one node with
        more than one rank on each (full precision inside the node, 1 bit
        between nodes: README, "Multi-node"), else 'compressed'."""
        from .placement import several_nodes_of_several_ranks

        return "hierarchical" if several_nodes_of_several_ranks() else "compressed"

    # ---- kernels -------------------------------------------------------------
    def _op_builders(self) -> dict:
        """Builder classes this device has, by name."""
        return {}

    def get_op_builder(self, name: str):
        """The builder *class* called `name`, or None if this device has none."""
        return self._op_builders().get(name)

    def create_op_builder(self, name: str):
        """A builder *instance* for `name`, or None if this device has none."""
        cls = self.get_op_builder(name)
        return cls() if cls is not None else None

    def __repr__(self) -> str:
        return f"<onebit accelerator {self.name}>"


class _HostStream:
    """Host work is synchronous, so a host stream only needs to exist."""

    def __init__(self, device: Any = None, **_: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass


class _HostEvent:
    def __init__(self, enable_timing: bool = False, **_: Any) -> None:
        self._t = None

    def record(self, stream: Any = None) -> None:
        import time
        self._t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "_HostEvent") -> float:
        """Milliseconds from this event to `end`, like torch.cuda.Event."""
        return (end._t - self._t) * 1e3
