"""A CPU stand-in for CUDA graphs, so graph capture is tested on every machine.

It keeps the three properties of a real graph that code can get wrong:

* capture *records* work and leaves every tensor as it was (the caller must
  replay to get the work done);
* replay re-runs the recorded ops on the tensors captured, with the Python
  numbers captured: a float read at capture stays frozen, a tensor replaced
  after capture is not seen;
* a host sync (`.item()`, `float(t)`, `.tolist()`) during capture is an error.

Ops are recorded at the aten level with a TorchDispatchMode. Independent of
onebit's graph code: it only implements the accelerator's graph hooks.
"""
import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from onebit.accelerator import CpuAccelerator

HOST_SYNC = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default}


class EmulatedGraph:
    def __init__(self):
        self.ops = []  # (op, args, kwargs, outputs at capture)

    def replay(self):
        # Outputs made during capture are replaced by those made now.
        now = {}

        def swap(x):
            return now.get(id(x), x) if isinstance(x, torch.Tensor) else x

        for op, args, kwargs, outs in self.ops:
            result = op(*tree_map(swap, args), **tree_map(swap, kwargs))
            for old, new in zip(tree_leaves(outs), tree_leaves(result)):
                if isinstance(old, torch.Tensor):
                    now[id(old)] = new


class _Recorder(TorchDispatchMode):
    def __init__(self, graph):
        super().__init__()
        self.graph = graph
        self.saved = []  # (tensor, its value before the first write in capture)
        self.seen = set()

    def __torch_dispatch__(self, op, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if op in HOST_SYNC:
            raise RuntimeError(f"host sync ({op}) during graph capture")
        for i, arg in enumerate(op._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = kwargs.get(arg.name, args[i] if i < len(args) else None)
            for t in tree_leaves(value):
                if isinstance(t, torch.Tensor) and id(t) not in self.seen:
                    self.seen.add(id(t))
                    self.saved.append((t, t.clone()))
        result = op(*args, **kwargs)
        self.graph.ops.append((op, args, kwargs, result))
        return result

    def restore(self):
        for t, before in reversed(self.saved):  # the earliest save is written last
            t.copy_(before)


class EmulatedGraphAccelerator(CpuAccelerator):
    """The CPU accelerator, with graphs."""

    def graphs_supported(self):
        return True

    def create_graph(self):
        return EmulatedGraph()

    @contextlib.contextmanager
    def capture_to_graph(self, graph, pool=None, stream=None):
        recorder = _Recorder(graph)
        with torch.no_grad(), recorder:
            yield
        with torch.no_grad():
            recorder.restore()

    def replay_graph(self, graph):
        with torch.no_grad():
            graph.replay()
