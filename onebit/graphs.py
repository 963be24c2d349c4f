"""Replay a step's element-wise work as one captured graph.

In the compression stage an optimizer step is a few dozen short kernels per
parameter group (momentum, flatten, unflatten, mask, update) around one
collective. On a GPU, launching them can cost more than running them; a
captured graph launches them all at once. `GraphedRegion` wraps such a
piece of work:

* the first `warmup` calls run it eagerly, on a side stream where the device
  has streams (CUDA wants lazy initialisation -- cuBLAS handles, allocator
  pools, kernel loading -- to happen before a capture, and on a stream other
  than the legacy default one);
* the next call captures it and then replays the graph, because a capture
  only records work;
* later calls replay it.

The body must read and write only tensors whose addresses do not change, and
read any per-step number (lr, bias corrections) from a device tensor that the
caller updates *before* calling: a Python float would be frozen into the
graph. The caller passes a `key` naming everything the graph baked in (the
tensors' addresses, Python-float hyper-parameters); a new key drops the old
graph and starts over. Devices without graphs (`graphs_supported()` false:
the CPU) always run the body eagerly, so the same code is exercised there.
"""
from __future__ import annotations

from typing import Callable, Hashable, Iterable, Optional

import torch

from .accelerator import get_accelerator


def tensor_key(*groups: Iterable[torch.Tensor]) -> tuple:
    """What a graph bakes in about some tensors: where they live and their
    layout. Equal keys mean the captured addresses are still the right ones."""
    return tuple((t.data_ptr(), t.dtype, tuple(t.shape)) for g in groups for t in g)


class GraphedRegion:
    """Runs `body` eagerly, then as a captured graph (see module doc).

    Counters for tests and benchmarks: `eager_runs`, `captures`, `replays`.
    """

    def __init__(self, warmup: int = 3, accelerator=None) -> None:
        if not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"warmup must be an integer >= 1, got {warmup!r}")
        self.warmup = warmup
        self.accelerator = accelerator
        self.key: Optional[Hashable] = None
        self.graph = None
        self._eager_since_key = 0
        self.eager_runs = self.captures = self.replays = 0

    def __call__(self, key: Hashable, body: Callable[[], None]) -> None:
        acc = self.accelerator or get_accelerator()
        if not acc.graphs_supported():
            self.eager_runs += 1
            body()
            return
        if key != self.key:  # something the graph baked in changed: start over
            self.key, self.graph, self._eager_since_key = key, None, 0
        if self.graph is None and self._eager_since_key < self.warmup:
            self._eager_since_key += 1
            self.eager_runs += 1
            self._run_on_side_stream(acc, body)
            return
        if self.graph is None:
            graph = acc.create_graph()
            with acc.capture_to_graph(graph):
                body()
            self.graph = graph
            self.captures += 1
        acc.replay_graph(self.graph)
        self.replays += 1

    def reset(self) -> None:
        """Drop the graph (the next calls warm up and capture again)."""
        self.key, self.graph, self._eager_since_key = None, None, 0

    @staticmethod
    def _run_on_side_stream(acc, body: Callable[[], None]) -> None:
        side = acc.Stream()
        side.wait_stream(acc.current_stream())
        with acc.stream(side):
            body()
        acc.current_stream().wait_stream(side)
