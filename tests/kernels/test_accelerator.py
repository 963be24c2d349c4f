"""Accelerator selection and interface."""
import subprocess
import sys

import pytest
import torch

from onebit.accelerator import (Accelerator, CpuAccelerator, EagerGraph, get_accelerator,
                                set_accelerator)


def _select(env_value):
    code = ("from onebit.accelerator import get_accelerator as g\n"
            "a = g(); print(a.name, a.communication_backend_name(), a.onebit_backend())")
    import os

    env = {k: v for k, v in os.environ.items() if k != "ONEBIT_ACCELERATOR"}
    if env_value is not None:
        env["ONEBIT_ACCELERATOR"] = env_value
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=env)


def test_autodetect_picks_cpu_without_devices():
    if torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available()):
        pytest.skip("a GPU is present, so auto-detection rightly picks it")
    proc = _select(None)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["cpu", "gloo", "compressed"]


def test_env_var_selects_cpu_explicitly():
    proc = _select("CPU")
    assert proc.stdout.split() == ["cpu", "gloo", "compressed"], proc.stderr


def test_unknown_env_value_is_a_clear_value_error():
    proc = _select("tpu")
    assert proc.returncode != 0
    assert "ValueError" in proc.stderr and "'tpu'" in proc.stderr and "cuda" in proc.stderr


def test_unavailable_device_in_env_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    proc = _select("cuda")
    assert proc.returncode != 0 and "no cuda device is available" in proc.stderr


class VendorAccelerator(CpuAccelerator):
    """An external accelerator: the CPU, but it prefers the MPI backend."""

    name = "cpu"

    def onebit_backend(self):
        return "mpi"


def test_set_accelerator_with_external_subclass():
    before = get_accelerator()
    try:
        set_accelerator(VendorAccelerator())
        assert isinstance(get_accelerator(), VendorAccelerator)
        assert get_accelerator().onebit_backend() == "mpi"
        assert get_accelerator().communication_backend_name() == "gloo"
    finally:
        set_accelerator(before)
    with pytest.raises(ValueError, match="Accelerator"):
        set_accelerator("cuda")


def test_cpu_interface():
    acc = CpuAccelerator()
    assert acc.is_available() and acc.device_count() == 1
    assert acc.device_name() == "cpu" and acc.current_device_name() == "cpu"
    t = torch.ones(3)
    assert acc.on_accelerator(t) and acc.pin_memory(t) is t
    acc.synchronize()
    s = acc.Stream()
    with acc.stream(s):
        pass
    acc.current_stream().synchronize()
    e1, e2 = acc.Event(enable_timing=True), acc.Event(enable_timing=True)
    e1.record()
    e2.record()
    assert e1.elapsed_time(e2) >= 0
    # Graphs: the eager path runs the body during capture; replay is a no-op.
    assert not acc.graphs_supported()
    g = acc.create_graph()
    assert isinstance(g, EagerGraph)
    ran = []
    with acc.capture_to_graph(g):
        ran.append(1)
    acc.replay_graph(g)
    assert ran == [1]


def test_op_builders_by_name():
    acc = CpuAccelerator()
    assert acc.get_op_builder("PackbitsBuilder").__name__ == "CPUPackbitsBuilder"
    assert acc.create_op_builder("PackbitsBuilder") is not None
    assert acc.get_op_builder("NoSuchBuilder") is None
    assert acc.create_op_builder("NoSuchBuilder") is None


def test_abstract_base_cannot_be_instantiated():
    with pytest.raises(TypeError):
        Accelerator()


@pytest.mark.parametrize("env, expected", [
    ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}, "hierarchical"),       # torchrun, 2 nodes x 4
    ({"OMPI_COMM_WORLD_SIZE": "6", "OMPI_COMM_WORLD_LOCAL_SIZE": "3"}, "hierarchical"),
    ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}, "compressed"),         # one node
    ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "1"}, "compressed"),         # one rank per node
    ({"WORLD_SIZE": "4"}, "compressed"),                                   # nothing said
    ({"WORLD_SIZE": "4", "ONEBIT_RANKS_PER_NODE": "2"}, "hierarchical"),  # the override
], ids=["torchrun-2x4", "openmpi-2x3", "one-node", "one-per-node", "unknown", "override"])
def test_default_backend_is_hierarchical_on_several_nodes_of_several_ranks(monkeypatch, env,
                                                                           expected):
    for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE",
                "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "ONEBIT_RANKS_PER_NODE"):
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert CpuAccelerator().onebit_backend() == expected
    from onebit.backends import backend_name

    assert backend_name(None) == get_accelerator().onebit_backend()
