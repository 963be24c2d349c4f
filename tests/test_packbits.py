"""packbits / unpackbits against numpy, on every kernel path we can run here."""
import subprocess
import sys

import numpy as np
import pytest
import torch

from onebit import ops
from onebit.builders import CPUPackbitsBuilder, TorchKernels

SIZES = [0, 1, 7, 8, 9, 1023, 2**20 + 3]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
SPECIAL = [-0.0, 0.0, float("inf"), float("-inf")]


def specials(dtype):
    tiny = torch.finfo(dtype).tiny  # smallest normal; halve it for subnormals
    return torch.tensor(SPECIAL + [tiny / 4, -tiny / 4, tiny, -tiny], dtype=dtype)


def sample(n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
    k = min(n, len(specials(dtype)))
    if k:  # scatter the special values among the random ones
        idx = torch.randperm(n, generator=g)[:k]
        x[idx] = specials(dtype)[:k]
    return x


def numpy_reference(x):
    # numpy has no bfloat16: compare in float64, which keeps every sign and zero.
    return np.packbits(x.to(torch.float64).numpy() >= 0, bitorder="little")


def native_kernels():
    return CPUPackbitsBuilder().load()


KERNELS = {"native": native_kernels, "torch": TorchKernels}


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_pack_matches_numpy(kernel, dtype, n):
    k = KERNELS[kernel]()
    x = sample(n, dtype, seed=n)
    out = torch.empty((n + 7) // 8, dtype=torch.uint8)
    if n:
        k.pack(x, out)
    assert np.array_equal(out.numpy(), numpy_reference(x))


@pytest.mark.parametrize("n", SIZES)
def test_unpack_inverts_pack_on_signs(n):
    x = sample(n, torch.float32, seed=n + 1)
    packed = ops.packbits(x)
    expected = np.where(x.numpy() >= 0, 1.0, -1.0).astype(np.float32)
    got = ops.unpackbits(packed, n)
    assert got.dtype == torch.float32 and got.shape == (n,)
    assert np.array_equal(got.numpy(), expected)
    # numpy's unpackbits of the same bytes agrees too
    bits = np.unpackbits(packed.numpy(), bitorder="little")[:n]
    assert np.array_equal(bits * 2.0 - 1.0, expected)


def test_packbits_any_shape_and_non_contiguous():
    x = torch.randn(37, 41).t()  # non-contiguous
    assert not x.is_contiguous()
    assert np.array_equal(ops.packbits(x).numpy(), numpy_reference(x.contiguous().reshape(-1)))
    y = torch.randn(5, 3, 7)
    assert np.array_equal(ops.packbits(y).numpy(), numpy_reference(y.reshape(-1)))


def test_nan_packs_as_zero_bit():
    x = torch.tensor([float("nan"), 1.0, float("nan"), -1.0, 0.0])
    assert ops.packbits(x).tolist() == [0b10010]


def test_packbits_rejects_integer_input():
    with pytest.raises(ValueError, match="floating"):
        ops.packbits(torch.arange(8))
    with pytest.raises(ValueError, match="uint8"):
        ops.unpackbits(torch.zeros(2), 8)
    with pytest.raises(ValueError, match="needs 2 bytes"):
        ops.unpackbits(torch.zeros(1, dtype=torch.uint8), 9)


def _run_isolated(code, **env):
    import os

    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **env})


PORTABLE_VS_AVX2 = """
import numpy as np, torch
from onebit.builders import CPUPackbitsBuilder
k = CPUPackbitsBuilder().load()
print(k.name)
torch.manual_seed(0)
x = torch.randn(2**20 + 13); x[::97] = 0.0; x[5::101] = -0.0
out = torch.empty((x.numel() + 7) // 8, dtype=torch.uint8); k.pack(x, out)
dec = torch.empty(x.numel()); k.decode(out.view(1, -1), torch.ones(1), x.numel(), dec)
np.save("{path}", np.concatenate([out.numpy().astype(np.float32), dec.numpy()]))
"""


def test_avx2_and_portable_paths_agree(tmp_path):
    results = {}
    for name, flag in (("default", "0"), ("portable", "1")):
        path = tmp_path / f"{name}.npy"
        proc = _run_isolated(PORTABLE_VS_AVX2.format(path=path), ONEBIT_CPU_PORTABLE=flag)
        assert proc.returncode == 0, proc.stderr
        results[name] = (proc.stdout.strip(), np.load(path))
    assert results["portable"][0] == "cpu-portable"
    assert np.array_equal(results["default"][1], results["portable"][1])


def test_fused_compensate_pack_matches_torch_path():
    torch.manual_seed(3)
    n, n_buf = 8 * 3 * 4001, 8 * 3 * 4001 - 29  # padding in the tail
    buf = torch.randn(n_buf)
    err0 = torch.randn(n) * 0.1
    results = []
    for k in (native_kernels(), TorchKernels()):
        err, bits, scale = err0.clone(), torch.empty(n // 8, dtype=torch.uint8), torch.empty(1)
        k.compensate_pack(buf, err, bits, scale)
        results.append((err, bits, scale))
    (e1, b1, s1), (e2, b2, s2) = results
    x = torch.cat([buf, torch.zeros(n - n_buf)]).double() + err0.double()
    s_ref = x.norm() / n ** 0.5
    assert abs(s1.item() - s_ref.item()) <= 1e-6 * s_ref.item()
    assert abs(s2.item() - s_ref.item()) <= 1e-6 * s_ref.item()
    assert torch.equal(b1, b2)
    assert np.array_equal(b1.numpy(), np.packbits(x.numpy() >= 0, bitorder="little"))
    e_ref = x - s_ref * torch.where(x >= 0, 1.0, -1.0).double()
    assert torch.allclose(e1.double(), e_ref, atol=1e-5 * s_ref.item(), rtol=0)
    assert torch.allclose(e2.double(), e_ref, atol=1e-5 * s_ref.item(), rtol=0)


def test_decode_mean_matches_numpy():
    rng = np.random.default_rng(1)
    rows, cols = 3, 8 * 1000 - 5
    signs = rng.choice([-1.0, 1.0], size=(rows, cols))
    scales = rng.uniform(0.5, 2.0, size=rows).astype(np.float32)
    bits = torch.from_numpy(np.stack([np.packbits(s >= 0, bitorder="little") for s in signs]))
    expected = (signs * scales[:, None].astype(np.float64)).mean(0)
    for k in (native_kernels(), TorchKernels()):
        out = torch.empty(cols)
        k.decode(bits, torch.from_numpy(scales), cols, out)
        assert np.allclose(out.numpy(), expected, rtol=1e-6, atol=1e-6)


JIT = """
import onebit.builders.cpu as c
k = c.CPUPackbitsBuilder().load()
import torch, numpy as np
x = torch.randn(1001); out = torch.empty(126, dtype=torch.uint8); k.pack(x, out)
assert np.array_equal(out.numpy(), np.packbits(x.numpy() >= 0, bitorder="little"))
print(k._m.__file__)
"""


def test_jit_build_when_installed_kernel_is_missing(tmp_path):
    proc = _run_isolated(JIT, ONEBIT_FORCE_JIT="1", ONEBIT_BUILD_DIR=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().startswith(str(tmp_path))


FALLBACK = """
import warnings, torch, numpy as np
from onebit import ops
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    x = torch.randn(999)
    a = ops.packbits(x); b = ops.packbits(x)
assert np.array_equal(a.numpy(), np.packbits(x.numpy() >= 0, bitorder="little"))
print(ops.kernels_for(x.device).name, sum("pure-torch" in str(m.message) for m in w))
"""


def test_missing_compiler_falls_back_to_torch_with_one_warning(tmp_path):
    proc = _run_isolated(FALLBACK, ONEBIT_FORCE_JIT="1", ONEBIT_BUILD_DIR=str(tmp_path),
                         ONEBIT_CXX="/nonexistent/c++")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["torch", "1"]


def test_broken_source_gives_clear_builder_error(tmp_path, monkeypatch):
    from onebit.builders import OpBuilderError
    import onebit.builders.base as base

    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "packbits.cpp").write_text("this is not C++\n")
    monkeypatch.setattr(base, "kernels_dir", lambda: tmp_path)
    monkeypatch.setenv("ONEBIT_BUILD_DIR", str(tmp_path / "build"))
    with pytest.raises(OpBuilderError, match="compiling failed"):
        CPUPackbitsBuilder().jit_load()
