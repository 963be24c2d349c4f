"""MpiBackend under mpirun (launched by tests/backends/test_mpirun.py with -n 2, 3, 4).

Every rank runs these tests; a failure on any rank fails mpirun."""
import pytest
import torch
from mpi4py import MPI

from tests.allreduce_checks import SIZES, check_fused_rounds, check_rounds, make_inputs

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


def _layouts(p):
    """Every node map with equal nodes of consecutive ranks: K ranks per node."""
    return [[r // k for r in range(p)] for k in range(1, p + 1) if p % k == 0]


def test_mpi_hierarchical_matches_three_stage_reference():
    from tests.allreduce_checks import check_hierarchical_rounds
    from onebit.backends.hierarchical import mpi_hierarchical

    rank, p = COMM.Get_rank(), COMM.Get_size()
    for node_of_rank in _layouts(p):
        b = mpi_hierarchical(node_of_rank=node_of_rank, block_size=64)
        nodes = [[r for r in range(p) if node_of_rank[r] == n] for n in sorted(set(node_of_rank))]
        assert b.nodes == nodes
        check_hierarchical_rounds(b, rank, p, nodes, mpi_gather)


def test_mpi_hierarchical_default_nodes_are_the_shared_memory_split():
    """mpirun on this one machine: one node of every rank, an exact mean."""
    from onebit.backends import get_backend

    rank, p = COMM.Get_rank(), COMM.Get_size()
    b = get_backend("mpi_hierarchical")
    assert b.nodes == [list(range(p))]
    m = make_inputs(rank, 1000, 0)
    every = torch.stack(mpi_gather(m))
    werr, serr = (torch.zeros(n) for n in b.error_sizes(1000))
    b.compressed_allreduce(m, werr, serr)
    torch.testing.assert_close(m, every.mean(0), rtol=0, atol=1e-6)
    assert not werr.any() and not serr.any()


def test_gloo_and_mpi_hierarchical_agree_bitwise(gloo):
    """Bitwise with up to 2 ranks per node; with 3 or more, the two
    libraries' fp32 reduce-scatters may add in other orders (here that is one
    node: an exact mean, equal to rounding)."""
    from onebit.backends.hierarchical import mpi_hierarchical, torch_hierarchical

    rank, p = COMM.Get_rank(), COMM.Get_size()
    for node_of_rank in _layouts(p):
        pair = (mpi_hierarchical(node_of_rank=node_of_rank),
                torch_hierarchical(node_of_rank=node_of_rank))
        wn, sn = pair[0].error_sizes(77777)
        states = [(torch.zeros(wn), torch.zeros(sn)) for _ in range(2)]
        for r in range(3):
            m = make_inputs(rank, 77777, r)
            outs = [b.compressed_allreduce(m.clone(), *st) for b, st in zip(pair, states)]
            if pair[0].ranks_per_node > 2:
                assert pair[0].node_count == 1
                torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-6)
                continue
            assert torch.equal(outs[0], outs[1])
            assert all(torch.equal(a, b) for a, b in zip(*states))


def _train_over_mpi(overlap):
    import onebit

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Flatten(),
                                torch.nn.Linear(24, 30), torch.nn.ReLU(), torch.nn.Linear(30, 5))
    opt = onebit.OnebitAdam(model.parameters(), lr=1e-2, freeze_step=2, comm_backend_name="mpi",
                            overlap_backward=overlap, bucket_cap_mb=0.002)
    g = torch.Generator().manual_seed(COMM.Get_rank())
    for _ in range(6):
        x, y = torch.randint(0, 50, (4, 3), generator=g), torch.randint(0, 5, (4,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), opt.overlap_stats()


def test_mpi_optimizer_overlapped_with_backward_matches_fused(gloo):
    fused, _ = _train_over_mpi(False)
    overlapped, stats = _train_over_mpi(True)
    assert torch.equal(fused, overlapped)
    assert stats["launched_in_backward"] > 0 and stats["redone"] == 0, stats
    every = mpi_gather(overlapped)
    assert all(torch.equal(e, every[0]) for e in every)


def test_cuda_aware_refuses_an_mpi_without_cuda_support():
    """The [mpi] extra's MPICH is built without CUDA: cuda_aware=True must be
    a clear error at construction, not a segfault at the first exchange."""
    from onebit.backends import MpiBackend
    from onebit.backends.mpi import mpi_cuda_support

    assert not mpi_cuda_support(MPI)
    with pytest.raises(ValueError, match="does not report CUDA support"):
        MpiBackend(cuda_aware=True)
    assert MpiBackend(cuda_aware=False).size == COMM.Get_size()
