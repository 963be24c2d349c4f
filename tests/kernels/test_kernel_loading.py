"""Kernels fail at load, not in training: the loader's self-test launch, the
fallback it triggers, the compiler's own error, and launches that follow the
data's device from any thread. All of it runs without a GPU: the launchers
below are fakes that record what they were handed."""
import contextlib
import stat
import threading
import warnings

import numpy as np
import pytest
import torch

from onebit import ops
from onebit.builders import CUDAPackbitsBuilder, OpBuilderError, TorchKernels, self_test
from onebit.builders.native import LauncherKernels


class FlippedPack(TorchKernels):
    """A kernel that runs but writes the wrong bits (as one built for another
    bit order, or launched with no image for this GPU, might)."""

    name = "flipped"

    def pack(self, x, out):
        super().pack(x, out)
        out.bitwise_not_()


def test_self_test_passes_real_kernels_and_names_a_wrong_one():
    self_test(ops.kernels_for(torch.device("cpu")), torch.device("cpu"))
    self_test(TorchKernels(), torch.device("cpu"))
    with pytest.raises(OpBuilderError, match="flipped kernels failed their self-test on cpu: packed"):
        self_test(FlippedPack(), torch.device("cpu"))


def test_a_kernel_that_fails_its_self_test_falls_back_to_torch_with_the_reason(monkeypatch):
    from onebit.builders import CPUPackbitsBuilder

    monkeypatch.setattr(CPUPackbitsBuilder, "load", lambda self: FlippedPack())
    monkeypatch.setattr(ops, "_kernels", {})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        k = ops.kernels_for(torch.device("cpu"))
    assert type(k) is TorchKernels
    assert any("flipped kernels failed their self-test" in str(w.message) for w in seen)
    x = torch.randn(100)
    want = np.packbits(x.numpy() >= 0, bitorder="little")
    assert np.array_equal(ops.packbits(x).numpy(), want)  # the fallback gives the right bits


def test_the_linkers_own_error_reaches_the_user(tmp_path, monkeypatch):
    """nvcc deletes its output when the link fails; the builder used to trip
    over the missing file and report that instead."""
    fake = tmp_path / "nvcc"
    fake.write_text('#!/bin/sh\nwhile [ "$1" != "-o" ]; do shift; done\nrm -f "$2"\n'
                    'echo "nvlink error: Undefined reference to onebit_missing" >&2\nexit 1\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("ONEBIT_NVCC", str(fake))
    monkeypatch.setenv("ONEBIT_BUILD_DIR", str(tmp_path / "build"))
    with pytest.raises(OpBuilderError, match="Undefined reference to onebit_missing"):
        CUDAPackbitsBuilder().build()


class _Recorder:
    """A fake launcher library: each launcher records the current device of
    the guard and the stream it was handed."""

    def __init__(self):
        self.current, self.calls = None, []

    def guard(self, device):
        @contextlib.contextmanager
        def entered():
            before, self.current = self.current, device
            try:
                yield
            finally:
                self.current = before
        return entered()

    def stream(self, device):
        assert self.current == device, "the stream was asked for outside the device guard"
        return 1000 + (device.index or 0)

    def __getattr__(self, name):
        if not name.startswith("onebit_fake_"):
            raise AttributeError(name)

        def launcher(*args):
            self.calls.append((name[len("onebit_fake_"):], threading.current_thread().name,
                               self.current, args[-1]))
            return 0
        return launcher


def test_every_launch_runs_under_the_datas_device_and_its_stream_from_any_thread():
    lib = _Recorder()
    kernels = LauncherKernels("fake", lib, "onebit_fake", lib.stream, stream_first=False,
                              device_guard=lib.guard)
    x, out = torch.randn(64), torch.empty(8, dtype=torch.uint8)

    def launch_all():
        kernels.pack(x, out)
        kernels.decode(out.view(1, -1), torch.ones(1), 64, 64, torch.empty(64))
        kernels.compensate(x, torch.zeros(64), torch.empty(1, dtype=torch.float64), 64)
        kernels.pack_error(torch.zeros(64), torch.ones(1), 64, out)

    worker = threading.Thread(target=launch_all, name="comm-thread")
    worker.start()
    worker.join()
    launch_all()
    assert [c[0] for c in lib.calls] == ["pack", "decode", "compensate", "pack_error"] * 2
    assert {c[1] for c in lib.calls} == {"comm-thread", threading.current_thread().name}
    assert all(c[2] == out.device and c[3] == 1000 for c in lib.calls), lib.calls
