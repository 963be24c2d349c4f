"""Device checks: the CUDA kernel compiles wherever nvcc exists; with a GPU
present, its output is bit-exact against the CPU kernel and the compressed
backend over nccl matches the float64 reference. Skipped (with the reason)
where the device or compiler is absent."""
import shutil

import numpy as np
import pytest
import torch

from onebit.builders import CPUPackbitsBuilder, CUDAPackbitsBuilder, OpBuilderError, SYCLPackbitsBuilder

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")


@pytest.mark.slow  # nvcc takes 10-30 s on 2 cores: the full suite compiles, the fast tier not
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_cuda_kernel_compiles_with_the_builders_own_step(tmp_path):
    obj = CUDAPackbitsBuilder().compile_check(tmp_path / "packbits.o")
    assert obj.stat().st_size > 0


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_cuda_shared_library_links_exports_the_launchers_and_carries_ptx(tmp_path, monkeypatch):
    """The library load() opens, built as the builder builds it: its
    launchers exported (the optimizer's non-finite check among them), contraction off (-fmad=false, the CPU kernel's
    rounding), and PTX for the lowest architecture beside the machine code
    (checked in an uncompressed twin: the fatbin compresses PTX)."""
    import subprocess

    monkeypatch.setenv("ONEBIT_BUILD_DIR", str(tmp_path))
    builder = CUDAPackbitsBuilder()
    assert "-fmad=false" in builder.FLAGS
    lib = builder.build()
    symbols = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True,
                             text=True, check=True).stdout.split()
    for name in ("pack", "decode", "compensate", "pack_error", "compress", "nonfinite", "norms",
                 "lamb_ratio_norms", "compress_rows", "decode_rows"):
        assert f"onebit_cuda_{name}" in symbols
    plain = builder.run_compiler([*builder.FLAGS, "-no-compress", "-shared",
                                  *map(str, builder.sources())], tmp_path / "plain.so")
    text = plain.read_bytes()
    assert b".target sm_80" in text  # PTX of the lowest default architecture
    assert b".target sm_90" not in text  # the others carry machine code only


def test_sycl_kernel_passes_the_host_syntax_check():
    """clang++ -fsycl-host-only against intel-sycl-rt's headers (.ci/run
    installs both); skipped, with the reason, where they are missing."""
    import os

    if shutil.which(os.environ.get("ONEBIT_SYCL_HOST_CXX", "clang++-22")) is None:
        pytest.skip("no clang++-22 for the SYCL host syntax check")
    if not os.environ.get("ONEBIT_SYCL_INCLUDE"):
        pytest.skip("ONEBIT_SYCL_INCLUDE (intel-sycl-rt headers) is not set")
    SYCLPackbitsBuilder().host_syntax_check()


def test_sycl_host_syntax_check_catches_a_broken_source(tmp_path, monkeypatch):
    import os

    import onebit.builders.base as base

    if shutil.which(os.environ.get("ONEBIT_SYCL_HOST_CXX", "clang++-22")) is None or \
            not os.environ.get("ONEBIT_SYCL_INCLUDE"):
        pytest.skip("no SYCL host syntax check toolchain here")
    (tmp_path / "sycl").mkdir()
    good = (base.kernels_dir() / "sycl" / "packbits.cpp").read_text()
    (tmp_path / "sycl" / "packbits.cpp").write_text(good.replace("q.parallel_for", "q.paralel_for", 1))
    (tmp_path / "common").mkdir()  # the shared header, as installed
    for header in SYCLPackbitsBuilder.HEADERS:
        (tmp_path / header).write_bytes((base.kernels_dir() / header).read_bytes())
    monkeypatch.setattr(base, "kernels_dir", lambda: tmp_path)
    with pytest.raises(OpBuilderError, match="host syntax check failed"):
        SYCLPackbitsBuilder().host_syntax_check()


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 7, 33, 1023, 2**20 + 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_cuda_kernels_bit_exact_against_cpu(n, dtype):
    gpu = CUDAPackbitsBuilder().load()
    cpu = CPUPackbitsBuilder().load()
    x = torch.randn(n, dtype=torch.float64).to(dtype)
    x[::13] = -0.0
    out_c = torch.empty((n + 7) // 8, dtype=torch.uint8)
    out_g = out_c.cuda()
    cpu.pack(x, out_c)
    gpu.pack(x.cuda(), out_g)
    assert torch.equal(out_g.cpu(), out_c)
    dec_c, dec_g = torch.empty(n), torch.empty(n, device="cuda")
    one = torch.ones(1)
    block = (n + 7) // 8 * 8
    cpu.decode(out_c.view(1, -1), one, block, n, dec_c)
    gpu.decode(out_g.view(1, -1), one.cuda(), block, n, dec_g)
    assert torch.equal(dec_g.cpu(), dec_c)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("block", [8, 256])
def test_cuda_block_compensate_and_pack_error_match_cpu(block):
    gpu, cpu = CUDAPackbitsBuilder().load(), CPUPackbitsBuilder().load()
    n = block * 4 * 1001
    n_buf = n - 13 - block
    buf, err0 = torch.randn(n_buf) * torch.logspace(-4, 2, n_buf), torch.randn(n) * 0.1
    scales = torch.rand(n // block) + 0.5
    res = []
    for k, dev in ((cpu, "cpu"), (gpu, "cuda")):
        err = err0.clone().to(dev)
        sumsq = torch.empty(n // block, dtype=torch.float64, device=dev)
        bits = torch.empty(n // 8, dtype=torch.uint8, device=dev)
        k.compensate(buf.to(dev), err, sumsq, block)
        k.pack_error(err, scales.to(dev), block, bits)
        res.append((err.cpu(), bits.cpu(), sumsq.cpu()))
    assert torch.equal(res[0][2], res[1][2])  # one summation order on every device
    assert torch.equal(res[0][1], res[1][1])
    assert torch.equal(res[0][0], res[1][0])  # x and x -/+ s round the same on both
    decoded = []
    for k, dev, bits in ((cpu, "cpu", res[0][1]), (gpu, "cuda", res[1][1])):
        out = torch.empty(n, device=dev)
        k.decode(bits.to(dev).view(1, -1), scales.to(dev), block, n, out)
        decoded.append(out.cpu())
    assert torch.equal(decoded[0], decoded[1])


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 16, 32, 33, 70])
@pytest.mark.parametrize("block", [8, 24, 64, 256])
@pytest.mark.parametrize("row_pad", [11, 16])
def test_cuda_decode_of_several_rows_is_bit_exact_against_cpu(rows, block, row_pad):
    """decode_mean's rows (strided, as message rows are) on the vector path
    and, with an output one element off alignment and a ragged tail, on the
    scalar one; each of the three kernels (1-3 rows, 4-15, from 16); the
    tiled one's rows in one pass and in several (33, 70),
    its scales staged (blocks from 64) or read in place, rows it loads in
    16-byte vectors (a stride of whole 16 bytes) or byte by byte; several
    tiles, the last one partial."""
    gpu, cpu = CUDAPackbitsBuilder().load(), CPUPackbitsBuilder().load()
    g = torch.Generator().manual_seed(rows * block + row_pad)
    cols = 2048 * 3 + 8 * 37 + 5
    nbytes = (cols + 7) // 8
    # the message rows' trailing scale bytes; or padded to a 16-byte stride
    row_bytes = nbytes + 11 if row_pad == 11 else -(-nbytes // 16) * 16 + 16
    bits = torch.randint(0, 256, (rows, row_bytes), generator=g, dtype=torch.uint8)
    scales = torch.rand(rows * -(-cols // block), generator=g) * torch.logspace(-3, 3, rows * -(-cols // block))
    want = torch.empty(cols + 1)
    cpu.decode(bits, scales, block, cols, want[1:])
    for offset in (0, 1):
        out = torch.zeros(cols + 1, device="cuda")
        gpu.decode(bits.cuda(), scales.cuda(), block, cols, out[offset:offset + cols])
        assert torch.equal(out[offset:offset + cols].cpu(), want[1:]), offset


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [8, 64, 256, 512, 8192, 24, 16384])
@pytest.mark.parametrize("offset", [0, 1])
def test_cuda_compress_on_tiles_and_octets_is_bit_exact_against_cpu(block, scale_dtype, offset):
    """The one-pass compress's two kernels give the CPU kernel's error, scales and bits:
    the tiled one (power-of-two blocks up to the tile, 8192, on aligned
    buffers) over several tiles and a short last one, and the octet one
    (block 24, block 16384, or an err one element off alignment), with a
    block straddling the end of buf, an all-zero block and blocks with few
    real elements."""
    gpu, cpu = CUDAPackbitsBuilder().load(), CPUPackbitsBuilder().load()
    assert hasattr(gpu, "compress"), "the CUDA library exports no one-pass compress"
    g = torch.Generator().manual_seed(block + offset)
    n = block * (3 * 1117 if block <= 512 else 7)
    n_buf = n - 29 - block
    buf = torch.randn(n_buf, generator=g) * torch.logspace(-6, 3, n_buf)
    buf[block:2 * block] = 0.0
    err0 = torch.randn(n, generator=g) * 0.1
    err0[block:2 * block] = 0.0
    counts = torch.full((n // block,), float(block), dtype=torch.float64)
    counts[-2:] = torch.tensor([max(block - 29.0, 3.0), 1.0])
    res = []
    for k, dev in ((cpu.compress, "cpu"), (gpu.compress, "cuda")):
        err = torch.zeros(n + offset, device=dev)[offset:]
        err.copy_(err0.to(dev))
        scales = torch.empty(scale_dtype.itemsize * (n // block), dtype=torch.uint8, device=dev)
        bits = torch.empty(n // 8, dtype=torch.uint8, device=dev)
        k(buf.to(dev), err, counts.to(dev), block, scales, bits)
        res.append([t.cpu() for t in (err, scales, bits)])
    for name, a, b in zip(("error", "scales", "bits"), *res):
        assert torch.equal(a, b), f"the CUDA kernel's {name} differ from the CPU kernel's"


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [8, 256, 8192, 24, 16384])
@pytest.mark.parametrize("rows", [1, 3, 5])
@pytest.mark.parametrize("offset", [0, 1])
def test_cuda_rows_in_one_launch_are_bit_exact_against_cpu(block, scale_dtype, rows, offset):
    """compress_rows (every rank's row of the worker's message in one
    launch, on the tiled and the octet kernels: blocks 24 and 16384, or err
    and out one element off alignment) and decode_rows (every gathered
    chunk in one launch, the last row cut short) give the CPU kernel's
    errors, codes, scales and values; rows are strided and the last row's
    buf ends inside the piece."""
    from tests.kernels.test_packbits import strided_rows_case

    gpu, cpu = CUDAPackbitsBuilder().load(), CPUPackbitsBuilder().load()
    assert hasattr(gpu, "compress_rows") and hasattr(gpu, "decode_rows")
    c = strided_rows_case(block, scale_dtype, block + rows + offset, rows)
    chunk, a, b, cb = c["chunk"], c["a"], c["b"], c["code_bytes"]
    blocks = (b - a) // block
    total = (rows - 1) * chunk + (b - a) - 5
    res = []
    for k, dev in ((cpu, "cpu"), (gpu, "cuda")):
        err = torch.zeros(c["err"].numel() + offset, device=dev)[offset:]
        err.copy_(c["err"].to(dev))
        counts = c["counts"].to(dev).view(rows, chunk // block)[:, a // block:b // block]
        messages = torch.full((rows, c["width"]), 7, dtype=torch.uint8, device=dev)
        k.compress_rows(c["buf"].to(dev)[a:], err.view(rows, chunk)[:, a:b], counts, block,
                        messages[:, cb:cb + blocks * scale_dtype.itemsize], messages[:, :cb])
        scales = messages[:, cb:cb + blocks * scale_dtype.itemsize].clone(
            memory_format=torch.contiguous_format).view(scale_dtype).float()
        out = torch.full((total + offset,), 3.0, device=dev)[offset:]
        k.decode_rows(messages, scales, block, b - a, out, chunk)
        res.append([t.cpu() for t in (err, messages, out)])
    for name, x, y in zip(("errors", "messages", "decoded values"), *res):
        assert torch.equal(x, y), f"the CUDA kernel's {name} differ from the CPU kernel's"


# ------------------------------------------------ the one-launch check --
def _elementwise_rule(tensors) -> int:
    """numpy's verdict: 1 where some element's fp32 square is not finite."""
    with np.errstate(over="ignore", invalid="ignore"):
        return int(any(not np.all(np.isfinite(np.square(t.cpu().numpy().astype(np.float32))))
                       for t in tensors))


def _check_tensors():
    """3000 small tensors of sizes 1..300 (most not a multiple of 4), one
    spanning four chunks of the kernel's split and a tail, and a view one
    element into a buffer (not 16-byte aligned)."""
    from onebit.builders.native import TABLE_CHUNK

    g = torch.Generator().manual_seed(0)
    sizes = torch.randint(1, 301, (3000,), generator=g).tolist()
    small = [torch.randn(n, generator=g) for n in sizes]
    big = torch.randn(4 * TABLE_CHUNK + 5, generator=g)
    shifted = torch.randn(2 * TABLE_CHUNK + 3, generator=g)
    return [t.cuda() for t in small[:1500] + [big] + small[1500:]] + [shifted.cuda()[1:]]


# (tensor index, element) where a bad value goes: the first element, each
# side of a chunk boundary in the big tensor, its last, a small tensor in
# the middle, the last tensor's first and last element (unaligned).
PLACES = [(0, 0), (1500, 8191), (1500, 8192), (1500, -1), (2222, -1), (-1, 0), (-1, -1)]


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), 2e19, -1e30,
                                   1.8e19, -1.8e19, 1e6])
def test_cuda_one_launch_nonfinite_check_follows_the_elementwise_rule(value):
    import onebit.ops as ops
    from onebit.agreement import nonfinite_flag

    kernels = ops.kernels_for(torch.device("cuda"))
    assert kernels.name == "cuda" and hasattr(kernels, "any_nonfinite")
    clean = _check_tensors()
    flag = torch.zeros((), dtype=torch.int64, device="cuda")
    kernels.any_nonfinite(clean, [t.numel() for t in clean], flag)
    assert int(flag) == _elementwise_rule(clean) == 0
    expected = 1 if abs(value) > 1.8446744e19 or value != value else 0  # sqrt(FLT_MAX)
    for i, j in PLACES:
        tensors = _check_tensors()
        tensors[i][j] = value
        flag.zero_()
        kernels.any_nonfinite(tensors, [t.numel() for t in tensors], flag)
        assert int(flag) == _elementwise_rule(tensors) == expected, (i, j)
        # The optimizer's flag takes the kernel, empty tensors and groups too.
        groups = [tensors[:100], [torch.empty(0, device="cuda")], tensors[100:]]
        assert int(nonfinite_flag(groups, torch.device("cuda"))) == expected, (i, j)
        assert int(nonfinite_flag(groups, torch.device("cpu"))) == expected, (i, j)
        # The same tensors again (the table kept from the last call), mended.
        tensors[i][j] = 0.5
        assert int(nonfinite_flag(groups, torch.device("cuda"))) == 0, (i, j)


@needs_cuda
@pytest.mark.gpu
def test_cuda_nonfinite_flag_takes_the_norms_for_a_tensor_that_is_not_contiguous():
    from onebit.agreement import nonfinite_flag
    from onebit.multi_tensor import list_kernel

    cuda = torch.device("cuda")
    plain = [torch.randn(5, device=cuda), torch.randn(3, 4, device=cuda)]
    crossed = torch.randn(4, 6, device=cuda).t()  # a transposed view
    assert list_kernel("any_nonfinite", plain) is not None
    assert list_kernel("any_nonfinite", plain + [crossed]) is None
    assert int(nonfinite_flag([plain + [crossed]], cuda)) == 0
    crossed[2, 1] = float("nan")
    assert int(nonfinite_flag([plain + [crossed]], cuda)) == 1


# ----------------------------------------------------- the list norms --
def _float64_norms(tensors):
    """numpy's norms in float64, rounded once to fp32: what a float64 sum
    must round to (its order differs from numpy's by far less than an fp32
    ulp)."""
    return np.array([np.sqrt(np.sum(np.square(t.cpu().numpy().astype(np.float64))))
                     for t in tensors]).astype(np.float32)


@needs_cuda
@pytest.mark.gpu
def test_cuda_list_norms_are_float64_norms_rounded_once_and_the_same_bits_every_call():
    import onebit.ops as ops
    from onebit.multi_tensor import tensor_norms

    kernels = ops.kernels_for(torch.device("cuda"))
    assert hasattr(kernels, "tensor_norms")
    tensors = _check_tensors()
    tensors[40].mul_(1e-30)  # scales far apart, and one whose fp32 squares overflow
    tensors[1500][8192] = 2e19
    empty = torch.empty(0, device="cuda")
    tensors = [empty] + tensors[:7] + [empty, empty] + tensors[7:] + [empty]
    got = tensor_norms(tensors)
    assert got.dtype == torch.float32 and got.shape == (len(tensors),)
    want = _float64_norms(tensors)
    close = np.isclose(got.cpu().numpy(), want, rtol=2.0 ** -23, atol=0)  # one ulp at most
    assert close.all(), np.flatnonzero(~close)[:10]
    assert got[0] == 0 and got[-1] == 0 and np.isfinite(want).all()
    again = tensor_norms(tensors)  # the kept table
    # A new table at other addresses (the unaligned view kept: alignment
    # picks the kernel's loads, and with them its order of sums).
    moved = tensor_norms([t.clone() for t in tensors[:-2]] + tensors[-2:])
    assert torch.equal(got, again) and torch.equal(got, moved)
    # Five other lists push the first table out; it is rebuilt right.
    for k in range(5):
        tensor_norms(tensors[k:])
    assert torch.equal(tensor_norms(tensors), got)


@needs_cuda
@pytest.mark.gpu
def test_cuda_list_norms_take_foreach_norm_for_other_layouts_and_dtypes():
    from onebit.multi_tensor import tensor_norms

    g = torch.Generator(device="cuda").manual_seed(1)
    crossed = torch.randn(40, 60, device="cuda", generator=g).t()
    half = torch.randn(500, device="cuda", generator=g).bfloat16()
    for tensors in ([torch.randn(7, device="cuda"), crossed], [half, half * 2]):
        assert torch.equal(tensor_norms(tensors), torch.stack(torch._foreach_norm(tensors)))


def _random_lists(seed, scales, positive=()):
    """Lists of _check_tensors' sizes and an empty tensor, one per scale:
    randn x scale, or |randn| x scale + 1e-4 at the positions in `positive`
    (denominators)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    shapes = [t.numel() for t in _check_tensors()] + [0]
    out = []
    for k, scale in enumerate(scales):
        ts = [torch.randn(n, device="cuda", generator=g) * scale for n in shapes]
        out.append([t.abs() + 1e-4 for t in ts] if k in positive else ts)
    return out


def _lamb_lists(seed):
    """p, m, s, d like 1-bit LAMB's after an exchange: scales far apart, d > 0."""
    return _random_lists(seed, (1.0, 1e-3, 1e-3, 1e-2), positive=(3,))


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("weight,weight_decay", [(0.2, 0.0), (0.2, 0.01), (0.7, 0.1)])
def test_cuda_lamb_ratio_pass_is_torchs_lerp_and_float64_norms(weight, weight_decay):
    from onebit.multi_tensor import lamb_ratio_norms

    p, m, s, d = _lamb_lists(0)
    before = [t.clone() for t in s]
    want_s = [t.clone() for t in s]
    torch._foreach_lerp_(want_s, m, weight)
    got = lamb_ratio_norms(p, m, s, d, weight, weight_decay)
    assert got is not None and got.shape == (2 * len(p),)
    for a, b, x, e in zip(s, want_s, before, m):
        # torch's lerp, up to its multiply-add's rounding (an ulp of the terms)
        bound = 2.0 ** -23 * (b.abs() + x.abs() + e.abs())
        assert ((a - b).abs() <= bound).all()
    p64 = [t.double() for t in p]
    u32 = [torch.addcmul(t / q, torch.full_like(t, weight_decay), r) if weight_decay else t / q
           for t, q, r in zip(s, d, p)]  # u in fp32, from the pass's own s
    want = np.array([float(t.norm()) for t in p64] + [float(t.double().norm()) for t in u32],
                    dtype=np.float64)
    close = np.isclose(got.cpu().numpy(), want, rtol=1e-6, atol=0)
    assert close.all(), np.flatnonzero(~close)[:10]
    assert got[len(p) - 1] == 0 and got[-1] == 0  # the empty tensor


@needs_cuda
@pytest.mark.gpu
def test_cuda_lamb_fresh_step_with_the_pass_follows_torchs_ops(monkeypatch):
    import onebit.multi_tensor as multi_tensor
    from onebit.optim.lamb import onebit_lamb_fresh_step_

    def run():
        p, m, s, d = _lamb_lists(1)
        coeffs = []
        for _ in range(3):
            coeffs.append(onebit_lamb_fresh_step_(
                p, m, d, s, scratch=lambda like: [torch.empty_like(t) for t in like],
                whole_norms=None, trust_ratio_beta=0.8, lr=1e-2, weight_decay=0.01, bc1=0.5,
                min_coeff=0.01, max_coeff=10.0))
        return p, coeffs

    start = _lamb_lists(1)[0]
    fused_p, fused_c = run()
    monkeypatch.setattr(multi_tensor, "list_kernel", lambda *a: None)
    plain_p, plain_c = run()
    assert np.allclose(fused_c, plain_c, rtol=1e-5, atol=0)
    assert any(c != 1.0 for row in fused_c for c in row)
    # The coefficients differ in their last digits (norms summed in float64
    # against torch's fp32), so the params do by as much of their movement.
    for a, b, p0 in zip(fused_p, plain_p, start):
        moved = float((b - p0).abs().max()) if p0.numel() else 0.0
        assert torch.allclose(a, b, rtol=0, atol=1e-5 * moved + 1e-12)


def _ulps_apart(a, b, *terms, ulps=2):
    """|a - b| within `ulps` fp32 ulps of the largest term (a multiply-add
    fused or not moves a result by about one)."""
    scale = torch.stack([t.abs() for t in (a, b, *terms)]).amax(0)
    return bool(((a - b).abs() <= ulps * 2.0 ** -23 * scale).all())


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_cuda_zero_one_local_step_is_torchs_ops_in_one_pass(weight_decay):
    from onebit.multi_tensor import zero_one_local_step
    from onebit.optim import functional as F
    from onebit.optim.zoadam import accumulate_

    a, *rest = _random_lists(2, (1.0, 1e-2, 1e-3, 1e-2, 1e-4), positive=(3,))
    lists = [[t.clone() for t in a], *rest, a]  # p starts at the anchor
    theirs = [[t.clone() for t in ts] for ts in lists]
    kw = dict(lr=1e-3, weight_decay=weight_decay, bc1=0.7)
    before = [[t.clone() for t in ts] for ts in lists]
    assert zero_one_local_step(*lists, beta1=0.9, **kw)
    p, gr, m, d, u, anchors = theirs
    F.update_momentum_(m, gr, 0.9)
    accumulate_(p, m, d, u, anchors, sync=False, **kw)
    # Each result within two ulps of the largest term that made it.
    steps = [mi / di * (1e-3 / 0.7) + 1e-3 * weight_decay * pi.abs()
             for mi, di, pi in zip(m, d, before[0])]
    terms = {"momentum": (2, [before[2], before[1]]), "accumulator": (4, [before[4], steps]),
             "param": (0, [anchors, u])}
    for name, (k, inputs) in terms.items():
        for mine, want, *xs in zip(lists[k], theirs[k], *inputs):
            assert _ulps_apart(mine, want, *xs), name


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("scaler,kernels", [
    (1, ["zero_one_step", "zero_one_local_step"]),
    (10**6, ["zero_one_step", "zero_one_sync_input", "zero_one_land"])])
def test_cuda_zero_one_adam_with_its_kernels_follows_torchs_ops(monkeypatch, scaler, kernels):
    import onebit
    import onebit.multi_tensor as multi_tensor

    def run():
        gen = torch.Generator(device="cuda").manual_seed(3)
        params = [torch.nn.Parameter(torch.randn(n, device="cuda", generator=gen) * s)
                  for n, s in ((1000, 1.0), (37, 1e-3), (70000, 10.0))]
        # local_step_scaler=1: local steps right after the freeze; 10**6:
        # syncs that follow syncs (interval 1) from the freeze on.
        opt = onebit.ZeroOneAdam(params, lr=1e-2, weight_decay=0.01, var_freeze_step=2,
                                 local_step_scaler=scaler, local_step_clipper=4)
        for _ in range(12):
            for p in params:
                p.grad = torch.randn(p.shape, device="cuda", generator=gen)
            opt.step()
        return [p.detach().clone() for p in params]

    used, real = [], multi_tensor.list_kernel

    def spy(name, *lists):
        kernel = real(name, *lists)
        used.append((name, kernel is not None))
        return kernel

    monkeypatch.setattr(multi_tensor, "list_kernel", spy)
    fused, again = run(), run()
    assert all((name, True) in used for name in kernels), used
    assert all(torch.equal(a, b) for a, b in zip(fused, again))  # the same bits every run
    monkeypatch.setattr(multi_tensor, "list_kernel", lambda *a: None)
    plain = run()
    for a, b in zip(fused, plain):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("bc1,weight_decay", [(1.0, 0.0), (0.3, 0.0), (0.3, 0.01)])
def test_cuda_zero_one_step_is_torchs_ops_in_one_pass(bc1, weight_decay):
    from onebit.multi_tensor import zero_one_step
    from onebit.optim import functional as F

    lists = _random_lists(4, (1.0, 1e-2, 1e-3, 1e-2), positive=(3,))
    theirs = [[t.clone() for t in ts] for ts in lists]
    assert zero_one_step(*lists, beta1=0.9, lr=1e-3, weight_decay=weight_decay, bc1=bc1)
    p, gr, m, d = theirs
    F.update_momentum_(m, gr, 0.9)
    upd = F.adam_updates(m, d, p, weight_decay, bc1)
    torch._foreach_mul_(upd, -1e-3)
    F.add_updates_(p, upd)
    for name, k in (("momentum", 2), ("param", 0)):
        for mine, want, x in zip(lists[k], theirs[k], upd if k == 0 else lists[1]):
            assert _ulps_apart(mine, want, x, ulps=4), name


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("into_momentum", [True, False])
def test_cuda_zero_one_sync_kernels_are_torchs_ops(weight_decay, into_momentum):
    from onebit.multi_tensor import zero_one_land, zero_one_sync_input
    from onebit.optim import functional as F
    from onebit.optim.zoadam import direction_into

    p, m, gr, d = _random_lists(5, (1.0, 1e-3, 1e-2, 1e-2), positive=(3,))
    seen, masks = [True] * len(p), [None] * len(p)
    # The input (into m itself, as at world size 1, or into a buffer).
    mine_m, their_m = [t.clone() for t in m], [t.clone() for t in m]
    mine_out = mine_m if into_momentum else [torch.empty_like(t) for t in m]
    their_out = their_m if into_momentum else [torch.empty_like(t) for t in m]
    assert zero_one_sync_input(mine_out, p, mine_m, gr, d, beta1=0.9, bc1=0.6,
                               weight_decay=weight_decay)
    F.momentum_into(their_out, their_m, gr, 0.9)
    direction_into(p, their_out, d, 0.6, seen, masks, their_out, weight_decay=weight_decay)
    for mine, want, mi, gi, pi, di in zip(mine_out, their_out, m, gr, p, d):
        assert _ulps_apart(mine, want, mi / 0.6, gi / 0.6, weight_decay * pi * di, ulps=4)
    if not into_momentum:  # m itself untouched
        assert all(torch.equal(a, b) for a, b in zip(mine_m, m))
    # The landing on that average.
    mine_p, their_p = [t.clone() for t in p], [t.clone() for t in p]
    avg_mine, avg_theirs = [t.clone() for t in their_out], [t.clone() for t in their_out]
    assert zero_one_land(mine_p, avg_mine, d, lr=1e-2, bc1=0.6)
    torch._foreach_addcdiv_(their_p, avg_theirs, d, value=1e-2)
    torch._foreach_mul_(avg_theirs, -0.6)
    for mine, want, pi, ai, di in zip(mine_p, their_p, p, their_out, d):
        assert _ulps_apart(mine, want, pi, 1e-2 * ai / di)
    assert all(torch.equal(a, b) for a, b in zip(avg_mine, avg_theirs))  # one multiply each


@needs_cuda
@pytest.mark.gpu
def test_gradients_spread_over_the_gpu_and_the_host_get_one_verdict_per_device():
    """A model with some params left on the host: the check takes each
    device's gradients on their own (the kernel for the GPU's, torch's
    norms for the host's) and the list kernels refuse the mixed list."""
    from onebit.agreement import nonfinite_flag
    from onebit.multi_tensor import list_kernel

    cuda = torch.device("cuda")
    on_gpu = [torch.randn(5, device=cuda), torch.randn(300, device=cuda)]
    on_host = [torch.randn(7), torch.randn(2, 3)]
    assert list_kernel("any_nonfinite", on_gpu) is not None
    assert list_kernel("any_nonfinite", on_gpu + on_host) is None
    assert list_kernel("any_nonfinite", on_gpu, on_host[:1] + on_gpu[1:]) is None
    for where in (cuda, torch.device("cpu")):
        assert int(nonfinite_flag([on_gpu, on_host], where)) == 0
        on_host[1][1, 2] = float("inf")
        assert int(nonfinite_flag([on_gpu + on_host], where)) == 1
        on_host[1][1, 2] = 0.5
        on_gpu[1][299] = float("nan")
        assert int(nonfinite_flag([on_host, on_gpu], where)) == 1
        on_gpu[1][299] = 0.5
