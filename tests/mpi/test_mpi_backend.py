"""MpiBackend under mpirun (launched by tests/test_mpirun.py with -n 2, 3, 4).

Every rank runs these tests; a failure on any rank fails mpirun."""
import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI

from allreduce_checks import SIZES, check_fused_rounds, check_rounds, make_inputs

COMM = MPI.COMM_WORLD


def mpi_gather(t):
    return [torch.from_numpy(a) for a in COMM.allgather(t.contiguous().numpy())]


@pytest.fixture(scope="module")
def backend():
    from onebit.backends import MpiBackend, get_backend

    b = get_backend("mpi")
    assert isinstance(b, MpiBackend) and b.size == COMM.Get_size() and b.rank == COMM.Get_rank()
    return b


@pytest.mark.parametrize("numel", SIZES)
def test_mpi_matches_reference_and_is_identical_on_every_rank(backend, numel):
    check_rounds(backend, COMM.Get_rank(), COMM.Get_size(), numel, mpi_gather)


def test_mpi_fused_tensor_aligned_blocks_match_reference(backend):
    check_fused_rounds(backend, COMM.Get_rank(), COMM.Get_size(), mpi_gather)


def test_mpi_pipelined_pieces_match_reference():
    """Ialltoall / Iallgather per piece, several in flight at once."""
    from onebit.backends import MpiBackend

    b = MpiBackend(piece_size=1000)
    for numel in (5, 77777):
        check_rounds(b, COMM.Get_rank(), COMM.Get_size(), numel, mpi_gather)
    check_fused_rounds(b, COMM.Get_rank(), COMM.Get_size(), mpi_gather)


def test_mpi_bad_inputs_raise_and_change_nothing(backend):
    p = backend.size
    m = torch.randn(100)
    n, ns = backend.error_sizes(100)
    w = torch.randn(n)
    w0 = w.clone()
    with pytest.raises(ValueError, match="server_error has"):
        backend.compressed_allreduce(m, w, torch.zeros(ns + 8))
    with pytest.raises(ValueError, match="worker_error has"):
        backend.compressed_allreduce(m, torch.zeros(n + 8 * p + 1), torch.zeros(ns))
    m[3] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        backend.compressed_allreduce(m, w, torch.zeros(ns))
    assert torch.equal(w, w0)


def test_mpi_ranks_that_disagree_on_size_all_fail(backend):
    rank = COMM.Get_rank()
    numel = 64 * 7 if rank == 0 else 64 * 9 + 1
    n, ns = backend.error_sizes(numel)
    with pytest.raises(ValueError, match="ranks disagree"):
        backend.compressed_allreduce(torch.randn(numel), torch.zeros(n), torch.zeros(ns))


@pytest.fixture(scope="module")
def gloo():
    """A gloo group over the same ranks, for the cross-check."""
    from onebit.launch import init_distributed

    init_distributed(backend="gloo", timeout_s=60)
    yield
    from onebit.launch import shutdown

    shutdown()


@pytest.mark.parametrize("numel", [5, 77777])
def test_gloo_and_mpi_backends_agree_bitwise(backend, gloo, numel):
    from onebit.backends import CompressedBackend

    other = CompressedBackend()
    n, ns = backend.error_sizes(numel)
    states = [(torch.zeros(n), torch.zeros(ns)) for _ in range(2)]
    for r in range(3):
        m = make_inputs(COMM.Get_rank(), numel, r)
        outs = [b.compressed_allreduce(m.clone(), *st) for b, st in zip((backend, other), states)]
        assert torch.equal(outs[0], outs[1])
        assert torch.equal(states[0][0], states[1][0]) and torch.equal(states[0][1], states[1][1])
