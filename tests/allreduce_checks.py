"""The checks every compressed backend must pass, shared by the gloo tests
and the mpirun tests: `gather` is the only thing a transport supplies."""
import numpy as np
import torch

from tests.reference import reference_round

SIZES = [1, 5, 77777, 1000003]
# A fused buffer as an optimizer builds it: tensors of awkward sizes, one of
# them all zero (an unused parameter), one 1e-6 times smaller than the rest.
FUSED = [300, 5, 1000, 64, 2049]
ZERO_TENSOR, TINY_TENSOR = 1, 3
ROUNDS = 5


def make_inputs(rank, numel, round_):
    g = torch.Generator().manual_seed(1000 * round_ + rank)
    # Different magnitudes per rank, so averaging is not trivially symmetric.
    return torch.randn(numel, generator=g) * (1.0 + rank)


def fused_inputs(rank, round_):
    parts = [make_inputs(rank, s, round_ * 10 + j) for j, s in enumerate(FUSED)]
    parts[ZERO_TENSOR].zero_()
    parts[TINY_TENSOR].mul_(1e-6)
    return parts


def _close(actual, expected, keep, scale):
    np.testing.assert_allclose(actual.double().numpy()[keep], expected[keep], rtol=0,
                               atol=1e-3 * scale)


def check_rounds(backend, rank, p, numel, gather):
    """Run ROUNDS compressed allreduces of one buffer and compare each with
    the reference.

    gather(t) -> list of every rank's copy of tensor t. The reference starts
    each round from the backend's own error buffers (lockstep), so a tiny fp32
    difference in one round cannot snowball into a different trajectory.
    """
    block = backend.block_size
    n, n_server = backend.error_sizes(numel)
    assert n % (block * p) == 0 and n >= numel and n_server * p == n
    werr, serr = torch.zeros(n), torch.zeros(n_server)
    for r in range(ROUNDS):
        m = make_inputs(rank, numel, r)
        bufs = [[b.double().numpy()] for b in gather(m)]
        werrs = [w.double().numpy() for w in gather(werr)]
        serrs = [s.double().numpy() for s in gather(serr)]
        out = backend.compressed_allreduce(m, werr, serr)
        assert out is m and out.dtype == torch.float32 and out.shape == (numel,)
        (ref_out,), ref_w, ref_s, c = reference_round(bufs, werrs, serrs, block)
        scale = np.abs(ref_out).max()
        coin = np.abs(c[rank * n_server:(rank + 1) * n_server]) <= 1e-5 * scale
        keep = np.abs(c[:numel]) > 1e-5 * scale
        assert keep.mean() > 0.99
        _close(out, ref_out, keep, scale)
        _close(werr, ref_w[rank], slice(None), scale)
        _close(serr, ref_s[rank], ~coin, scale)
        copies = gather(out)
        assert all(torch.equal(copies[0], c_) for c_ in copies), "output differs across ranks"


def check_fused_rounds(backend, rank, p, gather, round_scale=lambda s: s):
    """A fused buffer of FUSED tensors through `backend.layout`: each tensor
    matches the reference within its own scale (the tiny one included), the
    all-zero tensor comes out exactly zero with exactly zero error, and the
    output is bitwise identical on every rank."""
    block = backend.block_size
    layout = backend.layout(FUSED)
    n, chunk = layout.padded, layout.padded // p
    werr, serr = torch.zeros(n), torch.zeros(chunk)
    zero_lo = layout.offsets[ZERO_TENSOR]
    zero_hi = zero_lo + -(-FUSED[ZERO_TENSOR] // block) * block  # its whole block
    for r in range(ROUNDS):
        parts = fused_inputs(rank, r)
        flat = torch.zeros(layout.numel)
        for view, t in zip(layout.views(flat, [t.shape for t in parts]), parts):
            view.copy_(t)
        every = [gather(t) for t in parts]
        bufs = [[every[j][i].double().numpy() for j in range(len(parts))] for i in range(p)]
        werrs = [w.double().numpy() for w in gather(werr)]
        serrs = [s.double().numpy() for s in gather(serr)]
        backend.compressed_allreduce(flat, werr, serr, layout=layout)
        ref_outs, ref_w, ref_s, c = reference_round(bufs, werrs, serrs, block, round_scale)
        outs = layout.views(flat, [t.shape for t in parts])
        for j, (out, ref) in enumerate(zip(outs, ref_outs)):
            if j == ZERO_TENSOR:
                assert not out.any(), "an all-zero tensor must come back exactly zero"
                continue
            scale = np.abs(ref).max()
            cj = c[layout.offsets[j]:layout.offsets[j] + FUSED[j]]
            keep = np.abs(cj) > 1e-5 * scale
            assert keep.mean() > 0.98
            _close(out, ref, keep, scale)
        # Errors: exactly zero on the zero tensor's block, close elsewhere
        # (bf16 scales make the worker's error follow the rounded scale).
        assert not werr[zero_lo:zero_hi].any()
        mine = slice(rank * chunk, (rank + 1) * chunk)
        lo, hi = max(zero_lo, mine.start), min(zero_hi, mine.stop)
        if lo < hi:
            assert not serr[lo - mine.start:hi - mine.start].any()
        big = np.abs(ref_w[rank]).max()
        _close(werr, ref_w[rank], slice(None), big)
        coin = np.abs(c[mine]) <= 1e-5 * np.abs(c).max()
        _close(serr, ref_s[rank], ~coin, big)
        # Pads (the gaps after each tensor) come back zero.
        mask = torch.ones(layout.numel, dtype=torch.bool)
        for o, s in zip(layout.offsets, FUSED):
            mask[o:o + s] = False
        assert not flat[mask].any()
        copies = gather(flat)
        assert all(torch.equal(copies[0], c_) for c_ in copies), "output differs across ranks"


def check_hierarchical_rounds(backend, rank, p, nodes, gather):
    """ROUNDS hierarchical allreduces of a FUSED buffer against the
    three-stage reference (reference.hierarchical_round), lockstep like
    check_rounds: the all-zero tensor comes back exactly zero, the errors are
    the shard's and match, every rank ends with the same bits."""
    from tests.reference import hierarchical_round

    block = backend.block_size
    layout = backend.layout(FUSED)
    wn, sn = layout.error_sizes
    assert wn == layout.padded // len(nodes[0]) and sn == wn // len(nodes)
    werr, serr = torch.zeros(wn), torch.zeros(sn)
    for r in range(ROUNDS):
        parts = fused_inputs(rank, r)
        flat = torch.zeros(layout.numel)
        for view, t in zip(layout.views(flat, [t.shape for t in parts]), parts):
            view.copy_(t)
        every = [gather(t) for t in parts]
        bufs = [[every[j][i].double().numpy() for j in range(len(parts))] for i in range(p)]
        werrs = [w.double().numpy() for w in gather(werr)]
        serrs = [s.double().numpy() for s in gather(serr)]
        out = backend.compressed_allreduce(flat, werr, serr, layout=layout)
        assert out is flat
        ref_outs, ref_w, ref_s, c = hierarchical_round(bufs, werrs, serrs, block, nodes)
        for j, (o, ref) in enumerate(zip(layout.views(flat, [t.shape for t in parts]), ref_outs)):
            if j == ZERO_TENSOR:
                assert not o.any(), "an all-zero tensor must come back exactly zero"
                continue
            scale = np.abs(ref).max()
            cj = c[layout.offsets[j]:layout.offsets[j] + FUSED[j]]
            keep = np.abs(cj) > 1e-5 * scale
            assert keep.mean() > 0.98
            _close(o, ref, keep, scale)
        big = max(np.abs(ref_w[rank]).max(), 1e-30)
        _close(werr, ref_w[rank], slice(None), big)
        _close(serr, ref_s[rank], slice(None), big)
        copies = gather(flat)
        assert all(torch.equal(copies[0], c_) for c_ in copies), "output differs across ranks"
    return flat, werr, serr
