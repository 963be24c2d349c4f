"""The checks every compressed backend must pass, shared by the gloo tests
and the mpirun tests: `gather` is the only thing a transport supplies."""
import numpy as np
import torch

from reference import reference_round

SIZES = [1, 5, 77777, 1000003]
ROUNDS = 5


def make_inputs(rank, numel, round_):
    g = torch.Generator().manual_seed(1000 * round_ + rank)
    # Different magnitudes per rank, so averaging is not trivially symmetric.
    return torch.randn(numel, generator=g) * (1.0 + rank)


def check_rounds(backend, rank, p, numel, gather):
    """Run ROUNDS compressed allreduces and compare each with the reference.

    gather(t) -> list of every rank's copy of tensor t. The reference starts
    each round from the backend's own error buffers (lockstep), so a tiny fp32
    difference in one round cannot snowball into a different trajectory.
    """
    n, n_server = backend.error_sizes(numel)
    assert n % (8 * p) == 0 and n >= numel and n_server * p == n
    werr, serr = torch.zeros(n), torch.zeros(n_server)
    for r in range(ROUNDS):
        m = make_inputs(rank, numel, r)
        bufs = [b.double().numpy() for b in gather(m)]
        werrs = [w.double().numpy() for w in gather(werr)]
        serrs = [s.double().numpy() for s in gather(serr)]
        out = backend.compressed_allreduce(m, werr, serr)
        assert out is m and out.dtype == torch.float32 and out.shape == (numel,)
        ref_out, ref_w, ref_s, c = reference_round(bufs, werrs, serrs)
        scale = np.abs(ref_out).max()
        chunk = n_server
        coin = np.abs(c[rank * chunk:(rank + 1) * chunk]) <= 1e-5 * scale
        keep = np.abs(c[:numel]) > 1e-5 * scale
        assert keep.mean() > 0.99
        np.testing.assert_allclose(out.double().numpy()[keep], ref_out[keep], rtol=0,
                                   atol=1e-3 * scale)
        np.testing.assert_allclose(werr.double().numpy(), ref_w[rank], rtol=0, atol=1e-3 * scale)
        np.testing.assert_allclose(serr.double().numpy()[~coin], ref_s[rank][~coin], rtol=0,
                                   atol=1e-3 * scale)
        copies = gather(out)
        assert all(torch.equal(copies[0], c_) for c_ in copies), "output differs across ranks"
