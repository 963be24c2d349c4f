"""CompressedBackend on real gloo processes, checked against the independent
float64 reference in reference.py."""
import numpy as np
import pytest
import torch

from tests.allreduce_checks import SIZES, check_fused_rounds, check_rounds, make_inputs
from tests.distributed import run_workers
from tests.reference import reference_round

def _gloo_rounds(rank, p):
    import torch.distributed as dist

    from onebit.backends import CompressedBackend, get_backend

    backend = get_backend("compressed")
    assert isinstance(backend, CompressedBackend) and backend.rank == rank

    def gather(t):
        out = [torch.empty_like(t) for _ in range(p)]
        dist.all_gather(out, t.contiguous())
        return out

    for numel in SIZES:
        check_rounds(backend, rank, p, numel, gather)
    check_fused_rounds(backend, rank, p, gather)
    return True


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_matches_reference_and_is_identical_on_every_rank(p):
    assert run_workers(_gloo_rounds, p, timeout=240) == [True] * p


def _all_gather(p):
    import torch.distributed as dist

    def gather(t):
        out = [torch.empty_like(t) for _ in range(p)]
        dist.all_gather(out, t.contiguous())
        return out
    return gather


def _pipelined_rounds(rank, p):
    from onebit.backends import CompressedBackend

    # Pieces of uneven unit counts (1000 is no multiple of B*p), down to one
    # unit each for the smallest buffers.
    backend = CompressedBackend(piece_size=1000)
    for numel in (5, 77777, 1000003):
        check_rounds(backend, rank, p, numel, _all_gather(p))
    check_fused_rounds(backend, rank, p, _all_gather(p))
    return True


@pytest.mark.slow
@pytest.mark.parametrize("p", [2, 3])
def test_pipelined_pieces_match_reference(p):
    assert run_workers(_pipelined_rounds, p, timeout=240) == [True] * p


def _pieces_change_no_bit(rank, p):
    """The same rounds through one piece, through many, and with the piece
    count tuned on the fly (switching between calls): the same output and
    error bits. The tuner ends with one choice on every rank."""
    from onebit.backends import CompressedBackend, pipeline

    pipeline.PIECE_SIZE = 4096  # so the tuner has two schedules for this small buffer
    gather = _all_gather(p)
    runs = {}
    for piece in (0, 768, 5000, 1 << 14, None):
        b = CompressedBackend(piece_size=piece, block_size=64)
        layout = b.layout([3000, 7, 40000, 129])
        if piece in (768, 5000):
            assert b.pipeline.count(layout.key, layout.padded, p) > 1
        werr, serr = torch.zeros(layout.padded), torch.zeros(layout.padded // p)
        outs = []
        for r in range(12):  # the tuner decides after 2 + 2 * TRIALS calls
            flat = make_inputs(rank, layout.numel, r)
            b.compressed_allreduce(flat, werr, serr, layout=layout)
            outs.append(flat)
        runs[piece] = (torch.stack(outs), werr, serr)
        if piece is None:
            chosen = b.pipeline.chosen[layout.key]
            assert [int(c) for c in gather(torch.tensor([chosen]))] == [chosen] * p
    first = runs[0]
    for piece, run in runs.items():
        for name, a, b in zip(("output", "worker error", "server error"), first, run):
            assert torch.equal(a, b), f"piece_size={piece} changed the {name}"
    assert first[2].abs().sum() > 0
    return True


@pytest.mark.slow
@pytest.mark.parametrize("p", [2, 3, 4])
def test_pipelining_changes_no_bit(p):
    assert run_workers(_pieces_change_no_bit, p, timeout=180) == [True] * p


def _scaled_tensors(rank, p):
    """A tensor scaled by a power of two comes back scaled by exactly it,
    with its errors: every tensor starts on its own blocks and signs,
    scales and errors are linear in it. (Why 1-bit LAMB need not bring
    its momenta to one RMS before the exchange, as the paper does.)"""
    from onebit.backends import CompressedBackend

    b = CompressedBackend(block_size=64)
    sizes, factors = [3000, 7, 40000, 129], [2.0 ** -7, 4.0, 1.0, 2.0 ** 11]
    layout = b.layout(sizes)
    shapes = [torch.Size([n]) for n in sizes]
    scale = torch.ones(layout.padded)  # each element's factor, pads included (1)
    for v, c in zip(layout.views(scale[:layout.numel], shapes), factors):
        v.fill_(c)
    runs = []
    for scaled in (False, True):
        werr, serr = torch.zeros(layout.padded), torch.zeros(layout.padded // p)
        for r in range(5):
            flat = make_inputs(rank, layout.numel, r)
            if scaled:
                flat.mul_(scale[:layout.numel])
            b.compressed_allreduce(flat, werr, serr, layout=layout)
        runs.append((flat, werr, serr))
    (out, werr, serr), (out_s, werr_s, serr_s) = runs
    chunk = layout.padded // p
    assert torch.equal(out_s, out * scale[:layout.numel])
    assert torch.equal(werr_s, werr * scale)
    assert torch.equal(serr_s, serr * scale[rank * chunk:(rank + 1) * chunk])
    assert werr.abs().sum() > 0 and serr.abs().sum() > 0
    return True


@pytest.mark.parametrize("p", [2, 3])
def test_a_tensor_scaled_by_a_power_of_two_comes_back_scaled_exactly(p):
    assert run_workers(_scaled_tensors, p, timeout=120) == [True] * p


def _bf16_scales(rank, p):
    import torch.distributed as dist

    from onebit.backends import CompressedBackend

    def gather(t):
        out = [torch.empty_like(t) for _ in range(p)]
        dist.all_gather(out, t.contiguous())
        return out

    def to_bf16(s):  # what the wire does to a scale
        return torch.from_numpy(s).to(torch.bfloat16).double().numpy()

    for block in (64, 128):
        b = CompressedBackend(block_size=block, scale_dtype=torch.bfloat16)
        check_fused_rounds(b, rank, p, gather, round_scale=to_bf16)
    return True


@pytest.mark.parametrize("p", [2, 3])
def test_bf16_scales_and_other_block_sizes_match_reference(p):
    assert run_workers(_bf16_scales, p, timeout=120) == [True] * p


def _dtypes_and_shapes(rank, p):
    from onebit.backends import CompressedBackend

    b = CompressedBackend()
    results = {}
    base = make_inputs(rank, 6 * 50, 0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        n, ns = b.error_sizes(base.numel())
        w, s = torch.zeros(n), torch.zeros(ns)
        x = base.to(dtype, copy=True).view(6, 50).t()  # non-contiguous 2-D view
        out = b.compressed_allreduce(x, w, s)
        assert out is x and out.dtype == dtype and out.shape == (50, 6)
        results[str(dtype)] = out.float().contiguous()
    # The fp32 result of a non-contiguous input equals that of its contiguous copy
    # (same logical order, so the same flattened vector).
    w, s = torch.zeros(n), torch.zeros(ns)
    y = base.view(6, 50).t().contiguous()
    b.compressed_allreduce(y, w, s)
    assert torch.equal(results["torch.float32"], y)
    return {k: v.tolist() for k, v in results.items()}


def test_low_precision_and_non_contiguous_buffers():
    outs = run_workers(_dtypes_and_shapes, 3, timeout=120)
    assert all(o == outs[0] for o in outs)


def _bad_inputs(rank, p):
    from onebit.backends import CompressedBackend

    b = CompressedBackend()
    m = torch.randn(100)
    n, ns = b.error_sizes(100)
    good_w, good_s = torch.zeros(n), torch.zeros(ns)
    cases = [
        ("worker_error has", (m, torch.zeros(n - 8 * p), good_s)),
        ("worker_error has", (m, torch.zeros(n + 1), good_s)),
        ("server_error has", (m, good_w, torch.zeros(ns + 1))),
        ("worker_error must be float32", (m, torch.zeros(n, dtype=torch.float64), good_s)),
        ("server_error must be float32", (m, good_w, torch.zeros(ns, dtype=torch.float16))),
        ("buffer_m must be a floating", (torch.arange(100), good_w, good_s)),
        ("worker_error is on meta", (m, torch.zeros(n, device="meta"), good_s)),
        ("contiguous", (m, torch.zeros(2 * n)[::2], good_s)),
    ]
    for match, args in cases:
        before = [a.clone() if a.device.type != "meta" else a for a in args]
        with pytest.raises(ValueError, match=match):
            b.compressed_allreduce(*args)
        for a, a0 in zip(args, before):
            assert a.device.type == "meta" or torch.equal(a, a0), "a rejected call changed its input"
    # NaN / Inf: rejected on the rank that has it, before any communication.
    for bad in (float("nan"), float("inf"), float("-inf")):
        x = m.clone()
        x[17] = bad
        w0 = torch.randn(n)
        w = w0.clone()
        with pytest.raises(ValueError, match="NaN or Inf"):
            b.compressed_allreduce(x, w, good_s)
        assert torch.equal(w, w0)
    # Empty buffer: errors zeroed, nothing sent.
    e = torch.empty(0)
    w, s = torch.ones(b.block_size * p), torch.ones(b.block_size)
    assert b.compressed_allreduce(e, w, s) is e and not w.any() and not s.any()
    # The backend still works after all that.
    out = b.compressed_allreduce(m.clone(), good_w, good_s)
    return out.tolist()


def test_bad_inputs_raise_before_communicating_and_change_nothing():
    outs = run_workers(_bad_inputs, 2, timeout=120)
    assert outs[0] == outs[1]


def _disagree(rank, p):
    from onebit.backends import CompressedBackend

    b = CompressedBackend()
    numel = 100 if rank == 0 else 1000  # rank 1 has a different N
    n, ns = b.error_sizes(numel)
    with pytest.raises(ValueError, match="ranks disagree on the compressed buffer"):
        b.compressed_allreduce(torch.randn(numel), torch.zeros(n), torch.zeros(ns))
    return True


def test_ranks_that_disagree_on_size_fail_on_every_rank_without_hanging():
    assert run_workers(_disagree, 3, timeout=60) == [True] * 3


def _disagree_later(rank, p, how, backend_kind):
    """Ranks that agreed on their first calls, then disagree: on a layout
    both had used (each rank's cache said 'agreed'), on an empty buffer on
    one rank, or on the piece size."""
    from onebit.backends import CompressedBackend
    from onebit.backends.hierarchical import torch_hierarchical

    def make(piece_size=None):
        if backend_kind == "hierarchical":
            return torch_hierarchical(node_of_rank=[0, 0, 1, 1][:p] if p == 4 else [0] * p,
                                      timeout_s=20, piece_size=piece_size)
        return CompressedBackend(timeout_s=20, piece_size=piece_size)

    def call(b, numel):
        n, ns = b.error_sizes(numel)
        b.compressed_allreduce(torch.randn(numel), torch.zeros(n), torch.zeros(ns))

    b = make(None if how != "piece size" else (0 if rank == 0 else 256))
    if how != "piece size":
        call(b, 100)
        call(b, 1000)  # both layouts agreed on every rank
    numel = {"a layout each had agreed": 100 if rank == 0 else 1000,
             "empty on one rank": 0 if rank == 0 else 1000, "piece size": 4096}[how]
    with pytest.raises(ValueError, match="ranks disagree on the compressed buffer") as err:
        call(b, numel)
    return str(err.value)


@pytest.mark.parametrize("backend_kind", ["compressed", "hierarchical"])
@pytest.mark.parametrize("how", ["a layout each had agreed", "empty on one rank", "piece size"])
def test_ranks_that_disagree_after_agreed_calls_fail_on_every_rank(how, backend_kind):
    """The layout was checked on its first call only, and each rank decided
    from its own cache: ranks that moved to layouts they had each used
    before ran mismatched collectives (gloo blamed a dead peer, MPI hung); a
    rank with an empty buffer returned at once and left its peers waiting;
    the piece size was not compared at all (gloo aborted the process). A
    direct call now agrees every time, before any data moves."""
    out = run_workers(_disagree_later, 4, how, backend_kind, timeout=120)
    assert len(out) == 4, out
    if how == "piece size" and backend_kind == "compressed":
        assert all("piece size=auto" not in m and "piece size=256" in m for m in out), out


def _buffers_reused(rank, p):
    from onebit.backends import CompressedBackend

    b = CompressedBackend()
    n, ns = b.error_sizes(5000)
    w, s = torch.zeros(n), torch.zeros(ns)
    b.compressed_allreduce(torch.randn(5000), w, s)
    (key,) = b._buffers
    first = {k: id(v) for k, v in vars(b._buffers[key]).items()}
    b.compressed_allreduce(torch.randn(5000), w, s)
    assert {k: id(v) for k, v in vars(b._buffers[key]).items()} == first
    assert len(b._buffers) == 1
    return True


def test_scratch_buffers_are_allocated_once_per_size():
    assert run_workers(_buffers_reused, 2, timeout=60) == [True, True]


def _launches_per_phase(rank, p):
    from onebit import ops
    from onebit.backends import compressed

    kernels = ops.kernels_for(torch.device("cpu"))
    calls = {}
    for name in ("compress", "compress_rows", "decode", "decode_rows"):
        def counted(*args, _name=name, _run=getattr(kernels, name)):
            calls[_name] = calls.get(_name, 0) + 1
            return _run(*args)
        setattr(kernels, name, counted)
    out = {}
    for pieces in (1, 3):
        # piece_size counts the whole buffer's elements: 27 blocks per chunk, 9 per piece.
        b = compressed.CompressedBackend(block_size=64,
                                         piece_size=0 if pieces == 1 else 64 * 9 * p)
        numel = 64 * 27 * p - 100  # the last chunk short of its rows
        n, ns = b.error_sizes(numel)
        calls.clear()
        b.compressed_allreduce(torch.randn(numel, generator=torch.Generator().manual_seed(rank)),
                               torch.zeros(n), torch.zeros(ns))
        out[pieces] = dict(calls)
    for name in ("compress", "compress_rows", "decode", "decode_rows"):
        delattr(kernels, name)
    return out


@pytest.mark.parametrize("p", [3, 4])
def test_each_phase_is_one_kernel_call_per_piece_at_any_world_size(p):
    """The worker compresses every rank's row in one kernel call, the server
    decodes the p rows it received in one and compresses its chunk in one,
    and the final decode writes every chunk in one: four calls per piece,
    not 2p + 2 (issue 44: one launch per phase)."""
    for counts in run_workers(_launches_per_phase, p, timeout=60):
        for pieces in (1, 3):
            assert counts[pieces] == {"compress_rows": pieces, "compress": pieces,
                                      "decode": pieces, "decode_rows": pieces}, counts


def _alone(rank, p):
    import torch.distributed as dist

    from onebit import collectives
    from onebit.backends import compressed

    def forbidden(*a, **k):
        raise AssertionError("a collective was issued at world size 1")

    dist.all_to_all_single = collectives.all_gather_flat = forbidden
    # Small blocks too: a message of 8 elements has one byte of signs, so
    # its scales start at an odd byte (their 4-byte view once failed there).
    for block, numel in ((256, 77), (8, 8), (8, 77), (24, 77)):
        b = compressed.CompressedBackend(block_size=block)
        m = torch.randn(numel)
        n, ns = b.error_sizes(numel)
        w, s = torch.zeros(n), torch.zeros(ns)
        (ref_out,), ref_w, ref_s, _ = reference_round([[m.double().numpy()]], [np.zeros(n)],
                                                      [np.zeros(ns)], b.block_size)
        out = b.compressed_allreduce(m.clone(), w, s)
        np.testing.assert_allclose(out.double().numpy(), ref_out, atol=1e-5)
        np.testing.assert_allclose(w.double().numpy(), ref_w[0], atol=1e-5)
    return True


def test_world_size_one_issues_no_collective():
    """At p = 1 the maths still runs -- worker and server compression, both
    with error feedback -- but nothing is sent."""
    assert run_workers(_alone, 1, timeout=60) == [True]


def test_get_backend_registry(monkeypatch):
    import types

    import onebit.backends
    from onebit.backends import get_backend, register_backend
    from onebit.backends.contract import MEMBERS

    with pytest.raises(ValueError, match=r"known: \['compressed', 'hierarchical', 'mpi', 'mpi_hierarchical'\]"):
        get_backend("nccl-magic")
    monkeypatch.setattr(onebit.backends, "_FACTORIES", dict(onebit.backends._FACTORIES))
    made, vendor = [], types.SimpleNamespace(**dict.fromkeys(MEMBERS))  # meets the contract
    register_backend("vendor", lambda group=None, **kw: made.append(kw) or vendor)
    assert get_backend("Vendor", flavour=1) is vendor and made == [{"flavour": 1}]
