"""onebit.DiLoCo on real gloo ranks, checked against an independent float64
simulation of the outer loop: inner SGD steps, the pseudo-gradients'
compressed average with errors carried across rounds (tests/reference.py,
which imports nothing from onebit), and Nesterov outer SGD."""
import copy
import io
import os
import signal
import time

import numpy as np
import pytest
import torch

from tests import reference
from tests.distributed import run_workers

SIZES = [(37, 5), (300,), (3,)]  # 488 elements: no multiple of 8 * 3 * 64
BLOCK, H, ROUNDS, INNER_LR = 64, 3, 4, 0.05
# DiLoCo's published outer step, and ours (plain SGD a little past the average)
OUTERS = {"nesterov": dict(outer_lr=0.7, outer_momentum=0.9, nesterov=True),
          "default": dict(outer_lr=1.3, outer_momentum=0.0, nesterov=False)}


# The simulation's code for each compressed wire (the sparse one at topk 4 of 64).
QUANTIZE = {"1bit": reference.compress, "2bit": reference.ternary, "sparse2bit": reference.sparse}


def _outer_settings(outer):
    """DiLoCo's outer arguments; "later": plain SGD whose lr grows from 1.3
    to 2.0 from inner step 2 * H on (its third round)."""
    if outer == "later":
        import onebit

        return dict(outer_lr=onebit.SteppedOuterLR(1.3, 2.0, 2 * H), outer_momentum=0.0,
                    nesterov=False)
    return OUTERS[outer]


def _outer_lr_at(outer, inner_steps):
    """The simulation's own reading of the same schedules."""
    if outer == "later":
        return 1.3 if inner_steps < 2 * H else 2.0
    return OUTERS[outer]["outer_lr"]


def _init():
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen) for s in SIZES]


def _grad(rank, step, i):
    """Each rank's gradient at inner step `step` for param i: its own data."""
    gen = torch.Generator().manual_seed(1000 * rank + 10 * step + i)
    return torch.randn(SIZES[i], generator=gen) * (1.0 + i)  # scales differ per tensor


def _train(rank, world, compression, rounds=ROUNDS, start=None, save_at=None,
           outer="nesterov", warmup=0, fragments=1, overlap=0, dcp_dir=None, keep=0.0,
           alpha=0.0, drain_at=None, error_decay=1.0):
    """This rank's params after every inner step (inner step -> arrays), its
    checkpoint after inner step `save_at`, and comm_stats(). With `dcp_dir`,
    DiLoCo's shared state goes through torch.distributed.checkpoint there.
    `drain_at`: drain() after that inner step (after the save; a resume
    from there drains first)."""
    import onebit

    torch.manual_seed(rank)  # rank 0's init must win: the others start elsewhere
    params = [torch.nn.Parameter(x if rank == 0 else torch.randn_like(x)) for x in _init()]
    inner = torch.optim.SGD(params, lr=INNER_LR)
    diloco = onebit.DiLoCo(params, inner, sync_every=H, compression=compression,
                           block_size=BLOCK, timeout_s=30, warmup_steps=warmup,
                           fragments=fragments, overlap_steps=overlap, keep_local_progress=keep,
                           fragment_update_alpha=alpha,
                           **({"topk": 4} if compression == "sparse2bit" else {}),
                           error_decay=error_decay,
                           **_outer_settings(outer))
    if start is not None:  # a resume: this rank's checkpoint
        start = torch.load(io.BytesIO(start), weights_only=False)
        for p, v in zip(params, start["params"]):
            p.data.copy_(v)
        inner.load_state_dict(start["inner"])
        if dcp_dir is not None:  # into a fresh state_dict() of the same shape, as DCP loads
            import torch.distributed.checkpoint as dcp

            template = {"diloco": diloco.state_dict()}
            dcp.load(template, checkpoint_id=dcp_dir)
            start["diloco"] = template["diloco"]
        diloco.load_state_dict(start["diloco"])
        assert diloco.load_error_feedback_state_dict(start["errors"])
        if drain_at == diloco.inner_steps:
            diloco.drain()
    after, saved = {}, None
    for step in range(diloco.inner_steps, warmup + rounds * H):
        for i, p in enumerate(params):
            p.grad = _grad(rank, step, i)
        inner.step()
        after[step + 1] = _numpy(params)
        if step + 1 == save_at:
            saved = io.BytesIO()  # bytes: tensors would not outlive this process
            shared = diloco.state_dict()
            if dcp_dir is not None:
                import torch.distributed.checkpoint as dcp

                dcp.save({"diloco": shared}, checkpoint_id=dcp_dir)
                shared = None
            torch.save({"params": [p.detach().clone() for p in params],
                        "inner": inner.state_dict(), "diloco": shared,
                        "errors": diloco.error_feedback_state_dict()}, saved)
            saved = saved.getvalue()
        if step + 1 == drain_at:
            diloco.drain()
    stats = diloco.comm_stats()
    diloco.close()
    return after, saved, stats


def _numpy(params):
    return [p.detach().numpy().copy() for p in params]


def _same(xs, ys):
    return all(np.array_equal(x, y) for x, y in zip(xs, ys))


def _simulate(world, compression, outer="nesterov", warmup=0, fragments=None, delay=0,
              keep=0.0, alpha=0.0, decay=None):
    """float64: every rank's params after every inner step (inner step ->
    one list per rank), and the inner steps after which each fragment's
    outer step landed. After `warmup` inner steps on the ranks' mean
    gradient, each rank takes its own SGD steps; fragment f (a list of
    param indices; default one fragment of all) measures its pseudo-
    gradients after inner step (f + 1) * H // F of each round, averages
    them (1-bit: with its own carried errors), and `delay` steps later its
    anchors take the outer SGD step and every rank's params take the anchors'
    values (Streaming DiLoCo with update alpha 0), plus `keep` times what
    the rank's own steps moved them since the launch; or, with `alpha`,
    (1 - alpha) times the anchors' values plus alpha times the rank's own."""
    mu, nesterov = (_outer_settings(outer)[k] for k in ("outer_momentum", "nesterov"))
    fragments = fragments or [list(range(len(SIZES)))]
    anchor = [x.double().numpy().reshape(-1) for x in _init()]
    out, landed = {}, {}
    for step in range(warmup):
        for i in range(len(anchor)):
            anchor[i] = anchor[i] - INNER_LR * sum(
                _grad(rank, step, i).double().numpy().reshape(-1) for rank in range(world)) / world
        out[step + 1] = [[a.copy() for a in anchor] for _ in range(world)]
    params = [[a.copy() for a in anchor] for _ in range(world)]
    errors, buf, pending = {}, {}, {}
    for f, members in enumerate(fragments):
        n = reference.placement([anchor[i].size for i in members], BLOCK, world)[1]
        errors[f] = ([np.zeros(n) for _ in range(world)], [np.zeros(n // world)] * world)
    for step in range(warmup, warmup + ROUNDS * H):
        for rank in range(world):
            for i in range(len(anchor)):
                params[rank][i] = params[rank][i] - INNER_LR * _grad(
                    rank, step, i).double().numpy().reshape(-1)
        past = step + 1 - warmup
        for f, members in enumerate(fragments):
            offset = (f + 1) * H // len(fragments)
            if past >= offset and (past - offset) % H == 0:  # launch: measure and average
                deltas = [[anchor[i] - params[rank][i] for i in members] for rank in range(world)]
                if compression in QUANTIZE:
                    worker, server = errors[f]  # error_decay (default 1: all of it)
                    worker = [w * (1.0 if decay is None else decay) for w in worker]
                    avg, worker, server, _ = reference.reference_round(
                        deltas, worker, server, BLOCK, quantize=QUANTIZE[compression])
                    errors[f] = (worker, server)
                else:
                    avg = [sum(d[k] for d in deltas) / world for k in range(len(members))]
                pending[f] = (past + delay, avg,
                              [[params[rank][i].copy() for i in members] for rank in range(world)])
        for f, members in enumerate(fragments):
            if f in pending and pending[f][0] == past:  # land: the outer step
                _, avg, launched = pending.pop(f)
                lr = _outer_lr_at(outer, step + 1)
                # torch.optim.SGD: buf = mu * buf + g (g itself at first); the
                # step is g + mu * buf with Nesterov, buf without (g when mu = 0)
                for k, (i, g) in enumerate(zip(members, avg)):
                    buf[i] = g.copy() if i not in buf else mu * buf[i] + g
                    anchor[i] = anchor[i] - lr * (g + mu * buf[i] if nesterov else buf[i])
                    for rank in range(world):
                        progress = params[rank][i] - launched[rank][k]
                        mixed = alpha * (params[rank][i] - anchor[i])
                        params[rank][i] = anchor[i] + (mixed if alpha else keep * progress)
                landed.setdefault(step + 1, []).append(f)
        out[step + 1] = [[p.copy() for p in ps] for ps in params]
    return out, landed


def _check_against_simulation(results, expected, compression, tol, world, fragments=None,
                              identical_landings=True):
    """Every rank's params after every inner step within `tol` (relative)
    of the simulation's; where a fragment's outer step landed, its params
    bitwise the same on every rank (unless each keeps its own progress)."""
    steps, landed = expected
    fragments = fragments or [list(range(len(SIZES)))]
    assert sorted(results[0][0]) == sorted(steps)
    for step, want_ranks in steps.items():
        for rank in range(world):
            got = np.concatenate([p.astype(np.float64).reshape(-1) for p in results[rank][0][step]])
            want = np.concatenate(want_ranks[rank])
            err = np.max(np.abs(got - want)) / np.max(np.abs(want))
            assert err < tol, f"inner step {step}, rank {rank}: {compression} is {err:.2e} away"
    for step, which in (landed.items() if identical_landings else ()):
        for i in (i for f in which for i in fragments[f]):
            for rank in range(1, world):
                assert np.array_equal(results[0][0][step][i], results[rank][0][step][i]), \
                    f"inner step {step}: param {i} differs on rank {rank} after its outer step"
    return landed


@pytest.mark.parametrize("compression, tol, outer, warmup", [
    ("1bit", 2e-4, "nesterov", 0), ("none", 1e-5, "nesterov", 0), ("bf16", 2e-2, "nesterov", 0),
    ("1bit", 2e-4, "default", 0), ("1bit", 2e-4, "default", 5), ("none", 1e-5, "default", 5),
    ("1bit", 2e-4, "later", 0), ("none", 1e-5, "later", 2), ("2bit", 2e-4, "nesterov", 0),
    ("2bit", 2e-4, "default", 5), ("sparse2bit", 2e-4, "default", 0),
    ("sparse2bit", 2e-4, "nesterov", 5)])
def test_rounds_match_the_float64_simulation_and_ranks_are_identical(compression, tol, outer,
                                                                     warmup):
    world = 3
    results = run_workers(_train, world, compression, ROUNDS, None, None, outer, warmup,
                          timeout=120)
    expected = _simulate(world, compression, outer, warmup)
    _check_against_simulation(results, expected, compression, tol, world)
    stats = results[0][2]
    assert stats["step"] == ROUNDS and stats["inner_steps"] == warmup + ROUNDS * H
    assert (stats["warmup_bytes_sent"] > 0) == (warmup > 0)
    assert stats["skipped_rounds"] == 0
    ratio = {"none": 1.0, "bf16": 2.0}.get(compression)
    if ratio is not None:
        assert stats["total_compression_ratio"] == pytest.approx(ratio, rel=1e-3)
    elif warmup == 0:  # per round: 2 (p - 1) message rows of the padded chunk's codes
        # and scales (192 elements: 1/8 byte each for signs, 1/4 for the
        # 2-bit code, 4 bytes per 64), against fp32's ring 2 (p - 1) / p * 4
        # bytes for each of the 488 elements
        # (sparse: 4 slots of 6 + 2 bits per 64 elements, 1/16 byte each)
        chunk, code = 576 // world, {"1bit": 1 / 8, "2bit": 1 / 4, "sparse2bit": 1 / 16}[
            compression]
        row = chunk * code + chunk // BLOCK * 4
        fp32 = 2 * (world - 1) * 4 * 488 // world  # (whole bytes, as the stats count them)
        assert stats["total_compression_ratio"] == pytest.approx(fp32 / (2 * (world - 1) * row),
                                                                rel=1e-6)
    if compression in QUANTIZE:
        assert stats["worker_error_norm"] > 0 and stats["server_error_norm"] > 0


@pytest.mark.parametrize("world", [2, 4])
def test_sparse_rounds_match_the_float64_simulation_at_2_and_4_ranks(world):
    """The sparse 2-bit wire at the world sizes around the main test's 3."""
    results = run_workers(_train, world, "sparse2bit", ROUNDS, None, None, "default", 0,
                          timeout=120)
    _check_against_simulation(results, _simulate(world, "sparse2bit", "default"), "sparse2bit",
                              2e-4, world)


@pytest.mark.parametrize("compression, decay, fragments, overlap", [
    ("1bit", 0.8, [[0], [1], [2]], 1), ("sparse2bit", 0.95, None, 0),
    ("sparse2bit", 0.5, [[0], [1], [2]], 1)])
def test_error_decay_matches_the_float64_simulation(compression, decay, fragments, overlap):
    """error_decay scales this rank's worker error before each round (e <-
    decay * e + delta), on any compressed wire, plain and streaming; 1.0
    keeps it all (the default, the other tests')."""
    world = 3
    results = run_workers(_train, world, compression, ROUNDS, None, None, "default", 0,
                          len(fragments or [0]), overlap, None, 0.0, 0.0, None, decay,
                          timeout=120)
    expected = _simulate(world, compression, "default", 0, fragments, overlap, decay=decay)
    _check_against_simulation(results, expected, compression, 2e-4, world, fragments)


def _resume(rank, world, saved, fragments=1, overlap=0, dcp_dir=None, keep=0.0,
            outer="nesterov", drain_at=None, compression="1bit"):
    return _train(rank, world, compression, ROUNDS, saved[rank], None, outer, 0, fragments,
                  overlap, dcp_dir, keep, drain_at=drain_at)


def _resume_without_errors(rank, world, saved, fragments=1, overlap=0):
    """Load the shared state only (what a trainer's rank-0 checkpoint
    holds); count the restart warnings over the next round."""
    import warnings

    import onebit

    start = torch.load(io.BytesIO(saved[rank]), weights_only=False)
    params = [torch.nn.Parameter(v.clone()) for v in start["params"]]
    inner = torch.optim.SGD(params, lr=INNER_LR)
    inner.load_state_dict(start["inner"])
    diloco = onebit.DiLoCo(params, inner, sync_every=H, block_size=BLOCK, timeout_s=30,
                           fragments=fragments, overlap_steps=overlap, **OUTERS["nesterov"])
    diloco.load_state_dict(start["diloco"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(diloco.inner_steps, diloco.inner_steps + H):
            for i, p in enumerate(params):
                p.grad = _grad(rank, step, i)
            inner.step()
    return sum("restarted from zero" in str(w.message) for w in caught)


@pytest.mark.parametrize("fragments, overlap, save_at, dcp, keep, outer, drain", [
    (1, 0, 2 * H, False, 0.0, "nesterov", False), (3, 2, 7, False, 0.0, "nesterov", False),
    (3, 2, 7, True, 0.0, "nesterov", False), (3, 2, 7, False, 1.0, "nesterov", False),
    (3, 2, 7, True, 1.0, "nesterov", False), (3, 2, 4, False, 0.0, "later", False),
    (3, 2, 5, False, 0.0, "later", True)])
def test_resume_from_a_checkpoint_is_bitwise_identical(fragments, overlap, save_at, dcp, keep,
                                                       outer, drain, tmp_path):
    """Plain DiLoCo saved after round 2; streaming (3 fragments, 2 steps of
    overlap) saved after inner step 7, with two exchanges in flight, by
    torch.save and by torch.distributed.checkpoint; with keep_local_progress,
    their launch points go with each rank's error state. "later", an
    outer lr that steps up at step 6: saved after step 4, with a round in
    flight that lands at step 5 (its next landing is past the step-up);
    saved after step 5 with a round in flight that lands at step 6, and
    drained there. Each restored round reads the lr at its landing step
    in the schedule, as the run that did not stop does."""
    world = 3
    dcp_dir = str(tmp_path / "dcp") if dcp else None
    drain_at = save_at if drain else None
    straight = run_workers(_train, world, "1bit", ROUNDS, None, save_at, outer, 0,
                           fragments, overlap, dcp_dir, keep, 0.0, drain_at, timeout=120)
    saved = [r[1] for r in straight]
    resumed = run_workers(_resume, world, saved, fragments, overlap, dcp_dir, keep, outer,
                          drain_at, timeout=120)
    for rank in range(world):
        assert sorted(resumed[rank][0]) == list(range(save_at + 1, ROUNDS * H + 1))
        for step, params in resumed[rank][0].items():
            assert _same(straight[rank][0][step], params), \
                f"rank {rank} inner step {step} differs after the resume"
    if fragments == 1:  # without its errors a resume is not exact, and each rank says so once
        assert run_workers(_resume_without_errors, world, saved, timeout=120) == [1] * world


@pytest.mark.parametrize("fragments, overlap, save_at, dcp", [(1, 0, 2 * H, False),
                                                              (3, 2, 7, True)])
def test_a_sparse_wire_resumes_bitwise_identical(fragments, overlap, save_at, dcp, tmp_path):
    """The sparse 2-bit wire's errors go through a checkpoint as the other
    codes' do: plain DiLoCo by torch.save after round 2, and streaming by
    DCP with two exchanges in flight; the resumed run is the straight one."""
    world = 3
    dcp_dir = str(tmp_path / "dcp") if dcp else None
    straight = run_workers(_train, world, "sparse2bit", ROUNDS, None, save_at, "default", 0,
                           fragments, overlap, dcp_dir, timeout=120)
    resumed = run_workers(_resume, world, [r[1] for r in straight], fragments, overlap, dcp_dir,
                          0.0, "default", None, "sparse2bit", timeout=120)
    for rank in range(world):
        assert sorted(resumed[rank][0]) == list(range(save_at + 1, ROUNDS * H + 1))
        for step, params in resumed[rank][0].items():
            assert _same(straight[rank][0][step], params), \
                f"rank {rank} inner step {step} differs after the resume"
    assert straight[0][2]["worker_error_norm"] > 0  # there were errors to carry


def test_a_resume_without_errors_warns_with_the_first_exchange_still_in_flight():
    """Streaming, saved after inner step H + 1: the first exchange went out
    at step H and lands at H + 2, so no round has landed, but the errors
    have moved. The resume without them warned only once a round had landed."""
    world, overlap = 3, 2
    straight = run_workers(_train, world, "1bit", ROUNDS, None, H + 1, "nesterov", 0, 1,
                           overlap, timeout=120)
    saved = [r[1] for r in straight]
    assert run_workers(_resume_without_errors, world, saved, 1, overlap, timeout=120) == [1] * world


@pytest.mark.parametrize("compression, outer, fragments, overlap, keep", [
    ("1bit", "default", [[0], [1, 2]], 0, 0.0), ("1bit", "nesterov", [[0], [1], [2]], 2, 0.0),
    ("none", "default", [[0], [1], [2]], 1, 0.0), ("1bit", "later", [[0], [1], [2]], 1, 0.0),
    ("1bit", "default", [[0], [1], [2]], 2, 1.0), ("none", "nesterov", [[0], [1], [2]], 2, 0.5),
    ("2bit", "default", [[0], [1], [2]], 2, 0.0), ("sparse2bit", "later", [[0], [1], [2]], 2, 0.0)])
def test_streaming_matches_the_float64_simulation(compression, outer, fragments, overlap, keep):
    """Fragments synced at staggered inner steps, each exchange running
    `overlap` inner steps behind on the communication thread; the split by
    the middle element of each param (185, 300 and 3 elements). With the
    "later" schedule the second round's fragments land on either side of
    its switch (after inner steps 5, 6 and 7; the switch at 6), so each
    fragment must take the lr of its own landing. With `keep`, a landing
    adds that share of each rank's own steps since the launch back."""
    world = 3
    results = run_workers(_train, world, compression, ROUNDS, None, None, outer, 0,
                          len(fragments), overlap, None, keep, timeout=120)
    expected = _simulate(world, compression, outer, 0, fragments, overlap, keep)
    landed = _check_against_simulation(results, expected, compression,
                                       2e-4 if compression in QUANTIZE else 1e-5, world,
                                       fragments,
                                       identical_landings=keep == 0)
    assert results[0][2]["step"] == sum(len(fs) for fs in landed.values())
    if keep:  # each rank kept its own steps: the landed params differ between ranks
        step, which = next(iter(landed.items()))
        i = fragments[which[0]][0]
        assert not np.array_equal(results[0][0][step][i], results[1][0][step][i])


@pytest.mark.parametrize("compression, outer, fragments, overlap", [
    ("1bit", "default", [[0], [1], [2]], 2), ("none", "nesterov", [[0], [1, 2]], 0)])
def test_fragment_update_alpha_mixes_the_landing_as_the_float64_simulation(
        compression, outer, fragments, overlap):
    """fragment_update_alpha = 0.5: each landing fragment goes halfway from
    this rank's params to its new anchor, streaming (2 steps behind) and
    plain; the ranks' landed params then differ by their own steps."""
    world = 3
    results = run_workers(_train, world, compression, ROUNDS, None, None, outer, 0,
                          len(fragments), overlap, None, 0.0, 0.5, timeout=120)
    expected = _simulate(world, compression, outer, 0, fragments, overlap, alpha=0.5)
    landed = _check_against_simulation(results, expected, compression,
                                       2e-4 if compression == "1bit" else 1e-5, world, fragments,
                                       identical_landings=False)
    step, which = next(iter(landed.items()))
    i = fragments[which[0]][0]
    assert not np.array_equal(results[0][0][step][i], results[1][0][step][i])


def _nan_on_one_rank(rank, world):
    import onebit

    params = [torch.nn.Parameter(x) for x in _init()]
    inner = torch.optim.SGD(params, lr=INNER_LR)
    diloco = onebit.DiLoCo(params, inner, sync_every=H, block_size=BLOCK, timeout_s=30)
    out = []
    for step in range(3 * H):
        for i, p in enumerate(params):
            p.grad = _grad(rank, step, i)
            if rank == 1 and step == H + 1 and i == 1:
                p.grad[7] = float("nan")
        inner.step()
        if (step + 1) % H == 0:
            out.append(_numpy(params))
    return out, diloco.comm_stats()


def test_a_nonfinite_pseudo_gradient_skips_the_round_on_every_rank():
    results = run_workers(_nan_on_one_rank, 3, timeout=120)
    for rank, (rounds, stats) in enumerate(results):
        assert stats["skipped_rounds"] == 1 and stats["step"] == 2
        # the skipped round (2) went back to round 1's point, on every rank
        assert _same(rounds[0], rounds[1])
        assert all(np.isfinite(p).all() for p in rounds[2])
        assert _same(rounds[2], results[0][0][2])


def _one_rank_skips_an_inner_step(rank, world):
    """Rank 1 skips its inner step at step 1 (as torch's GradScaler does
    after an inf on that rank alone) and takes one more at the end: it
    reaches every round a step after the others, who wait for it."""
    import onebit

    params = [torch.nn.Parameter(x) for x in _init()]
    inner = torch.optim.SGD(params, lr=INNER_LR)
    diloco = onebit.DiLoCo(params, inner, sync_every=H, block_size=BLOCK, timeout_s=30)
    rounds = []
    for step in range(2 * H + (rank == 1)):
        for i, p in enumerate(params):
            p.grad = _grad(rank, step, i)
        if rank == 1 and step == 1:
            continue
        before = diloco.rounds
        inner.step()
        if diloco.rounds > before:
            rounds.append(_numpy(params))
    return rounds


def test_a_rank_a_step_behind_still_meets_the_others():
    results = run_workers(_one_rank_skips_an_inner_step, 3, timeout=120)
    assert all(len(r) == 2 for r in results)
    for r in range(2):
        assert _same(results[0][r], results[1][r]) and _same(results[0][r], results[2][r])


def _warmup_with_missing_grads(rank, world):
    """Three warmup steps of inner AdamW (weight decay on): param 0 has a
    gradient on every rank, param 1 only on rank 0, param 2 on none."""
    import onebit

    params = [torch.nn.Parameter(torch.full((5,), 1.0 + i)) for i in range(3)]
    inner = torch.optim.AdamW(params, lr=0.1, weight_decay=0.5)
    diloco = onebit.DiLoCo(params, inner, sync_every=H, warmup_steps=3, timeout_s=30)
    seen = []  # the grads the inner step takes: a pre-hook that runs after DiLoCo's
    inner.register_step_pre_hook(lambda *_: seen.append(  # numpy: tensors would not
        [None if p.grad is None else p.grad.numpy().copy() for p in params]))  # outlive us
    for step in range(3):
        inner.zero_grad()
        params[0].grad = torch.full((5,), 3.0 * (rank + 1))  # shares of 3 ranks: exact
        if rank == 0:
            params[1].grad = torch.full((5,), 6.0)
        inner.step()
    diloco.close()
    return seen, _numpy(params), [len(inner.state[p]) for p in params]


def test_the_warmup_averages_grads_as_ddp_does_with_missing_ones():
    world = 3
    results = run_workers(_warmup_with_missing_grads, world, timeout=120)
    for seen, final, states in results:
        assert len(seen) == 3
        for grads in seen:
            assert np.array_equal(grads[0], np.full(5, 6.0, np.float32))  # (3 + 6 + 9) / 3
            assert np.array_equal(grads[1], np.full(5, 2.0, np.float32))  # 6 / 3: 0 elsewhere
            assert grads[2] is None  # no rank has one: it keeps none, as under DDP
        assert states[2] == 0 and np.array_equal(final[2], np.full(5, 3.0, np.float32))
        assert states[0] > 0 and states[1] > 0
    assert all(_same(r[1], results[0][1]) for r in results[1:])


def _disagree(rank, world, what):
    import onebit

    shapes = SIZES if not (what == "params" and rank == 2) else SIZES[:-1]
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    sync_every = H + (rank == 1 and what == "sync_every")
    fragments = 1 + (rank == 0 and what == "fragments")
    # a schedule that differs only after a few rounds, on one rank
    later = onebit.SteppedOuterLR(1.3, 2.0, 5 * H + (rank == 2 and what == "outer_lr") * H)
    with pytest.raises(ValueError) as err:
        onebit.DiLoCo(params, torch.optim.SGD(params, lr=0.1), sync_every=sync_every,
                      fragments=fragments, outer_lr=later, timeout_s=30)
    return str(err.value)


@pytest.mark.parametrize("what, named", [("sync_every", "sync_every"),
                                         ("params", "the synced parameters"),
                                         ("fragments", "fragments, overlap_steps, "
                                                        "keep_local_progress and "
                                                        "fragment_update_alpha"),
                                         ("outer_lr", "outer optimizer")])
def test_ranks_that_disagree_get_a_clear_error_on_every_rank(what, named):
    for message in run_workers(_disagree, 3, what, timeout=60):
        assert f"DiLoCo: ranks disagree on {named}" in message


def _schedule_apart_after_the_checked_landings(rank, world, overlap):
    """A schedule that differs on rank 1 only from inner step 141, after the
    construction compared the first 65 landings' values (to step 130)."""
    import onebit

    params = [torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(3))]
    inner = torch.optim.SGD(params, lr=0.1)
    later = onebit.SteppedOuterLR(1.0, 1.5, 140 + (rank == 1))
    diloco = onebit.DiLoCo(params, inner, sync_every=2, overlap_steps=overlap,
                           fragments=2 if overlap else 1, outer_lr=later, timeout_s=30)
    for step in range(1, 160):
        for p in params:
            p.grad = torch.full(p.shape, rank + 1.0)
        try:
            inner.step()
        except ValueError as err:
            return step, str(err), diloco.rounds, [a.tolist() for a in diloco.anchors]
    return None


@pytest.mark.slow  # 140 rounds on 3 ranks
@pytest.mark.parametrize("overlap", [0, 1])
def test_a_schedule_that_differs_after_the_checked_landings_is_refused_at_that_round(overlap):
    """The round whose landing reads the schedule where the ranks differ
    raises on every rank, before its outer step: its lr is in the round's
    agreement (before, only the construction's 65 landings were compared,
    and the anchors drifted apart after them)."""
    out = run_workers(_schedule_apart_after_the_checked_landings, 3, overlap, timeout=120)
    assert all(r is not None for r in out), out
    # the round that lands at inner step 140 (streaming: its agreement runs
    # on the communication thread, and its error comes out at the landing)
    assert [r[0] for r in out] == [140] * 3
    assert all("ranks disagree on the outer optimizer's settings" in r[1] for r in out)
    assert len({r[2] for r in out}) == 1 and all(r[3] == out[0][3] for r in out)


def _schedule_that_ends_with_the_run(rank, world, overlap, lag):
    """An outer lr that decays linearly to 0 at the run's last inner step
    (12), and goes negative after it. `lag`: rank 1 skips its inner step
    at iteration 4 (as torch's GradScaler does after an inf on that rank
    alone), so it ends a step behind."""
    import onebit

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(40))]
    inner = torch.optim.SGD(params, lr=0.1)
    diloco = onebit.DiLoCo(params, inner, sync_every=3, overlap_steps=overlap,
                           outer_lr=lambda steps: 1.3 * (1 - steps / 12), timeout_s=30)
    for step in range(12):
        params[0].grad = torch.randn(40, generator=torch.Generator().manual_seed(100 * rank + step))
        if lag and rank == 1 and step == 4:
            continue
        inner.step()
    diloco.close()
    return diloco.rounds, params[0].tolist(), diloco.anchors[0].tolist()


@pytest.mark.parametrize("lag", [False, True], ids=["in step", "a rank behind"])
@pytest.mark.parametrize("overlap", [0, 1, 2])
def test_a_schedule_that_ends_with_the_run_lands_every_round(overlap, lag):
    """The last launch of a streaming run lands past the schedule's end in
    the schedule (its launch plus overlap_steps), and close() proposes one
    more round that no rank makes: neither may read the schedule there and
    fail. The last round lands in close(), the peers' in drain() and a
    rank behind's in its catch-up, at one lr on every rank: the one at its
    launch step (0 at step 12: the params go back to the last anchors)."""
    out = run_workers(_schedule_that_ends_with_the_run, 3, overlap, lag, timeout=120)
    assert [r[0] for r in out] == [4] * 3
    assert all(r[1] == out[0][1] and r[2] == out[0][2] for r in out)
    assert out[0][1] == out[0][2]  # on the anchors


def _resumed_apart_in_the_warmup(rank, world):
    """Each rank loads another checkpoint inside a 6-step warmup: inner
    step 2 on rank 0, 3 on rank 1."""
    import onebit

    params = [torch.nn.Parameter(torch.ones(5))]
    inner = torch.optim.SGD(params, lr=0.1)
    diloco = onebit.DiLoCo(params, inner, sync_every=2, warmup_steps=6, timeout_s=30)
    state = diloco.state_dict()
    state["inner_steps"] = 2 + rank
    diloco.load_state_dict(state)
    params[0].grad = torch.full((5,), rank + 1.0)
    try:
        inner.step()
    except ValueError as err:
        return str(err), params[0].tolist(), diloco.inner_steps
    return None


def test_ranks_resumed_apart_inside_the_warmup_raise_at_its_first_average():
    """The warmup's average paired their gradients of different steps with
    no error, until a rank that reached the rounds made another collective
    than its peer (a timeout). The first average after a load now checks
    the ranks' inner steps first (one all-reduce of two numbers): every
    rank raises, nothing stepped."""
    out = run_workers(_resumed_apart_in_the_warmup, 2, timeout=60)
    for rank, result in enumerate(out):
        assert result is not None
        message, param, steps = result
        assert "ranks resumed at different inner steps of the warmup (2 to 3" in message, message
        assert param == [1.0] * 5 and steps == 2 + rank


def _dies_at_round_two(rank, world, overlap=0):
    """Rank 1 dies before the inner step that launches round 2; with
    `overlap` the others meet the failure when its outer step lands."""
    import onebit

    params = [torch.nn.Parameter(x) for x in _init()]
    inner = torch.optim.SGD(params, lr=INNER_LR)
    onebit.DiLoCo(params, inner, sync_every=H, block_size=BLOCK, timeout_s=4.0,
                  overlap_steps=overlap)
    landing = 2 * H - 1 + overlap
    for step in range(landing + 1):
        for i, p in enumerate(params):
            p.grad = _grad(rank, step, i)
        if rank == 1 and step == 2 * H - 1:
            os.kill(os.getpid(), signal.SIGKILL)
        if step < landing:
            inner.step()
            continue
        start = time.monotonic()
        with pytest.raises(onebit.CommunicationError) as err:
            inner.step()
        return str(err.value), time.monotonic() - start


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [0, 1])
def test_a_dead_rank_is_a_timely_communication_error(overlap):
    results = run_workers(_dies_at_round_two, 3, overlap, timeout=90, may_die=(1,))
    for rank in (0, 2):
        message, waited = results[rank]
        assert "DiLoCo" in message and waited < 4.0 + 6.0, (message, waited)


def test_bad_arguments_are_refused_by_name():
    import onebit

    p = [torch.nn.Parameter(torch.zeros(3))]
    for kwargs, match in (({"sync_every": 0}, "sync_every"), ({"compression": "int8"}, "compression"),
                          ({"outer_momentum": 1.0}, "outer_momentum"),
                          ({"outer_momentum": 0.0, "nesterov": True}, "nesterov=True needs"),
                          ({"warmup_steps": -1}, "warmup_steps"), ({"fragments": 0}, "fragments"),
                          ({"fragments": 2}, "fragments=2 exceeds the 1 synced parameters"),
                          ({"overlap_steps": 2}, "overlap_steps=2 must be below sync_every=2"),
                          ({"overlap_steps": -1}, "overlap_steps"),
                          ({"fragment_update_alpha": 1.5}, "fragment_update_alpha"),
                          ({"fragment_update_alpha": 0.5, "keep_local_progress": 0.5},
                           "set one of them, not both"),
                          ({"outer_lr": lambda inner_steps: -1.0}, "outer_lr"),
                          ({"compression": "sparse2bit", "topk": 0}, "topk"),
                          ({"compression": "sparse2bit", "topk": 5000}, "block_size=4096"),
                          ({"compression": "sparse2bit", "topk": 300, "block_size": 256},
                           "block_size=256"),
                          ({"compression": "sparse2bit", "topk": 2.5}, "topk"),
                          ({"error_decay": 0.0}, "error_decay"),
                          ({"error_decay": 1.5}, "error_decay")):
        with pytest.raises(ValueError, match=match):
            onebit.DiLoCo(p, torch.optim.SGD(p, lr=0.1), **{"sync_every": 2, **kwargs})


def test_one_process_is_local_sgd_with_an_outer_step():
    """World size 1: the average is the rank's own pseudo-gradient."""
    import onebit

    params = [torch.nn.Parameter(x.clone()) for x in _init()]
    inner = torch.optim.SGD(params, lr=INNER_LR)
    with onebit.DiLoCo(params, inner, sync_every=H, outer_lr=1.0, outer_momentum=0.0,
                       nesterov=False) as diloco:
        for step in range(H):
            for i, p in enumerate(params):
                p.grad = _grad(0, step, i)
            inner.step()
    # outer lr 1, no momentum: exactly the inner steps' end point (up to fp32)
    want = [x - INNER_LR * sum(_grad(0, s, i) for s in range(H)) for i, x in enumerate(_init())]
    assert all(torch.allclose(p, w, atol=1e-6) for p, w in zip(params, want))
    assert diloco.rounds == 1
    inner.step()  # closed: no more rounds
    assert diloco.inner_steps == H


def test_a_schedule_that_turns_bad_raises_before_the_anchors_change():
    import onebit

    p = [torch.nn.Parameter(torch.ones(5))]
    inner = torch.optim.SGD(p, lr=0.1)
    diloco = onebit.DiLoCo(p, inner, sync_every=2,
                           outer_lr=lambda steps: 1.3 if steps < 4 else float("nan"))
    for _ in range(2):  # the first round lands at lr 1.3
        p[0].grad = torch.ones(5)
        inner.step()
    anchors = diloco.anchors[0].clone()
    assert not torch.equal(anchors, torch.ones(5))
    p[0].grad = torch.ones(5)
    inner.step()
    p[0].grad = torch.ones(5)
    with pytest.raises(ValueError, match="outer_lr"):
        inner.step()
    assert torch.equal(diloco.anchors[0], anchors) and diloco.rounds == 1


def _ddp_around_the_model(rank, world):
    import onebit

    model = torch.nn.Linear(4, 2)
    messages = []
    with pytest.raises(ValueError) as err:  # handed the wrapper itself
        onebit.DiLoCo(torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2)),
                      torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2)
    messages.append(str(err.value))
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    diloco = onebit.DiLoCo(model, inner, sync_every=2)
    ddp = torch.nn.parallel.DistributedDataParallel(model)  # wrapped afterwards
    with pytest.raises(ValueError) as err:
        ddp(torch.ones(3, 4)).sum().backward()
    messages.append(str(err.value))
    return messages


def test_a_ddp_wrapper_around_the_model_is_refused():
    """DDP would all-reduce every step in full precision: DiLoCo saves
    nothing. Refused when handed the wrapper, and at the first forward when
    the model is wrapped after DiLoCo was built."""
    for messages in run_workers(_ddp_around_the_model, 2, timeout=60):
        for m in messages:
            assert "DistributedDataParallel" in m and "no DDP wrapper" in m, m


def test_an_inner_optimizer_built_again_after_diloco_is_refused():
    """A second optimizer over the same params steps them without DiLoCo's
    hooks: no round would ever run. With a module, the second forward after
    such a step raises; with a list of params, sync() does. A model loaded
    after DiLoCo was built (before the first forward) is setup, not misuse."""
    import onebit

    model = torch.nn.Linear(4, 2)
    diloco = onebit.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2)
    with torch.no_grad():
        model.weight.fill_(0.5)  # before the first forward: setup
    rebuilt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(3, 4)).sum().backward()
    rebuilt.step()
    with pytest.raises(ValueError, match="counted no inner step"):
        model(torch.ones(3, 4))
    with pytest.raises(ValueError, match="counted no inner step"):
        diloco.close()

    params = [torch.nn.Parameter(torch.ones(3))]
    diloco = onebit.DiLoCo(params, torch.optim.SGD(params, lr=0.1), sync_every=2)
    params[0].grad = torch.ones(3)
    torch.optim.SGD(params, lr=0.1).step()
    with pytest.raises(ValueError, match="an optimizer it does not hook"):
        diloco.sync()

    # The inner optimizer DiLoCo hooks, and writes of its own: no error.
    model = torch.nn.Linear(4, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with onebit.DiLoCo(model, inner, sync_every=2) as diloco:
        for _ in range(5):
            model(torch.ones(3, 4)).sum().backward()
            inner.step()
            inner.zero_grad()
            with torch.no_grad():
                model.weight.clamp_(-1, 1)  # the script's own edit after a counted step
        assert diloco.sync() and diloco.rounds == 3


def test_dilocos_own_landings_before_any_inner_step_are_no_misuse():
    """sync() lands rounds before an inner step is counted (an evaluation
    forward, then sync(); a resumed run synced at once): its own writes must
    not read as another optimizer's, while a write after them still does."""
    import onebit

    model = torch.nn.Linear(4, 2)
    diloco = onebit.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=4)
    model(torch.ones(3, 4))
    assert diloco.sync()
    model(torch.ones(3, 4))  # raised "counted no inner step" before
    params = [torch.nn.Parameter(torch.randn(5))]
    diloco = onebit.DiLoCo(params, torch.optim.SGD(params, lr=0.1), sync_every=4)
    assert diloco.sync() and diloco.sync() and diloco.rounds == 2
    assert len(diloco.state_dict()["anchors"]) == 1
    params[0].grad = torch.ones(5)
    torch.optim.SGD(params, lr=0.1).step()  # another optimizer, after the landings
    with pytest.raises(ValueError, match="an optimizer it does not hook"):
        diloco.sync()


def _unfreezes_a_layer_diloco_left_out(rank, world):
    import onebit

    torch.manual_seed(0)
    body, head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    head.requires_grad_(False)  # frozen when DiLoCo is built
    model = torch.nn.Sequential(body, head)
    inner = torch.optim.AdamW(model.parameters(), lr=0.1)
    diloco = onebit.DiLoCo(model, inner, sync_every=2, timeout_s=60)
    g = torch.Generator().manual_seed(rank)
    for step in range(1, 5):
        if step == 3:
            head.requires_grad_(True)
        before = [p.detach().clone() for p in model.parameters()]
        inner.zero_grad()
        model(torch.randn(8, 4, generator=g)).pow(2).mean().backward()
        try:
            inner.step()
        except ValueError as exc:
            unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
            return step, str(exc), unchanged
    return None, "", False


def test_a_layer_frozen_when_diloco_was_built_and_unfrozen_later_is_refused():
    """The rounds sync the params that required grad at construction: the
    head unfrozen later trained on each rank apart, never synced (0.02
    apart after every round). Now the inner step refuses, on every rank."""
    for step, message, unchanged in run_workers(_unfreezes_a_layer_diloco_left_out, 2,
                                                timeout=60):
        assert step == 3 and "2 param(s) frozen when DiLoCo was built" in message, message
        assert unchanged


def _diloco_apart(rank, world, case):
    import onebit

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    if case == "frozen layers":  # the same shapes, another layer on each rank
        model[rank % 2].requires_grad_(False)
    inner = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    outer_lr = (onebit.SteppedOuterLR(1.0, 2.0, from_step=1 if rank == 0 else 3)
                if case == "outer lr" else 1.0)
    try:
        compression = "bf16" if case == "compression" and rank == 1 else "1bit"
        wire = {}
        if case == "topk":  # the same sparse code, another density on each rank
            compression, wire = "sparse2bit", {"topk": 4 + rank}
        diloco = onebit.DiLoCo(model, inner, sync_every=4, fragments=2, outer_lr=outer_lr,
                               compression=compression, timeout_s=30, **wire)
        g = torch.Generator().manual_seed(rank)
        for step in range(1, 9):  # the peer's loop launches fragment 1 after step 4
            inner.zero_grad()
            model(torch.randn(2, 4, generator=g)).pow(2).mean().backward()
            inner.step()
            if case == "sync on one rank" and rank == 0 and step == 3:
                diloco.sync()  # fragment 0 here, while the peer's loop launches fragment 1
            if case == "frozen mid-run on one rank" and rank == 0 and step == 1:
                model[0].requires_grad_(False)
            if case == "outer lr set on one rank" and rank == 0 and step == 1:
                diloco.outer_optimizer.param_groups[0]["lr"] = 0.5
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("case, says", [
    ("sync on one rank", "ranks exchange different fragments [0, 1]"),
    # differs at the landings of fragment 0 only (inner steps 2, 6, ...)
    ("outer lr", "ranks disagree on outer optimizer"),
    ("frozen layers", "ranks disagree on the synced parameters (which of the model's"),
    ("frozen mid-run on one rank", "ranks freeze different synced params at outer exchange 1"),
    ("outer lr set on one rank", "ranks disagree on the outer optimizer's settings at outer "
                                 "exchange 1"),
    # the backend's name is agreed first, in a collective every rank makes
    ("compression", "ranks disagree on compression and wire format"),
    ("topk", "ranks disagree on compression and wire format"),
])
def test_diloco_ranks_apart_raise_on_every_rank(case, says):
    """Each of these let the replicas drift apart with no error."""
    for message in run_workers(_diloco_apart, 2, case, timeout=60):
        assert says in message, message


def _backend_named_apart(rank, world, names):
    """Each rank names the same backend its own way: None (the default),
    DeepSpeed's "nccl", "compressed"; the 2-bit wire too."""
    import onebit

    name, compression = names[rank]
    torch.manual_seed(rank)
    model = torch.nn.Linear(4, 4)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    diloco = onebit.DiLoCo(model, inner, sync_every=2, compression=compression,
                           comm_backend_name=name, timeout_s=30)
    g = torch.Generator().manual_seed(rank)
    for _ in range(4):
        inner.zero_grad()
        model(torch.randn(2, 4, generator=g)).pow(2).mean().backward()
        inner.step()
    return diloco.rounds, [p.detach().reshape(-1).tolist() for p in model.parameters()]


@pytest.mark.slow
@pytest.mark.parametrize("names", [[(None, "1bit"), ("nccl", "1bit")],
                                   [("compressed", "1bit"), (None, "1bit")],
                                   [(None, "2bit"), ("compressed", "2bit")],
                                   [("hierarchical", "bf16"), (None, "bf16")]])
def test_diloco_ranks_naming_one_backend_apart_agree(names):
    """The fingerprint compared the names as given: None against
    "compressed" (the same backend) raised that the ranks disagree. (A
    bf16 or fp32 round uses no compressed backend: its name is moot.)"""
    (rounds, params), (rounds1, params1) = run_workers(_backend_named_apart, 2, names,
                                                       timeout=60)
    assert rounds == rounds1 == 2
    assert params == params1


def _backends_apart(rank, world):
    try:
        _backend_named_apart(rank, world, [("compressed", "1bit"), ("hierarchical", "1bit")])
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.slow
def test_diloco_ranks_naming_two_backends_raise_on_every_rank():
    for message in run_workers(_backends_apart, 2, timeout=60):
        assert "ranks disagree on compression and wire format" in message, message


def _freezes_a_layer_mid_run(rank, world, compression, overlap, freeze_at):
    """The bottom layer frozen before inner step `freeze_at` (a round every
    2 inner steps; with overlap, each lands 1 step after its launch): the
    bottom and top layers after every inner step."""
    import onebit

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    inner = torch.optim.AdamW(model.parameters(), lr=0.05)
    diloco = onebit.DiLoCo(model, inner, sync_every=2, compression=compression,
                           outer_lr=0.7, outer_momentum=0.9, nesterov=True,
                           overlap_steps=overlap, timeout_s=30)
    g = torch.Generator().manual_seed(rank)
    bottom, top = [], []
    for step in range(1, 13):
        if step == freeze_at:
            model[0].requires_grad_(False)
        inner.zero_grad()
        model(torch.randn(8, 4, generator=g)).pow(2).mean().backward()
        inner.step()
        bottom.append(model[0].weight.detach().reshape(-1).tolist())
        top.append(model[1].weight.detach().reshape(-1).tolist())
    diloco.drain()  # (with overlap, the round launched at step 12 lands here)
    bottom.append(model[0].weight.detach().reshape(-1).tolist())
    top.append(model[1].weight.detach().reshape(-1).tolist())
    return bottom, top


@pytest.mark.slow
@pytest.mark.parametrize("compression", ["1bit", "sparse2bit", "bf16", "none"])
@pytest.mark.parametrize("overlap, freeze_at, still_from, synced_at", [
    (0, 5, 4, 4),  # frozen at a landing (after step 4): stays where it was
    (0, 4, 4, 2),  # trained at step 3 after the landing at 2: back to that point at 4
    (1, 6, 5, 5),  # streaming: launched at 6 frozen, landed at 7
    (1, 5, 5, 5),  # launched at 4 trainable: its outer step lands at 5, then it stays
])
def test_a_layer_frozen_mid_run_stays_at_its_last_synced_point(compression, overlap, freeze_at,
                                                                still_from, synced_at):
    """The outer step moved a layer frozen mid-run: its anchor kept the
    outer momentum (0.7 apart in 4 rounds, and growing), and 1-bit rounds
    sent the error feedback's residual. A round launched with the layer
    frozen now leaves its anchor as it is, and sets the layer to it: bitwise
    still when it was frozen at a landing, back to the last synced point
    when it had trained since (each rank's own steps), as 0/1 Adam does
    between syncs. The other layer trains; every rank holds the same
    params after each landing."""
    out = run_workers(_freezes_a_layer_mid_run, 2, compression, overlap, freeze_at, timeout=60)
    (bottom, top), (bottom1, top1) = out
    assert bottom[still_from - 1:] == [bottom[synced_at - 1]] * (14 - still_from)
    assert bottom[-1] == bottom1[-1] and top[-1] == top1[-1]
    assert top[-1] != top[still_from - 1]  # the top layer still trains


def _frozen_while_in_flight(rank, world, resume):
    """Streaming DiLoCo (a round every 2 inner steps, landing 1 step after
    its launch): the bottom layer is frozen before inner step 5, after the
    launch at 4 and before its landing. Straight, or saved after step 4
    (that round in flight) and resumed in fresh objects."""
    import onebit

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        inner = torch.optim.AdamW(model.parameters(), lr=0.05)
        return model, inner, onebit.DiLoCo(model, inner, sync_every=2, overlap_steps=1,
                                           outer_lr=0.7, outer_momentum=0.9, timeout_s=30)

    def train(model, inner, steps):
        for step in steps:
            if step == 5:
                model[0].requires_grad_(False)
            inner.zero_grad()
            g = torch.Generator().manual_seed(100 * step + rank)
            model(torch.randn(8, 4, generator=g)).pow(2).mean().backward()
            inner.step()

    model, inner, diloco = build()
    train(model, inner, range(1, 5 if resume else 11))
    if resume:
        saved = copy.deepcopy((model.state_dict(), inner.state_dict(), diloco.state_dict(),
                               diloco.error_feedback_state_dict()))
        diloco.close()
        model, inner, diloco = build()
        model.load_state_dict(saved[0])
        inner.load_state_dict(saved[1])
        diloco.load_state_dict(saved[2])
        assert diloco.load_error_feedback_state_dict(saved[3])
        train(model, inner, range(5, 11))
    diloco.drain()
    return [p.detach().reshape(-1).tolist() for p in model.parameters()]


@pytest.mark.slow
def test_a_resume_with_a_round_launched_before_a_freeze_is_bitwise_identical():
    """The round in flight was launched with the layer trainable: its
    landing gives it the outer step. Restored from a checkpoint, it decided
    at the landing, where the layer was frozen, and skipped it."""
    straight = run_workers(_frozen_while_in_flight, 2, False, timeout=60)
    resumed = run_workers(_frozen_while_in_flight, 2, True, timeout=60)
    assert resumed == straight


def _warmup_with_a_skipped_step(rank, world):
    """Rank 1 skips its first inner step (as torch's GradScaler does on the
    rank that overflowed alone) and takes one more iteration to make up."""
    import onebit

    params = [torch.nn.Parameter(torch.ones(5))]
    inner = torch.optim.SGD(params, lr=0.1)
    diloco = onebit.DiLoCo(params, inner, sync_every=H, warmup_steps=8, timeout_s=30)
    for it in range(4 if rank == 1 else 3):
        params[0].grad = torch.full((5,), float(10 * rank + it))
        if rank == 1 and it == 0:
            continue  # skipped here alone: no inner step, no average
        inner.step()
    diloco.close()
    return params[0].detach().numpy().copy(), diloco.inner_steps


def test_a_rank_that_skips_a_warmup_step_joins_the_next_average_from_the_same_params():
    """The others wait in the average for it; it arrives an iteration later
    with a gradient taken at the same params, and every rank applies the same
    mean: rank 0's iterations 0-2 with rank 1's 1-3 and rank 2's 0-2."""
    out = run_workers(_warmup_with_a_skipped_step, 3, timeout=120)
    want = np.ones(5, np.float64)
    for k in range(3):  # SGD with lr 0.1 on the mean of the paired gradients
        want -= 0.1 * (k + (10 + k + 1) + (20 + k)) / 3
    for final, steps in out:
        assert steps == 3 and np.allclose(final, want, rtol=0, atol=1e-5)
        assert np.array_equal(final, out[0][0])


def _weights_loaded_after_diloco_is_built(rank, world):
    """A pretrained model loaded after DiLoCo(...) and before the first
    forward: with the inner lr at 0 nothing trains, so a round must leave
    the loaded weights exactly where they are (the anchors follow them),
    and a checkpoint taken before any forward is no misuse."""
    import onebit

    torch.manual_seed(rank)  # the ranks' inits differ; the construction broadcasts rank 0's
    model = torch.nn.Linear(4, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.0)
    diloco = onebit.DiLoCo(model, inner, sync_every=2, outer_lr=1.3)
    loaded = {"weight": torch.full((2, 4), 0.25), "bias": torch.tensor([-1.0, 2.0])}
    model.load_state_dict(loaded)  # the same file on every rank
    saved = diloco.state_dict()  # before any forward: setup, not another optimizer
    for _ in range(4):
        model(torch.ones(3, 4)).sum().backward()
        inner.step()
        inner.zero_grad()
    diloco.close()
    return (diloco.rounds, [p.detach().tolist() for p in model.parameters()],
            [a.tolist() for a in saved["anchors"]])


@pytest.mark.parametrize("world", [1, 2])
def test_weights_loaded_after_diloco_is_built_are_where_the_rounds_start(world):
    for rounds, params, saved in run_workers(_weights_loaded_after_diloco_is_built, world,
                                             timeout=60):
        assert rounds == 2
        assert params == [[[0.25] * 4] * 2, [-1.0, 2.0]]  # not pulled back to the init
        assert saved[0] == [[0.25] * 4] * 2, "the saved anchors"


def test_a_model_loaded_after_diloco_state_keeps_the_checkpoints_anchors():
    """After DiLoCo.load_state_dict the anchors are the checkpoint's: params
    loaded next (mid-round, so not equal to them) must not move them, and
    close() before any forward (a run resumed at its end) is no misuse."""
    import onebit

    model = torch.nn.Linear(4, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    diloco = onebit.DiLoCo(model, inner, sync_every=4)
    for _ in range(6):  # a round and a half: the params are mid-round
        model(torch.ones(3, 4)).sum().backward()
        inner.step()
        inner.zero_grad()
    state, weights = diloco.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}
    diloco.close()

    model = torch.nn.Linear(4, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    resumed = onebit.DiLoCo(model, inner, sync_every=4)
    resumed.load_state_dict(state)
    model.load_state_dict(weights)
    assert not torch.equal(resumed.anchors[0], model.weight.detach())
    resumed.close()  # no forward since the load: setup, not another optimizer
    assert all(torch.equal(a, b) for a, b in zip(resumed.anchors, state["anchors"]))


def test_a_closed_diloco_refuses_sync_and_a_second_close_does_nothing():
    import onebit

    params = [torch.nn.Parameter(torch.ones(3))]
    inner = torch.optim.SGD(params, lr=0.1)
    diloco = onebit.DiLoCo(params, inner, sync_every=2)
    diloco.close()
    diloco.close()
    with pytest.raises(ValueError, match="this DiLoCo is closed"):
        diloco.sync()
    assert diloco.launches == 0 and diloco.rounds == 0


def test_a_parameter_listed_twice_or_named_pairs_are_refused():
    """A tensor listed twice would get two anchors (and, in two fragments,
    two outer steps a round); named_parameters() pairs are not params."""
    import onebit

    model = torch.nn.Linear(4, 2)
    with pytest.raises(ValueError, match="is the same tensor as param 0"):
        onebit.DiLoCo([model.weight, model.bias, model.weight],
                      torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2, fragments=2)
    with pytest.raises(ValueError, match="got an element of type tuple"):
        onebit.DiLoCo(model.named_parameters(), torch.optim.SGD(model.parameters(), lr=0.1),
                      sync_every=2)


# ------------------------------------------------ the end of a loop between rounds --
END_H, END_STEPS = 4, 15  # rounds after steps 4, 8 and 12: the loop ends 3 steps past the last


def _ends_between_rounds(rank, world, sync, steps=END_STEPS, fragments=1, overlap=0, alpha=0.0,
                         behind=False, outer_lr=1.3):
    """A loop of `steps` inner steps at sync_every=4, then close(sync=sync):
    this rank's params, rounds and bytes sent. `behind`: rank 1 skips its
    inner step at step 1, as torch's GradScaler does after an inf there
    alone, and so ends a step short."""
    import onebit

    params = [torch.nn.Parameter(x) for x in _init()]
    inner = torch.optim.SGD(params, lr=INNER_LR)
    diloco = onebit.DiLoCo(params, inner, sync_every=END_H, block_size=BLOCK, timeout_s=30,
                           fragments=fragments, overlap_steps=overlap,
                           fragment_update_alpha=alpha, outer_lr=outer_lr)
    for step in range(steps):
        for i, p in enumerate(params):
            p.grad = _grad(rank, step, i)
        if behind and rank == 1 and step == 1:
            continue
        inner.step()
    sent = diloco.comm_stats()["total_bytes_sent"]
    diloco.close(sync=sync)
    return _numpy(params), diloco.rounds, diloco.comm_stats()["total_bytes_sent"] - sent


def _simulate_the_end(world, steps, final_round):
    """float64: each rank's own SGD steps, a 1-bit round (errors carried,
    tests/reference.py) after every 4th step with plain outer SGD at 1.3,
    and with `final_round` one more round after the last step."""
    anchor = [x.double().numpy().reshape(-1) for x in _init()]
    params = [[a.copy() for a in anchor] for _ in range(world)]
    n = reference.placement([a.size for a in anchor], BLOCK, world)[1]
    worker, server = [np.zeros(n)] * world, [np.zeros(n // world)] * world

    def round_():
        nonlocal anchor, worker, server
        deltas = [[a - p for a, p in zip(anchor, params[r])] for r in range(world)]
        avg, worker, server, _ = reference.reference_round(deltas, worker, server, BLOCK)
        anchor = [a - 1.3 * g for a, g in zip(anchor, avg)]
        for r in range(world):
            params[r] = [a.copy() for a in anchor]

    for step in range(steps):
        for r in range(world):
            params[r] = [p - INNER_LR * _grad(r, step, i).double().numpy().reshape(-1)
                         for i, p in enumerate(params[r])]
        if (step + 1) % END_H == 0:
            round_()
    if final_round:
        round_()
    return params


def _flat(arrays):
    return np.concatenate([np.asarray(a, dtype=np.float64).reshape(-1) for a in arrays])


def test_close_ends_between_rounds_with_the_ranks_apart_and_close_sync_on_one_point():
    """15 inner steps at sync_every=4: close() leaves every rank 3 steps of
    its own past the last round (as docs/usage.md says), and close(sync=True)
    makes a fourth round there: every rank bitwise on one point, the
    float64 simulation's."""
    world = 3
    apart = run_workers(_ends_between_rounds, world, False, timeout=120)
    assert all(rounds == 3 and sent == 0 for _, rounds, sent in apart)
    assert not _same(apart[0][0], apart[1][0]) and not _same(apart[0][0], apart[2][0])
    want = _simulate_the_end(world, END_STEPS, final_round=False)
    for rank in range(world):
        got, expected = _flat(apart[rank][0]), _flat(want[rank])
        assert np.max(np.abs(got - expected)) / np.max(np.abs(expected)) < 2e-4

    synced = run_workers(_ends_between_rounds, world, True, timeout=120)
    assert all(rounds == 4 and sent > 0 for _, rounds, sent in synced)
    for rank in range(1, world):
        assert _same(synced[0][0], synced[rank][0]), f"rank {rank} ends elsewhere"
    want = _simulate_the_end(world, END_STEPS, final_round=True)
    assert all(_same(want[0], want[r]) for r in range(world))  # the simulation agrees
    got, expected = _flat(synced[0][0]), _flat(want[0])
    assert np.max(np.abs(got - expected)) / np.max(np.abs(expected)) < 2e-4


def test_close_sync_at_a_round_boundary_sends_nothing_and_moves_nothing():
    """16 steps: the fourth round has landed, no rank moved since; close(sync=True)
    only agrees on that (no round, no byte) and every rank stays put."""
    plain = run_workers(_ends_between_rounds, 2, False, 16, timeout=120)
    synced = run_workers(_ends_between_rounds, 2, True, 16, timeout=120)
    for (got, rounds, sent), (want, _, _) in zip(synced, plain):
        assert rounds == 4 and sent == 0 and _same(got, want)


@pytest.mark.slow  # four cases, each two runs on 3 ranks
@pytest.mark.parametrize("fragments, overlap, alpha, behind, outer_lr", [
    (2, 1, 0.0, False, 1.3), (2, 1, 0.5, False, 1.3), (1, 0, 0.0, True, 1.3),
    (2, 0, 0.0, True, "stepped")])
def test_close_sync_ends_every_rank_on_one_point(fragments, overlap, alpha, behind, outer_lr):
    """Streaming fragments (one in flight at the end), fragment_update_alpha
    (whose landings leave the ranks apart), a rank a step behind (torch's
    GradScaler), and that rank under an outer lr schedule (read at the
    furthest rank's step, else the ranks' round settings differ): after
    close(sync=True) every rank holds the same params, bit for bit."""
    import onebit

    if outer_lr == "stepped":
        outer_lr = onebit.SteppedOuterLR(1.3, 2.0, END_STEPS)  # 2.0 at step 15 only
    world = 3
    apart = run_workers(_ends_between_rounds, world, False, END_STEPS, fragments, overlap, alpha,
                        behind, outer_lr, timeout=120)
    assert not _same(apart[0][0], apart[1][0])
    synced = run_workers(_ends_between_rounds, world, True, END_STEPS, fragments, overlap, alpha,
                         behind, outer_lr, timeout=120)
    for rank in range(1, world):
        assert _same(synced[0][0], synced[rank][0]), f"rank {rank} ends elsewhere"
    assert len({rounds for _, rounds, _ in synced}) == 1


def test_close_refuses_a_sync_that_is_no_flag():
    import onebit

    params = [torch.nn.Parameter(x) for x in _init()]
    diloco = onebit.DiLoCo(params, torch.optim.SGD(params, lr=INNER_LR), sync_every=END_H)
    with pytest.raises(ValueError, match="sync"):
        diloco.close(sync="yes")
