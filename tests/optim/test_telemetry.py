"""opt.comm_stats(): per-step telemetry, checked against an independent
count (the bytes from the wire format and the world size; the seconds
against a wall clock) on real gloo ranks."""
import copy
import math
import time

import torch

from tests.distributed import run_workers

SIZES = [(33, 7), (5,), (300,)]  # 231 + 5 + 300 elements, none a multiple of a block
BLOCK = 256


def padded_numel(sizes, p, block=BLOCK):
    """Elements of the fused buffer: each tensor starts on a block, the
    buffer pads to a multiple of block * p (README, "How it works")."""
    n = sum(-(-math.prod(s) // block) * block for s in sizes)
    return -(-n // (block * p)) * block * p


def wire_bytes_per_rank(sizes, p, block=BLOCK, scale_bytes=4):
    """From the wire format (README, "How it works"): each tensor starts on a
    block, the buffer pads to a multiple of block * p; a rank's message row
    is chunk/8 sign bytes + one scale per block of its chunk. Phase 1 sends
    p - 1 rows (all-to-all), phase 2 its server row to p - 1 peers."""
    chunk = padded_numel(sizes, p, block) // p
    row = chunk // 8 + (chunk // block) * scale_bytes
    return 2 * (p - 1) * row


def _run(rank, world, name):
    import onebit

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SIZES]
    step = "var_freeze_step" if name == "ZeroOneAdam" else "freeze_step"
    opt = getattr(onebit, name)(params, lr=1e-3, **{step: 2})
    out = []
    for t in range(1, 6):
        g = torch.Generator().manual_seed(10 * t + rank)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        skip = t == 4
        if skip:  # what torch.amp.GradScaler hands over when it saw inf
            opt.grad_scale, opt.found_inf = torch.tensor(1.0), torch.tensor(1.0)
        coming = opt.stage()
        start = time.perf_counter()
        opt.step()
        wall = time.perf_counter() - start
        if skip:
            del opt.grad_scale, opt.found_inf
        out.append({"coming": coming, "wall": wall, **opt.comm_stats()})
    return out


def test_comm_stats_bytes_and_times_match_an_independent_count():
    p = 3
    real = sum(math.prod(s) for s in SIZES)
    fp32 = 2 * (p - 1) * 4 * real // p  # a ring all-reduce of the same elements
    # Warmup averages the fused buffer in one fp32 all-reduce: every tensor
    # starts on a block, so the pads between tensors go too (not the tail's).
    fused = sum(-(-math.prod(s) // BLOCK) * BLOCK for s in SIZES[:-1]) + math.prod(SIZES[-1])
    averaged = 2 * (p - 1) * 4 * fused // p
    compressed = wire_bytes_per_rank(SIZES, p)
    ranks = run_workers(_run, p, "OnebitAdam", timeout=90)
    # Rank 2's server chunk holds only padding here (1024 real slots of 1536): its error stays 0.
    assert [r[2]["server_error_norm"] > 0 for r in ranks] == [True, True, False]
    for rank_stats in ranks:
        s1, s2, s3, s4, s5 = rank_stats
        assert [s["stage"] for s in rank_stats] == ["warmup", "warmup", "compression",
                                                     "compression", "compression"]
        assert [s["coming"] for s in rank_stats] == [s["stage"] for s in rank_stats]
        for s in rank_stats:  # a flat backend knows no nodes: all it sends counts
            assert s["bytes_between_nodes"] == s["bytes_sent"]
        for s in (s1, s2):
            assert s["bytes_sent"] == s["bytes_received"] == averaged
            assert s["fp32_bytes"] == fp32
            assert s["compression_ratio"] == fp32 / averaged and s["worker_error_norm"] == 0.0
        for s in (s3, s5):
            assert s["bytes_sent"] == s["bytes_received"] == compressed
            assert s["fp32_bytes"] == fp32
            assert s["compression_ratio"] == fp32 / compressed
            assert s["worker_error_norm"] > 0
        assert s4["bytes_sent"] == 0 and s4["skipped_steps"] == 1 and s5["skipped_steps"] == 1
        for s in rank_stats:
            assert 0 <= s["comm_s"] and 0 <= s["compress_s"]
            assert s["comm_s"] + s["compress_s"] <= s["wall"]
        assert s3["comm_s"] > 0 and s3["compress_s"] > 0
        assert s5["total_bytes_sent"] == 2 * averaged + 2 * compressed
        assert math.isclose(s5["total_comm_s"], sum(s["comm_s"] for s in rank_stats))


def _run_hierarchical(rank, world):
    import onebit

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SIZES]
    opt = onebit.OnebitAdam(params, lr=1e-3, freeze_step=2, comm_backend_name="hierarchical")
    assert opt.backend.nodes == [[0, 1], [2, 3]]
    out = []
    for t in range(1, 5):
        g = torch.Generator().manual_seed(10 * t + rank)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
        out.append(opt.comm_stats())
    return out


def test_hierarchical_bytes_between_nodes_are_its_one_bit_stage_alone():
    """2 nodes of 2 ranks: bytes_sent counts the fp32 reduce-scatter and
    all-gather inside the node too; bytes_between_nodes is what leaves the
    node, the 1-bit exchange of this rank's shard among the 2 nodes."""
    p, per_node, nodes = 4, 2, 2
    n = padded_numel(SIZES, p)  # the buffer cut into whole blocks for all 4 ranks
    shard = n // per_node  # this rank's shard, reduced inside the node in fp32
    chunk = shard // nodes  # the part of it this rank serves among the nodes
    between = 2 * (nodes - 1) * (chunk // 8 + chunk // BLOCK * 4)  # signs and fp32 scales
    inside = 2 * (per_node - 1) * shard * 4  # a ring reduce-scatter + all-gather of fp32
    fused = sum(-(-math.prod(s) // BLOCK) * BLOCK for s in SIZES[:-1]) + math.prod(SIZES[-1])
    averaged = 2 * (p - 1) * 4 * fused // p  # the warmup's all-reduce over all 4 ranks
    ranks = run_workers(_run_hierarchical, p, timeout=120, env={"ONEBIT_RANKS_PER_NODE": "2"})
    for s1, s2, s3, s4 in ranks:
        assert [s["stage"] for s in (s1, s2, s3, s4)] == ["warmup"] * 2 + ["compression"] * 2
        for s in (s1, s2):  # a flat all-reduce: all it sends counts
            assert s["bytes_sent"] == s["bytes_between_nodes"] == averaged
        for s in (s3, s4):
            assert s["bytes_between_nodes"] == between
            assert s["bytes_sent"] == between + inside
        assert s4["total_bytes_between_nodes"] == 2 * averaged + 2 * between


def test_zero_one_adam_names_its_stages():
    stages = [s["stage"] for s in run_workers(_run, 2, "ZeroOneAdam", timeout=90)[0]]
    # Interval 1 before the freeze (every step updates v), then a sync every step.
    assert stages == ["variance update", "variance update", "sync", "sync", "sync"]


def _norms_across_a_resume(rank, world):
    import onebit

    def make():
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s)) for s in SIZES]
        return params, onebit.OnebitAdam(params, lr=1e-2, freeze_step=2)

    def train(params, opt, steps):
        for t in steps:
            g = torch.Generator().manual_seed(10 * t + rank)
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()

    params, opt = make()
    train(params, opt, range(5))
    # Copies, as a file would hold: torch's load_state_dict keeps the tensors it is given.
    saved, errors = copy.deepcopy(opt.state_dict()), opt.error_feedback_state_dict()
    # An independent norm: every saved error buffer, in float64.
    expected = [torch.cat([g[part].double().flatten() for g in errors["groups"].values()]).norm().item()
                for part in ("worker", "server")]
    before = opt.comm_stats()
    params2, opt2 = make()
    with torch.no_grad():
        for p, q in zip(params2, params):
            p.copy_(q)
    opt2.load_state_dict(saved)
    restored = opt2.load_error_feedback_state_dict(errors)
    after = opt2.comm_stats()
    train(params, opt, [5])
    train(params2, opt2, [5])
    return restored, expected, before, after, opt.comm_stats(), opt2.comm_stats()


def test_error_norms_are_reported_from_a_checkpoint_before_the_first_step_after_it():
    for restored, expected, before, after, went_on, resumed in run_workers(
            _norms_across_a_resume, 2, timeout=90):
        assert restored and expected[0] > 0 and expected[1] > 0
        for name, want in zip(("worker_error_norm", "server_error_norm"), expected):
            assert math.isclose(before[name], want, rel_tol=1e-6)
            assert math.isclose(after[name], want, rel_tol=1e-6)  # read 0 here before
            assert resumed[name] == went_on[name]
