"""The hierarchical backend (full precision inside a node, 1 bit between
nodes) on real gloo processes, node groups simulated by an explicit layout;
checked against the independent three-stage float64 reference."""
import os

import pytest
import torch

from tests.allreduce_checks import FUSED, check_hierarchical_rounds, fused_inputs
from tests.distributed import run_workers

pytestmark = pytest.mark.slow  # multi-process, up to 6 ranks; the fast tier (-m "not slow") leaves these out


def _gather(p):
    import torch.distributed as dist

    def gather(t):
        out = [torch.empty_like(t) for _ in range(p)]
        dist.all_gather(out, t.contiguous())
        return out
    return gather


def _nodes(node_of_rank):
    nodes = {}
    for r, n in enumerate(node_of_rank):
        nodes.setdefault(n, []).append(r)
    return [nodes[n] for n in sorted(nodes)]


def _rounds(rank, p, node_of_rank, shared_memory):
    from onebit.backends.hierarchical import HierarchicalBackend, torch_hierarchical
    from onebit.backends.node import TorchNode
    from onebit.backends.shm import ShmNode

    b = torch_hierarchical(node_of_rank=node_of_rank, block_size=64, shared_memory=shared_memory)
    assert isinstance(b, HierarchicalBackend) and b.size == p and b.rank == rank
    assert isinstance(b.node, ShmNode if shared_memory else TorchNode)
    nodes = _nodes(node_of_rank)
    assert b.nodes == nodes
    flat, werr, serr = check_hierarchical_rounds(b, rank, p, nodes, _gather(p))
    if len(nodes) > 1:  # the 1-bit stage ran and left its error behind
        assert werr.abs().sum() > 0
    return True


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "gloo"])
@pytest.mark.parametrize("node_of_rank", [
    [0, 0, 1, 1],            # 2 nodes x 2 ranks
    [0, 0, 0, 1, 1, 1],      # 2 x 3
    [0, 1, 0, 1],            # 2 x 2, ranks dealt round-robin (an unusual launcher)
    [0, 0, 0],               # one node: an exact mean
], ids=["2x2", "2x3", "2x2-interleaved", "1x3"])
def test_matches_three_stage_reference(node_of_rank, shared_memory):
    """Inside the node, through shared memory (the default on a host) and
    over the node's gloo group."""
    p = len(node_of_rank)
    assert run_workers(_rounds, p, node_of_rank, shared_memory, timeout=240) == [True] * p


def _shm_full_on_one_rank(rank, p):
    """Rank 1's /dev/shm has room for the 8-float probe but not for the
    buffer (as in a container with a small --shm-size): every rank warns and
    moves to the node's gloo group, and the result is still right."""
    import errno
    import os
    import warnings

    from onebit.backends.hierarchical import torch_hierarchical

    if rank == 1:
        real = os.posix_fallocate

        def full(fd, offset, nbytes):
            if nbytes > 1024:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(fd, offset, nbytes)
        os.posix_fallocate = full
    b = torch_hierarchical(node_of_rank=[0] * p, block_size=64, shared_memory=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_hierarchical_rounds(b, rank, p, _nodes([0] * p), _gather(p))
    said = [str(w.message) for w in caught if "/dev/shm" in str(w.message)]
    assert len(said) == 1 and "over gloo" in said[0], said
    assert b.node._given_up and not b.node._segments
    return True


def test_a_full_dev_shm_on_one_rank_falls_back_to_gloo_on_every_rank():
    assert run_workers(_shm_full_on_one_rank, 3, timeout=120) == [True] * 3


def _one_rank_per_node_is_flat(rank, p):
    """K = 1: the same bits as the flat backend, output and both errors,
    round after round."""
    from onebit.backends import CompressedBackend
    from onebit.backends.hierarchical import torch_hierarchical

    flat, hier = CompressedBackend(block_size=64), torch_hierarchical(node_of_rank=list(range(p)),
                                                                     block_size=64)
    lf, lh = flat.layout(FUSED), hier.layout(FUSED)
    assert lh.error_sizes == lf.error_sizes and lh.numel == lf.numel
    errs = {name: (torch.zeros(lf.padded), torch.zeros(lf.chunk)) for name in ("flat", "hier")}
    for r in range(4):
        outs = {}
        for name, b, lay in (("flat", flat, lf), ("hier", hier, lh)):
            buf = torch.zeros(lf.numel)
            for v, t in zip(lf.views(buf, [t.shape for t in fused_inputs(rank, r)]),
                            fused_inputs(rank, r)):
                v.copy_(t)
            outs[name] = b.compressed_allreduce(buf, *errs[name], layout=lay)
        assert torch.equal(outs["flat"], outs["hier"]), f"round {r}: output differs"
        for a, b_ in zip(errs["flat"], errs["hier"]):
            assert torch.equal(a, b_), f"round {r}: errors differ"
    return True


@pytest.mark.parametrize("p", [2, 3])
def test_one_rank_per_node_equals_flat_bit_for_bit(p):
    assert run_workers(_one_rank_per_node_is_flat, p, timeout=120) == [True] * p


def _node_map_from_env(rank, p):
    import os

    from onebit.backends import get_backend

    os.environ["ONEBIT_RANKS_PER_NODE"] = "2"
    b = get_backend("hierarchical")
    assert b.nodes == [[0, 1], [2, 3]] and b.local_rank == rank % 2
    # torchrun's variables, numbered node by node: the same map.
    del os.environ["ONEBIT_RANKS_PER_NODE"]
    os.environ.update(LOCAL_WORLD_SIZE="2", LOCAL_RANK=str(rank % 2))
    assert get_backend("hierarchical").nodes == [[0, 1], [2, 3]]
    # A launcher that does not number ranks node by node is refused, with the fix named.
    os.environ["LOCAL_RANK"] = str(rank // 2)
    with pytest.raises(ValueError, match="node_of_rank"):
        get_backend("hierarchical")
    os.environ.update(LOCAL_WORLD_SIZE="3", LOCAL_RANK="0")
    with pytest.raises(ValueError, match="do not split into nodes of 3"):
        get_backend("hierarchical")
    return True


def test_node_groups_come_from_the_launcher_or_the_override():
    assert run_workers(_node_map_from_env, 4, timeout=120) == [True] * 4


def _bad_inputs(rank, p):
    from onebit.backends.hierarchical import torch_hierarchical

    b = torch_hierarchical(node_of_rank=[0, 0, 1, 1])
    m = torch.randn(1000)
    wn, sn = b.error_sizes(1000)
    flat_n = b.layout([1000]).padded
    cases = [
        ("worker_error must be a contiguous float32 tensor of", (m, torch.zeros(flat_n), torch.zeros(sn))),
        ("server_error must be", (m, torch.zeros(wn), torch.zeros(sn + 1))),
        ("worker_error must be", (m, torch.zeros(wn, dtype=torch.float64), torch.zeros(sn))),
        ("buffer_m must be a floating", (torch.arange(1000), torch.zeros(wn), torch.zeros(sn))),
    ]
    for match, args in cases:
        before = [a.clone() for a in args]
        with pytest.raises(ValueError, match=match):
            b.compressed_allreduce(*args)
        assert all(torch.equal(a, a0) for a, a0 in zip(args, before))
    x = m.clone()
    x[3] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        b.compressed_allreduce(x, torch.zeros(wn), torch.zeros(sn))
    # Ranks of one node that disagree on the buffer fail on both, without hanging.
    numel = 1000 if rank != 1 else 5000
    wn2, sn2 = b.error_sizes(numel)
    with pytest.raises(ValueError, match="disagree"):
        b.compressed_allreduce(torch.randn(numel), torch.zeros(wn2), torch.zeros(sn2))
    return True


def test_bad_inputs_and_disagreeing_ranks_raise():
    assert run_workers(_bad_inputs, 4, timeout=120) == [True] * 4


# ------------------------------------------------ optimizers on top --
HIER_ENV = {"ONEBIT_RANKS_PER_NODE": "2"}
SWITCH = 36


def _adam_on_hierarchical(rank, world, steps, freeze):
    from tests.optim.test_optim_dist import make, make_params, synthetic_grad

    params = make_params(seed=0)
    opt = make("OnebitAdam", params, freeze_step=freeze, lr=1e-2, comm_backend_name="hierarchical")
    assert opt.backend.name == "hierarchical" and opt.backend.nodes == [[0, 1], [2, 3]]
    for t in range(1, steps + 1):
        for p in params:
            p.grad = synthetic_grad(rank, t, p.shape)
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in params]).double().numpy()


def test_onebit_adam_on_2x2_matches_simulation_with_the_hierarchical_exchange():
    """OnebitAdam, unchanged, on the hierarchical backend: its parameters
    follow a float64 1-bit Adam whose momentum exchange is the three-stage
    reference (test_optim_dist's simulation with the exchange swapped)."""
    import numpy as np

    from tests.reference import hierarchical_round, placement
    from tests.optim.test_optim_dist import BLOCK, make_params, simulate_onebit_adam

    nodes = [[0, 1], [2, 3]]
    sizes = [p.numel() for p in make_params(0)]
    _, n, _ = placement(sizes, BLOCK, 4)
    errors = {"w": [np.zeros(n // 2)] * 4, "s": [np.zeros(n // 4)] * 4}

    def exchange(local, *_):
        outs, errors["w"], errors["s"], c = hierarchical_round(local, errors["w"], errors["s"],
                                                               BLOCK, nodes)
        return outs, None, None, c

    steps, freeze = 12, 5
    got = run_workers(_adam_on_hierarchical, 4, steps, freeze, timeout=180, env=HIER_ENV)
    expected = simulate_onebit_adam(make_params(seed=0), 4, steps, freeze, 1e-2, (0.9, 0.999),
                                    1e-8, exchange=exchange)
    start = torch.cat([p.detach().reshape(-1) for p in make_params(0)]).numpy()
    assert np.abs(expected - start).mean() > 1e-2
    for g in got:
        np.testing.assert_array_equal(g, got[0])
        np.testing.assert_allclose(g, expected, rtol=0, atol=2e-4)


def _train_then_switch(rank, world, cls_name, prefix, first, second):
    """SWITCH steps on `first`'s backend, a checkpoint, then 10 more on a fresh
    optimizer built on `second`'s that loads it: the replicas stay identical
    (check_replicas_every=1 compares them wherever they should match) and
    the loss keeps falling."""
    from tests.optim.test_optim_dist import (CONFIGS, assert_identical, loss_and_grads, make,
                                             make_params)

    params = make_params(seed=0)
    kw = {**CONFIGS[cls_name], "check_replicas_every": 1}  # the variance freezes at step 30
    opt = make(cls_name, params, comm_backend_name=first, **kw)
    losses = [(loss_and_grads(params, rank, world), opt.step())[0] for _ in range(SWITCH)]
    state, errors = opt.state_dict(), opt.error_feedback_state_dict()
    again = make(cls_name, params, comm_backend_name=second, **kw)
    again.load_state_dict(state)
    restored = again.load_error_feedback_state_dict(errors)
    losses += [(loss_and_grads(params, rank, world), again.step())[0] for _ in range(10)]
    assert again.counters["step"] == SWITCH + 10
    if cls_name != "ZeroOneAdam":  # its replicas differ between syncs (checked at syncs above)
        assert_identical(params, "after the switch")
    return restored, losses


@pytest.mark.parametrize("cls_name", ["OnebitAdam", "OnebitLamb", "ZeroOneAdam"])
def test_optimizers_run_on_hierarchical_and_checkpoints_cross_layouts(cls_name, tmp_path):
    """All three optimizers train on 2 nodes x 2 ranks with identical replicas
    (checked every step), and a checkpoint moves between the hierarchical and
    the flat backend both ways: the error buffers, shaped for the other
    layout, are refused (they restart from zero), everything else carries."""
    for first, second in (("hierarchical", "compressed"), ("compressed", "hierarchical")):
        out = run_workers(_train_then_switch, 4, cls_name, str(tmp_path / "c"), first, second,
                          timeout=180, env=HIER_ENV)
        for restored, losses in out:
            assert not restored
            assert all(torch.isfinite(torch.tensor(losses)))
            assert losses[-1] < losses[0], losses
            # No jump at the switch: the change into the first resumed step
            # looks like the changes of the steps before it.
            typical = max(abs(a - b) for a, b in zip(losses[SWITCH - 10:SWITCH],
                                                     losses[SWITCH - 9:SWITCH + 1]))
            assert abs(losses[SWITCH + 1] - losses[SWITCH]) <= 1.5 * typical, losses


def _two_replica_groups(rank, world, node_of_rank, shared_memory):
    """Tensor x data parallelism: data-parallel groups {0, 1} and {2, 3},
    each with its own hierarchical backend."""
    import torch.distributed as dist

    from onebit.backends.hierarchical import torch_hierarchical

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    backend = torch_hierarchical(group=groups[rank // 2], node_of_rank=node_of_rank,
                                 block_size=8, timeout_s=30, shared_memory=shared_memory)
    out = []
    for round_ in range(3):
        x = torch.full((16,), float(rank + 10 * round_))
        w, s = backend.error_sizes(16)
        backend.compressed_allreduce(x, torch.zeros(w), torch.zeros(s))
        out.append(x.tolist())
    return out


@pytest.mark.parametrize("node_of_rank", [[0, 0], [0, 1]], ids=["one node of 2", "2 nodes of 1"])
@pytest.mark.parametrize("shared_memory", [True, False])
def test_two_data_parallel_groups_each_average_their_own_ranks(node_of_rank, shared_memory):
    """Each rank created only its own group's node and cross-node groups, so
    the two groups' ranks made different groups under the same numbers and
    gloo joined ranks of the other group: a wrong average (rank 0 with rank
    3) or a hang in new_group, some runs in ten. Every rank now creates every
    group in one order. A constant buffer's 1-bit average is exact: each
    group's mean, bitwise, on both of its ranks, every round."""
    out = run_workers(_two_replica_groups, 4, node_of_rank, shared_memory, timeout=120)
    for rank, rounds in enumerate(out):
        for round_, x in enumerate(rounds):
            mean = (2 * (rank // 2) + 0.5) + 10 * round_
            assert x == [mean] * 16, (rank, round_, x[:3])


def _uneven_nodes_default(rank, world, owner):
    """3 ranks on nodes of 2 + 1, as an elastic launcher reports them."""
    import os

    import onebit
    from onebit.accelerator import get_accelerator

    os.environ["LOCAL_WORLD_SIZE"] = "2" if rank < 2 else "1"
    os.environ["LOCAL_RANK"] = str(rank if rank < 2 else 0)
    default_here = get_accelerator().onebit_backend()
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(37))]
    if owner == "DiLoCo":
        model = torch.nn.Linear(5, 3)
        made = onebit.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2,
                             compression="1bit", timeout_s=30)
        return default_here, made.backend.name
    opt = onebit.OnebitAdam(params, lr=1e-2, freeze_step=1, timeout_s=30)
    for t in range(3):
        params[0].grad = torch.randn(37, generator=torch.Generator().manual_seed(10 * t + rank))
        opt.step()
    return default_here, opt.backend.name, params[0].detach().tolist()


@pytest.mark.parametrize("owner", ["OnebitAdam", "DiLoCo"])
def test_a_default_backend_the_ranks_read_differently_falls_back_to_flat_on_all(owner):
    """Nodes of 2 + 1 ranks: the two ranks of the first node read
    'hierarchical' as their default and the third 'compressed'; their first
    collectives did not match and gloo aborted the process. The ranks now
    agree on the default, and take the flat backend together."""
    out = run_workers(_uneven_nodes_default, 3, owner, timeout=120)
    assert [o[0] for o in out] == ["hierarchical", "hierarchical", "compressed"], out
    assert all(o[1] == "compressed" for o in out), out
    if owner == "OnebitAdam":
        assert out[0][2] == out[1][2] == out[2][2]  # one model on every rank


def _pads_hold_garbage(rank, world, shared_memory, node_of_rank):
    from onebit.backends import CompressedBackend
    from onebit.backends.hierarchical import torch_hierarchical

    out = {}
    for name, backend in (("hierarchical", torch_hierarchical(
            node_of_rank=node_of_rank, block_size=64, shared_memory=shared_memory)),
            ("flat", CompressedBackend(block_size=64))):
        layout = backend.layout([100, 64])
        buf = torch.full((layout.numel,), 1000.0 + rank)  # what the pads hold on input
        torch.manual_seed(rank)
        for view in layout.views(buf, [(100,), (64,)]):
            view.copy_(torch.randn(view.shape))
        w, s = layout.error_sizes
        backend.compressed_allreduce(buf, torch.zeros(w), torch.zeros(s), layout=layout)
        out[name] = buf[100:128].tolist()
    return out


@pytest.mark.parametrize("node_of_rank", [[0, 0, 1, 1], [0, 0, 0, 0]],
                         ids=["2 nodes of 2", "1 node of 4"])
@pytest.mark.parametrize("shared_memory", [True, False])
def test_pads_between_tensors_come_back_zero_on_every_rank(shared_memory, node_of_rank):
    """Sizes [100, 64], block 64, 4 ranks: elements 100-127 of the fused
    buffer are pads at the end of a shard, which no stage touched, so they
    came back as the node's mean of the inputs there (1000.5 on the first
    node, 1002.5 on the second): not zero, and not the same on every rank.
    As the flat backend's, they now come back zero."""
    for out in run_workers(_pads_hold_garbage, 4, shared_memory, node_of_rank, timeout=120):
        assert out["flat"] == [0.0] * 28
        assert out["hierarchical"] == [0.0] * 28, out["hierarchical"][:3]


def _peer_dies_in_shared_memory_setup(rank, world):
    import os

    import onebit.backends.shm as shm
    from onebit.backends.hierarchical import torch_hierarchical

    if rank == 1:
        shm.open = lambda *a, **k: os._exit(1)  # dies just before creating its segment
    try:
        torch_hierarchical(node_of_rank=[0, 0], timeout_s=10)
    except Exception as exc:  # noqa: BLE001 - what the survivor saw is the result
        return type(exc).__name__
    return "built"


def test_a_peer_dying_during_shared_memory_setup_leaves_nothing_in_dev_shm():
    """The survivor's segment file was unlinked only after both gathers
    succeeded: with its peer dead between them it got a CommunicationError
    and its file stayed in /dev/shm for good. Now it goes whatever happens."""
    import glob

    before = set(glob.glob("/dev/shm/onebit-*"))
    out = run_workers(_peer_dies_in_shared_memory_setup, 2, timeout=90, may_die=(1,))
    left = sorted(set(glob.glob("/dev/shm/onebit-*")) - before)
    for f in left:
        os.unlink(f)
    assert out[0] == "CommunicationError", out
    assert left == []
