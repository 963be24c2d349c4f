"""A param that no rank has a gradient for in a step is left untouched, as
torch leaves a param whose .grad is None (issue 32): its value, its state
and this rank's slices of the error-feedback buffers, decided by all ranks
together. One with a gradient on some ranks only still moves, the same on
every rank.

3 gloo ranks, a 300-element param B between two others: every rank has a
gradient for B at steps 1-4, none at steps 5-6, rank 1 only at step 7, all
again after. Compression starts at step 4 (0/1 Adam: 1-bit gradients from
step 2)."""
import pytest
import torch

from tests.distributed import run_workers

BLOCK = 256
SIZES = [32, 300, 16]  # A, B, C: B spans blocks 1-2 of the fused buffer
CONFIGS = {
    "OnebitAdam": dict(freeze_step=3, lr=1e-2, weight_decay=0.01),
    "OnebitLamb": dict(freeze_step=3, lr=1e-2, weight_decay=0.01),
    # Step 5 a local step, step 6 a sync (then local, sync, ...).
    "ZeroOneAdam": dict(var_freeze_step=3, lr=1e-2, weight_decay=0.01, local_step_scaler=1,
                        local_step_clipper=2),
}
B_GRAD_RANKS = {5: (), 6: (), 7: (1,)}  # step -> ranks with a gradient for B (else all)


def _b_slices(world: int, rank: int):
    """B's place in this rank's (worker, server) errors, from the wire
    format's rules (every tensor starts on a block boundary, the padded
    buffer splits into equal rank chunks), not from the library."""
    offsets, end = [], 0
    for n in SIZES:
        offsets.append(end)
        end += -(-n // BLOCK) * BLOCK
    unit = BLOCK * world
    chunk = -(-end // unit) * unit // world
    lo, hi = offsets[1], offsets[1] + SIZES[1]
    s_lo, s_hi = max(lo, rank * chunk), min(hi, (rank + 1) * chunk)
    return slice(lo, hi), (slice(s_lo - rank * chunk, s_hi - rank * chunk) if s_lo < s_hi else None)


def _train(rank, world, cls_name, overlap, backend=None, steps=9):
    import onebit

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in SIZES]
    opt = getattr(onebit, cls_name)(params, overlap_backward=overlap, comm_backend_name=backend,
                                    **CONFIGS[cls_name])
    flat = not overlap and backend is None  # where _b_slices knows the error layout
    worker, server = _b_slices(world, rank)
    history, b_kept = [], []
    for t in range(1, steps + 1):
        with_b = rank in B_GRAD_RANKS.get(t, range(world))
        g = torch.Generator().manual_seed(100 * t + rank)
        loss = sum((p * torch.randn(p.shape, generator=g)).sum()
                   for i, p in enumerate(params) if i != 1 or with_b)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        before = (params[1].detach().clone(),
                  {k: v.clone() for k, v in opt.state[params[1]].items() if torch.is_tensor(v)},
                  opt.error_feedback_state_dict()["groups"] if flat else None)
        opt.step()
        if t in (5, 6):
            value, state, errors = before
            after_errors = opt.error_feedback_state_dict()["groups"] if flat else None
            same = torch.equal(value, params[1].detach()) and all(
                torch.equal(v, opt.state[params[1]][k]) for k, v in state.items())
            if errors:  # B's slices as they were; A's moved on
                for name, e in errors.items():
                    a = after_errors[name]
                    same = same and torch.equal(e["worker"][worker], a["worker"][worker])
                    if server is not None:
                        same = same and torch.equal(e["server"][server], a["server"][server])
                    if opt.last_stage.name != "local step":  # (a local step exchanges nothing)
                        same = same and not torch.equal(e["worker"][:SIZES[0]],
                                                        a["worker"][:SIZES[0]])
            b_kept.append((same, opt.last_stage.name))
        history.append([p.detach().tolist() for p in params])  # plain data back from a worker
    return history, b_kept


@pytest.mark.parametrize("cls_name", sorted(CONFIGS))
def test_a_param_no_rank_has_a_gradient_for_is_left_untouched(cls_name):
    """...but at 0/1 Adam's syncs: a sync lands every param on the ranks'
    common point, so B joins it with a zero gradient (left as it was, it
    would keep each rank's own value from the local steps before)."""
    runs = run_workers(_train, 3, cls_name, False, timeout=120)
    for history, b_kept in runs:
        for same, stage in b_kept:
            assert same == (stage != "sync"), (stage, same)
        # B moved at step 7 (rank 1's gradient, averaged with zeros) and after.
        assert history[5][1] != history[6][1] and history[6][1] != history[7][1]
        # A moved at steps 5 and 6.
        assert history[3][0] != history[4][0]
    if cls_name == "ZeroOneAdam":  # its ranks differ between syncs by design; equal after each
        assert [s for _, s in runs[0][1]] == ["local step", "sync"]
        after_syncs = [t for t, (_, stage) in zip((4, 5), runs[0][1]) if stage == "sync"]
        assert all(r[0][t] == runs[0][0][t] for r in runs[1:] for t in after_syncs)
    else:
        assert all(r[0] == runs[0][0] for r in runs[1:])


@pytest.mark.slow
@pytest.mark.parametrize("cls_name", sorted(CONFIGS))
def test_untouched_params_with_overlap_backward_match_the_fused_step(cls_name):
    fused = run_workers(_train, 3, cls_name, False, timeout=120)
    overlapped = run_workers(_train, 3, cls_name, True, timeout=120)
    for (h1, kept1), (h2, kept2) in zip(fused, overlapped):
        assert kept2 == kept1
        assert h1 == h2


@pytest.mark.slow
def test_untouched_params_on_the_hierarchical_backend():
    """2 nodes of 2 ranks: the errors live in node shards there."""
    runs = run_workers(_train, 4, "OnebitAdam", False, "hierarchical", timeout=120,
                       env={"ONEBIT_RANKS_PER_NODE": "2"})
    for history, b_kept in runs:
        assert [same for same, _ in b_kept] == [True, True] and history == runs[0][0]


def test_error_ranges_of_a_tensor_split_across_hierarchical_shards():
    """Sizes 32, 300, 16 at block 256 on 2 nodes x 2 ranks: the buffer pads
    to 1024, each local rank's shard holds 512. Local rank 1's shard holds
    B's last 44 elements (at 0) and C (at 256); it splits into 2 node chunks
    of 256, so B's piece is in node 0's server error only."""
    from onebit.backends.hierarchical import HierarchicalLayout

    first = HierarchicalLayout(SIZES, BLOCK, 2, 2, local_rank=0)
    second = HierarchicalLayout(SIZES, BLOCK, 2, 2, local_rank=1)
    assert first.error_ranges(1, 0) == ((256, 512), None)
    assert first.error_ranges(1, 1) == ((256, 512), (0, 256))
    assert second.error_ranges(1, 0) == ((0, 44), (0, 44))
    assert second.error_ranges(1, 1) == ((0, 44), None)
    assert second.error_ranges(0, 0) == (None, None)


def test_zero_one_adam_records_the_synced_point_for_a_param_it_leaves_alone():
    """One process, syncs at steps 4 and 8, local steps between. B has no
    gradient at step 9, the first local step after the sync at 8: it stays
    where the sync put it, and the last synced point the step records for
    the next local steps is that point, not the one of step 4 (put back,
    step 10 landed B near step 4's point: 0.1 away instead of one step)."""
    import onebit

    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(10)), torch.nn.Parameter(torch.randn(10))
    opt = onebit.ZeroOneAdam([a, b], lr=1e-2, var_freeze_step=2, local_step_scaler=1,
                             local_step_clipper=4)
    g = torch.Generator().manual_seed(1)
    stages, at_sync = [], None
    for t in range(1, 12):
        a.grad = torch.randn(10, generator=g)
        gb = torch.randn(10, generator=g)
        b.grad = None if t == 9 else gb
        opt.step()
        stages.append(opt.last_stage.name)
        if t == 8:
            at_sync = b.detach().clone()
        if t == 9:
            assert torch.equal(b.detach(), at_sync)  # left alone
            assert torch.equal(opt.state[b]["sync_point"], at_sync)
        if t == 10:  # one local step from the sync's point: anchor + this interval's u
            assert torch.equal(opt.state[b]["sync_point"], at_sync)
            assert torch.equal(b.detach(), at_sync + opt.state[b]["momentum_accumulator"])
            assert (b.detach() - at_sync).abs().max() < 0.05
    assert stages[7:10] == ["sync", "local step", "local step"]


def _late_joiner_never_used(rank, world, cls_name):
    import onebit

    torch.manual_seed(0)
    trunk, branch = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)
    stage = "var_freeze_step" if cls_name == "ZeroOneAdam" else "freeze_step"
    opt = getattr(onebit, cls_name)([*trunk.parameters(), *branch.parameters()], lr=1e-2,
                                    weight_decay=0.01, **{stage: 3})
    start = branch.weight.detach().clone()
    g = torch.Generator().manual_seed(rank)
    for step in range(1, 11):
        branch.requires_grad_(step > 3)  # unfrozen after the freeze, then used by no rank
        x = torch.randn(8, 4, generator=g)
        opt.zero_grad(set_to_none=True)
        trunk(x).pow(2).mean().backward()
        opt.step()
    return (branch.weight.detach() - start).abs().max().item()


@pytest.mark.parametrize("cls_name", sorted(CONFIGS))
def test_a_late_joiner_no_rank_has_a_gradient_for_stays_as_it_was(cls_name):
    """Unfrozen after the freeze (a late joiner, late.py) but used by no
    rank: weight decay included, it must stay as torch leaves it. At 0/1
    Adam's syncs it took a step of weight decay (a sync takes every trained
    param, to land the replicas on one point, which a late joiner averaged
    in full precision every step does not need)."""
    assert run_workers(_late_joiner_never_used, 2, cls_name, timeout=120) == [0.0, 0.0]
