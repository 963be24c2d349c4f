"""opt.comm_stats(): per-step telemetry, checked against an independent
count (the bytes from the wire format and the world size; the seconds
against a wall clock) on real gloo ranks."""
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


def test_zero_one_adam_names_its_stages():
    stages = [s["stage"] for s in run_workers(_run, 2, "ZeroOneAdam", timeout=90)[0]]
    # Interval 1 before the freeze (every step updates v), then a sync every step.
    assert stages == ["variance update", "variance update", "sync", "sync", "sync"]
