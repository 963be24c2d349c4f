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
dec = torch.empty(x.numel()); k.decode(out.view(1, -1), torch.ones(1), (x.numel() + 7) // 8 * 8, x.numel(), dec)
blocks = torch.rand(3, (x.numel() + 63) // 64) + 0.5
dec3 = torch.empty(x.numel()); k.decode(out.view(1, -1).expand(3, -1), blocks, 64, x.numel(), dec3)
n = 256 * 3 * 67; buf = torch.randn(n - 269) * torch.logspace(-6, 3, n - 269); err = torch.randn(n) * 0.3
counts = torch.full((n // 256,), 256.0, dtype=torch.float64); counts[-2:] = 243.0
scales, bits = torch.empty(4 * (n // 256), dtype=torch.uint8), torch.empty(n // 8, dtype=torch.uint8)
k.compress(buf, err, counts, 256, scales, bits)
# Three rows of a piece: strided input, a short last row, rows of messages.
rows_err = (torch.randn(3 * 4096) * 0.3).view(3, 4096)[:, 1024:3072]
msgs = torch.zeros(3, 256 + 8 * 4 + 5, dtype=torch.uint8)
k.compress_rows(buf[1024:2 * 4096 + 1500], rows_err, counts[:48].view(3, 16)[:, 4:12], 256,
                msgs[:, 256:256 + 32], msgs[:, :256])
rows_out = torch.zeros(2 * 4096 + 1500)
k.decode_rows(msgs, blocks[:, :8].contiguous(), 256, 2048 - 3, rows_out, 4096)
np.save("{path}", np.concatenate([out.numpy().astype(np.float32), dec.numpy(), dec3.numpy(),
                                 err.numpy(), scales.view(torch.float32).numpy(), bits.numpy().astype(np.float32),
                                 rows_err.reshape(-1).numpy(), msgs.reshape(-1).numpy().astype(np.float32),
                                 rows_out.numpy()]))
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


@pytest.mark.parametrize("block", [8, 64, 256])
def test_block_compensate_and_pack_error_match_numpy(block):
    """Pass 1 leaves x = buf (zero-padded) + err and each block's sum of
    squares; pass 2 packs x's signs and subtracts each block's scale."""
    torch.manual_seed(3)
    n = block * 3 * 401
    n_buf = n - 29 - block  # padding in the tail, across a block boundary
    buf = torch.randn(n_buf) * torch.logspace(-6, 2, n_buf)  # blocks of very different scales
    err0 = torch.randn(n) * 0.1
    err0[block:2 * block] = 0.0
    buf[block:2 * block] = 0.0  # an all-zero block
    x = np.concatenate([buf.double().numpy(), np.zeros(n - n_buf)]) + err0.double().numpy()
    sumsq_ref = (x.reshape(-1, block) ** 2).sum(1)
    scales = torch.from_numpy(np.sqrt(sumsq_ref / block)).float()
    s_ref = np.repeat(scales.double().numpy(), block)
    e_ref = x - s_ref * np.where(x >= 0, 1.0, -1.0)
    for k in (native_kernels(), TorchKernels()):
        err, sumsq = err0.clone(), torch.empty(n // block, dtype=torch.float64)
        k.compensate(buf, err, sumsq, block)
        np.testing.assert_allclose(err.double().numpy(), x, rtol=1e-6, atol=0)
        np.testing.assert_allclose(sumsq.numpy(), sumsq_ref, rtol=1e-6, atol=0)
        bits = torch.empty(n // 8, dtype=torch.uint8)
        k.pack_error(err, scales, block, bits)
        assert np.array_equal(bits.numpy(), np.packbits(x >= 0, bitorder="little")), k.name
        # Each block within float32 rounding of its own scale.
        assert np.all(np.abs(err.double().numpy() - e_ref) <= 1e-6 * (s_ref + np.abs(x))), k.name
        assert not err[block:2 * block].any(), "an all-zero block keeps zero error"


def canonical_sumsq(x: np.ndarray, block: int) -> np.ndarray:
    """The wire format's sum of squares of each block, written apart from the
    kernels: eight partial sums, partial j over elements j, j + 8, ... in
    turn, then ((s0 + s4) + (s1 + s5)) + ((s2 + s6) + (s3 + s7))."""
    squares = x.astype(np.float64).reshape(-1, block // 8, 8) ** 2
    part = np.zeros((squares.shape[0], 8))
    for i in range(block // 8):
        part = part + squares[:, i, :]
    return ((part[:, 0] + part[:, 4]) + (part[:, 1] + part[:, 5])) + \
        ((part[:, 2] + part[:, 6]) + (part[:, 3] + part[:, 7]))


@pytest.mark.parametrize("block", [8, 64, 256, 1024])
def test_every_kernel_sums_a_block_in_the_one_order(block):
    """A block's sum of squares has one set of bits, whichever kernel sums it
    (so the scales match across devices): the native kernel's and the torch
    fallback's equal the canonical order bit for bit. The data make a naive
    sequential sum differ from it, so the test would see another order."""
    g = torch.Generator().manual_seed(block)
    n = block * 2 * 301
    n_buf = n - 13 - block  # a block straddles the end of buf
    buf = torch.randn(n_buf, generator=g) * torch.logspace(-6, 3, n_buf)
    err0 = torch.randn(n, generator=g) * 0.3
    x = np.concatenate([buf.numpy(), np.zeros(n - n_buf, np.float32)]) + err0.numpy()  # float32 adds
    want = canonical_sumsq(x, block)
    naive = np.array([sum(float(v) ** 2 for v in row) for row in x.astype(np.float64).reshape(-1, block)])
    assert not np.array_equal(naive, want), "the data cannot tell the orders apart"
    for k in (native_kernels(), TorchKernels()):
        err, sumsq = err0.clone(), torch.empty(n // block, dtype=torch.float64)
        k.compensate(buf, err, sumsq, block)
        assert np.array_equal(err.numpy(), x), k.name
        assert np.array_equal(sumsq.numpy(), want), k.name


COMPRESS_CASE = """
import numpy as np, torch
from onebit.ops import composed_compress

def case(k, block, scale_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    n = block * 3 * 101
    n_buf = n - 29 - block  # padding in the tail, across a block boundary
    buf = torch.randn(n_buf, generator=g) * torch.logspace(-6, 2, n_buf)  # blocks of very different scales
    buf[block:2 * block] = 0.0
    err = torch.randn(n, generator=g) * 0.1
    err[block:2 * block] = 0.0  # an all-zero block
    counts = torch.full((n // block,), float(block), dtype=torch.float64)
    counts[-2:] = torch.tensor([max(block - 29.0, 3.0), 1.0])  # blocks with few real elements
    nbytes = scale_dtype.itemsize * (n // block)
    out = []
    for fused in (True, False):
        e, scales, bits = err.clone(), torch.empty(nbytes, dtype=torch.uint8), torch.empty(n // 8, dtype=torch.uint8)
        if fused:
            k.compress(buf, e, counts, block, scales, bits)
        else:
            composed_compress(k, buf, e, counts, block, scale_dtype, scales, bits)
        out.append((e, scales, bits))
    return buf, err, counts, out
"""


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [8, 64, 256])
def test_fused_compress_equals_its_two_passes_and_matches_numpy(block, scale_dtype):
    """The CPU kernel's one-pass compress gives the bits of compensate,
    torch's scale rounding and pack_error in a row; and those match numpy."""
    scope = {}
    exec(COMPRESS_CASE, scope)
    buf, err, counts, (fused, composed) = scope["case"](native_kernels(), block, scale_dtype, block)
    for name, a, b in zip(("error", "scales", "bits"), fused, composed):
        assert torch.equal(a, b), f"the fused {name} differ"
    e, scales, bits = fused
    x = np.concatenate([buf.double().numpy(), np.zeros(err.numel() - buf.numel())]) + err.double().numpy()
    s_ref = np.sqrt((x.reshape(-1, block) ** 2).sum(1) / counts.numpy())
    s = scales.view(scale_dtype).double().numpy()
    np.testing.assert_allclose(s, s_ref, rtol=2e-7 if scale_dtype == torch.float32 else 2 ** -8)
    assert np.array_equal(bits.numpy(), np.packbits(x >= 0, bitorder="little"))
    per = np.repeat(s, block)
    assert np.all(np.abs(e.double().numpy() - (x - per * np.where(x >= 0, 1.0, -1.0)))
                  <= 1e-6 * (per + np.abs(x)))
    assert not e[block:2 * block].any() and s[1] == 0.0, "an all-zero block stays zero"


def test_portable_fused_compress_equals_its_two_passes():
    script = COMPRESS_CASE + """
from onebit.builders import CPUPackbitsBuilder
k = CPUPackbitsBuilder().load()
print(k.name)
for dtype in (torch.float32, torch.bfloat16):
    *_, (fused, composed) = case(k, 64, dtype, 5)
    assert all(torch.equal(a, b) for a, b in zip(fused, composed)), dtype
"""
    proc = _run_isolated(script, ONEBIT_CPU_PORTABLE="1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "cpu-portable"


def test_decode_mean_matches_numpy():
    rng = np.random.default_rng(1)
    rows, cols, block = 3, 8 * 1000 - 5, 64
    signs = rng.choice([-1.0, 1.0], size=(rows, cols))
    nblocks = -(-cols // block)
    scales = rng.uniform(0.5, 2.0, size=(rows, nblocks)).astype(np.float32)
    bits = torch.from_numpy(np.stack([np.packbits(s >= 0, bitorder="little") for s in signs]))
    per_element = np.repeat(scales.astype(np.float64), block, axis=1)[:, :cols]
    expected = (signs * per_element).mean(0)
    for k in (native_kernels(), TorchKernels()):
        out = torch.empty(cols)
        k.decode(bits, torch.from_numpy(scales), block, cols, out)
        assert np.allclose(out.numpy(), expected, rtol=1e-6, atol=1e-6)


def strided_rows_case(block, scale_dtype, seed, rows=3, device="cpu"):
    """Piece [a, b) of `rows` chunks of `chunk` elements, as the worker sees
    it: err rows `chunk` apart, buf ending inside the last row, counts laid
    out like err's blocks, and message rows with room to spare."""
    g = torch.Generator().manual_seed(seed)
    chunk, a, b = 7 * block, 2 * block, 6 * block
    numel = (rows - 1) * chunk + 3 * block + 5  # the last row's buf ends mid-piece
    buf = torch.randn(numel, generator=g) * torch.logspace(-5, 2, numel)
    err = torch.randn(rows * chunk, generator=g) * 0.1
    err[a:a + block] = 0.0
    buf[a:a + block] = 0.0  # an all-zero block
    counts = torch.randint(1, block + 1, (rows * chunk // block,), generator=g).double()
    code_bytes = (b - a) // 8
    width = code_bytes + (b - a) // block * scale_dtype.itemsize + 3
    return dict(buf=buf.to(device), err=err.to(device), counts=counts.to(device), chunk=chunk,
                a=a, b=b, code_bytes=code_bytes, width=width, rows=rows)


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [8, 24, 256])
@pytest.mark.parametrize("rows", [1, 3, 4])
def test_compress_rows_and_decode_rows_equal_the_torch_kernels_row_by_row(block, scale_dtype,
                                                                         rows):
    """ops.compress_rows and ops.decode_rows (the native kernel's one call
    for every rank's row) give, bit for bit, what the torch fallback gives
    one row at a time: the same errors, codes, scales and decoded values.
    Rows are strided, the last one's buf ends inside the piece, and a row
    of the decode is cut short by the end of out."""
    from onebit.ops import composed_compress

    c = strided_rows_case(block, scale_dtype, block + rows, rows)
    chunk, a, b, cb = c["chunk"], c["a"], c["b"], c["code_bytes"]
    blocks = (b - a) // block
    counts = c["counts"].view(rows, chunk // block)[:, a // block:b // block]
    err = c["err"].clone()
    messages = torch.full((rows, c["width"]), 7, dtype=torch.uint8)
    assert type(ops.kernels_for(torch.device("cpu"))).__name__ == "CpuKernels"
    ops.compress_rows(c["buf"][a:], err.view(rows, chunk)[:, a:b], counts, block, scale_dtype,
                      messages, cb)
    torch_k, want_err = TorchKernels(), c["err"].clone()
    for r in range(rows):
        lo = r * chunk + a
        scales, codes = torch.empty(blocks * scale_dtype.itemsize, dtype=torch.uint8), \
            torch.empty(cb, dtype=torch.uint8)
        composed_compress(torch_k, c["buf"][lo:max(lo, min(lo + b - a, c["buf"].numel()))],
                          want_err[lo:lo + b - a], counts[r], block, scale_dtype, scales, codes)
        assert torch.equal(messages[r, :cb], codes), f"row {r}'s codes"
        assert torch.equal(messages[r, cb:cb + scales.numel()], scales), f"row {r}'s scales"
        assert (messages[r, cb + scales.numel():] == 7).all(), "nothing written past the scales"
    assert torch.equal(err, want_err), "the errors (untouched outside [a, b) of each row)"

    scales = messages[:, cb:cb + blocks * scale_dtype.itemsize].clone(
        memory_format=torch.contiguous_format).view(scale_dtype).float()
    total = (rows - 1) * chunk + (b - a) - 5  # the last row cut short by the end of out
    out = torch.full((total,), 3.0)
    ops.decode_rows(messages, scales, b - a, out, chunk, block)
    want = torch.full((total,), 3.0)
    for r in range(rows):
        lo, hi = r * chunk, min(r * chunk + b - a, total)
        torch_k.decode(messages[r:r + 1], scales[r, :-(-(hi - lo) // block)], block, hi - lo,
                       want[lo:hi])
    assert torch.equal(out, want), "decoded rows (and the gaps between them left alone)"


def test_rows_operations_refuse_what_they_cannot_lay_out():
    err = torch.zeros(3, 64)
    counts = torch.ones(3, 8, dtype=torch.float64)
    messages = torch.zeros(3, 8 + 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match="counts must be float64"):
        ops.compress_rows(torch.zeros(10), err, counts.float(), 8, torch.float32, messages, 8)
    with pytest.raises(ValueError, match="messages must be uint8"):
        ops.compress_rows(torch.zeros(10), err, counts, 8, torch.float32, messages[:, :30], 8)
    with pytest.raises(ValueError, match="must not overlap"):
        ops.compress_rows(torch.zeros(10), torch.zeros(64 * 3 + 64)[:64 * 3].as_strided(
            (3, 64), (32, 1)), counts, 8, torch.float32, messages, 8)
    with pytest.raises(ValueError, match="must hold the signs"):  # signs would run into the scales
        ops.compress_rows(torch.zeros(10), err, counts, 8, torch.float32, messages, 1)
    with pytest.raises(ValueError, match="rows apart"):  # rows written over each other
        ops.compress_rows(torch.zeros(10), err, counts, 8, torch.float32,
                          messages[:1].expand(3, -1), 8)
    with pytest.raises(ValueError, match="bits must be uint8"):
        ops.decode_rows(messages.float(), torch.ones(3, 8), 64, torch.zeros(200), 64, 8)
    with pytest.raises(ValueError, match="scales must be contiguous float32"):
        ops.decode_rows(messages, torch.ones(3, 7), 64, torch.zeros(200), 64, 8)
    with pytest.raises(ValueError, match="stride"):
        ops.decode_rows(messages, torch.ones(3, 8), 64, torch.zeros(200), 32, 8)


JIT = """
import onebit.builders.cpu as c
k = c.CPUPackbitsBuilder().load()
import torch, numpy as np
x = torch.randn(1001); out = torch.empty(126, dtype=torch.uint8); k.pack(x, out)
assert np.array_equal(out.numpy(), np.packbits(x.numpy() >= 0, bitorder="little"))
print(k._m.__file__)
"""


@pytest.mark.slow
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
    (tmp_path / "common").mkdir()  # the shared header, as installed
    for header in CPUPackbitsBuilder.HEADERS:
        (tmp_path / header).write_bytes((base.kernels_dir() / header).read_bytes())
    monkeypatch.setattr(base, "kernels_dir", lambda: tmp_path)
    monkeypatch.setenv("ONEBIT_BUILD_DIR", str(tmp_path / "build"))
    with pytest.raises(OpBuilderError, match="compiling failed"):
        CPUPackbitsBuilder().jit_load()


@pytest.mark.parametrize("rows, block", [(5, 8), (8, 24), (16, 8)])
def test_torch_decode_adds_rows_in_order_as_the_native_kernel(rows, block):
    """torch's sum(0) split 5 or more rows over several accumulators: the
    fallback's server average differed from the C++ kernel's in the last
    bit. Both now equal the rows added in order in fp32 (numpy, row by row)."""
    g = torch.Generator().manual_seed(rows * block)
    cols = 13 * block - 5
    bits = torch.randint(0, 256, (rows, (cols + 7) // 8), dtype=torch.uint8, generator=g)
    nblocks = -(-cols // block)
    scales = torch.exp2(torch.randint(-24, 2, (rows, nblocks), generator=g).float()) * \
        (1 + torch.rand(rows, nblocks, generator=g))
    signs = np.unpackbits(bits.numpy(), axis=1, bitorder="little")[:, :cols].astype(np.float32) * 2 - 1
    per = np.repeat(scales.numpy(), block, axis=1)[:, :cols]
    acc = signs[0] * per[0]
    for r in range(1, rows):
        acc = (acc + signs[r] * per[r]).astype(np.float32)
    want = (acc * np.float32(1.0 / rows)).astype(np.float32)
    native = CPUPackbitsBuilder().load()
    for kernels in (native, TorchKernels()):
        out = torch.empty(cols)
        kernels.decode(bits, scales, block, cols, out)
        assert np.array_equal(out.numpy().view(np.int32), want.view(np.int32)), type(kernels)


def test_ops_refuse_buffers_the_kernels_would_read_or_write_past():
    """The native kernels take raw pointers: an `out` too short, of another
    dtype or strided, a bits_out of one byte, counts of another dtype or
    length, and a row that is not whole blocks were written or read past
    their ends. Each is a ValueError now, and nothing is written."""
    bits, scales = torch.zeros(2, 8, dtype=torch.uint8), torch.ones(2)
    big = torch.zeros(32)
    for out in (big[:8], torch.zeros(64, dtype=torch.float16), torch.zeros(128)[::2]):
        with pytest.raises(ValueError, match="out must be"):
            ops.decode_mean(bits, scales, 64, out, 64)
    assert not big.any()
    with pytest.raises(ValueError, match="bits must be"):
        ops.decode_mean(torch.zeros(0, 8, dtype=torch.uint8), torch.ones(0), 64, None, 64)
    err, counts = torch.zeros(512), torch.full((2,), 256.0, dtype=torch.float64)
    scales_out, bits_out = torch.zeros(8, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    good = dict(buf=torch.ones(512), err=err, counts=counts, block=256,
                scale_dtype=torch.float32, scales_out=scales_out, bits_out=bits_out)
    for bad in (dict(bits_out=torch.zeros(1, dtype=torch.uint8)),
                dict(err=torch.zeros(512, dtype=torch.float16)),
                dict(counts=counts.float()), dict(counts=counts[:1]),
                dict(buf=torch.ones(600))):
        with pytest.raises(ValueError, match="compress"):
            ops.compress(**{**good, **bad})
    assert not err.any() and not bits_out.any()
    ops.compress(**good)  # the same call with good buffers works
    assert bits_out.eq(255).all()
    ops.compress(**{**good, "buf": torch.ones(0), "err": torch.zeros(0), "counts": counts[:0],
                    "scales_out": scales_out[:0], "bits_out": bits_out[:0]})  # empty: nothing
    with pytest.raises(ValueError, match="whole blocks"):
        ops.compress_rows(torch.ones(8), torch.zeros(1, 8), torch.ones(1, 0, dtype=torch.float64),
                          256, torch.float32, torch.zeros(1, 8, dtype=torch.uint8), 1)


def test_a_native_module_built_from_older_sources_is_not_taken(monkeypatch):
    """An ahead-of-time module without the newer entry points (a checkout
    updated without reinstalling) loaded without a word and failed in the
    first allreduce. The loader now builds the current sources instead."""
    import importlib
    import types

    from onebit.builders import cpu

    old = types.SimpleNamespace(pack=None, decode=None)  # lacks compress_rows and the rest
    built = []
    monkeypatch.setattr(importlib, "import_module", lambda name: old)
    monkeypatch.setattr(cpu.CPUPackbitsBuilder, "jit_load", lambda self: built.append(1) or "jit")
    monkeypatch.setattr(cpu, "CpuKernels", lambda m: m)
    assert cpu.CPUPackbitsBuilder().load() == "jit" and built == [1]
