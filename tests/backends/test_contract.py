"""The backend contract (onebit.backends.contract) and the wire format's
constants and checks (onebit.wire), each in one place."""
import pytest
import torch

from onebit import ops, wire
from onebit.backends import get_backend, register_backend
from onebit.backends.contract import MEMBERS, CompressedAllreduce, missing_members
from onebit.backends.layout import BlockLayout

from tests.distributed import run_workers


def _built_backends(rank, world):
    found = {}
    for name, kwargs in (("compressed", {}), ("hierarchical", {"node_of_rank": [0, 0, 1, 1]}),
                         ("gloo", {"block_size": 64})):
        backend = get_backend(name, **kwargs)
        found[name] = (isinstance(backend, CompressedAllreduce), missing_members(backend),
                       type(backend).__name__)
    return found


def test_flat_and_hierarchical_backends_meet_the_contract():
    for found in run_workers(_built_backends, 4, timeout=90):
        assert found["compressed"] == (True, [], "CompressedBackend")
        assert found["hierarchical"] == (True, [], "HierarchicalBackend")
        assert found["gloo"][:2] == (True, [])  # DeepSpeed's name for the same backend


def test_the_contract_lists_what_the_optimizers_use():
    assert {"compressed_allreduce", "layout", "error_sizes", "stats", "rank", "size",
            "block_size", "scale_dtype", "communication_device"} <= set(MEMBERS)


class _HalfBackend:
    """A vendor's backend that forgot most of the contract."""

    name, block_size = "half", 256

    def compressed_allreduce(self, buffer_m, worker_error, server_error, local_rank=None,
                             layout=None):
        return buffer_m


def test_a_registered_backend_that_breaks_the_contract_is_refused_by_name(monkeypatch):
    import onebit.backends

    # The registry as it was once this test ends (other tests list its names).
    monkeypatch.setattr(onebit.backends, "_FACTORIES", dict(onebit.backends._FACTORIES))
    register_backend("test-half", lambda group=None, **kw: _HalfBackend())
    with pytest.raises(TypeError) as err:
        get_backend("test-half")
    message = str(err.value)
    assert "'test-half' backend (_HalfBackend) lacks" in message
    for member in ("layout", "error_sizes", "stats", "rank", "size", "scale_dtype"):
        assert member in message
    assert "compressed_allreduce" not in message.split("lacks")[1].split("of onebit")[0]


@pytest.mark.parametrize("bad", [0, 4, 12, -8, 8.0, True, "256"])
def test_block_size_must_be_whole_bytes_of_signs(bad):
    with pytest.raises(ValueError, match=r"block_size must be a positive multiple of 8.*got"):
        wire.check_block_size(bad)
    with pytest.raises(ValueError, match="block_size"):
        BlockLayout([10], bad, 2)  # the layout checks with the same function


@pytest.mark.parametrize("name, dtype", [("float32", torch.float32), ("FP32", torch.float32),
                                         ("bf16", torch.bfloat16), (torch.bfloat16, torch.bfloat16)])
def test_scale_dtype_names(name, dtype):
    assert wire.scale_dtype_from(name) is dtype


@pytest.mark.parametrize("bad", ["float16", torch.float16, None, 32])
def test_other_scale_dtypes_are_refused(bad):
    with pytest.raises(ValueError, match="scale_dtype must be float32 or bfloat16"):
        wire.scale_dtype_from(bad)


def test_the_kernels_take_the_wire_formats_scale_dtypes():
    assert ops.SCALE_DTYPES is wire.SCALE_DTYPES
    assert wire.DEFAULT_SCALE_DTYPE in wire.SCALE_DTYPES
    wire.check_block_size(wire.DEFAULT_BLOCK_SIZE)


def test_the_pipeline_driver_overlaps_each_piece_with_the_next():
    """run_pipelined, on 3 pieces and the allreduce's 3 stages: the order
    of work, starts and waits written out by hand (piece i's all-to-all is
    on the wire while piece i + 1 is compressed, and so on)."""
    from onebit.backends.pipeline import PipelineStage, run_pipelined

    log = []

    class Handle:
        def __init__(self, name):
            self.name = name

        def wait(self):
            log.append(f"wait {self.name}")

    def start(kind):
        def go(piece):
            log.append(f"start {kind}{piece}")
            return Handle(f"{kind}{piece}")
        return go

    def on_wire(call, *args):
        return call(*args)

    run_pipelined([0, 1, 2], [
        PipelineStage(lambda i: log.append(f"worker{i}"), start("a2a")),
        PipelineStage(lambda i: log.append(f"server{i}"), start("gather")),
        PipelineStage(lambda i: log.append(f"decode{i}"))], on_wire)
    assert log == [
        "worker0", "start a2a0",
        "worker1", "start a2a1", "wait a2a0", "server0", "start gather0",
        "worker2", "start a2a2", "wait a2a1", "server1", "start gather1", "wait gather0",
        "decode0",
        "wait a2a2", "server2", "start gather2", "wait gather1", "decode1",
        "wait gather2", "decode2"]
