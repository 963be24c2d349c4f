"""overlap_backward: bucket exchanges started during backward give the same
bits as one fused exchange in step(), on real ranks, and lose nothing when a
step is skipped or refused.

The reference for "the same bits" is the same optimizer without overlap (the
fused exchange, itself checked against independent float64 simulations in
test_optim_dist.py); the third run also pipelines every bucket's exchange in
small pieces. The model looks like a real one: an embedding most of whose
rows a batch never touches, tensors whose scales differ by 1e4, and a head
that never gets a gradient."""
import collections
import warnings

import numpy as np
import pytest
import torch

from tests.distributed import run_workers

pytestmark = pytest.mark.slow  # multi-process bitwise comparisons at p = 2..4; the fast tier (-m "not slow") leaves these out

STEPS = {"OnebitAdam": 9, "OnebitLamb": 9, "ZeroOneAdam": 16}
STAGES = {"OnebitAdam": dict(freeze_step=3), "OnebitLamb": dict(freeze_step=3),
          # 1-bit gradient steps at 3, 5, 6, 7; syncs after 9
          "ZeroOneAdam": dict(var_freeze_step=9, var_update_scaler=1, local_step_scaler=2,
                              local_step_clipper=4)}


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(300, 12)  # a batch touches at most 24 rows
        self.hidden = torch.nn.Linear(12, 40)
        self.out = torch.nn.Parameter(torch.randn(40, 6) * 1e2)  # 1e4 x the embedding's scale
        self.emb.weight.data.mul_(1e-2)
        self.unused_head = torch.nn.Linear(40, 3)  # its .grad stays None: it must not move

    def forward(self, x):
        return torch.relu(self.hidden(self.emb(x).mean(1))) @ self.out * 1e-3


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randint(0, 300, (8, 3), generator=g), torch.randint(0, 6, (8,), generator=g)


def build(cls_name, mode, **kw):
    import onebit
    from onebit.backends.pipeline import PieceTuner

    torch.manual_seed(0)
    model = Model()
    opt = getattr(onebit, cls_name)(model.parameters(), lr=1e-2, weight_decay=1e-3,
                                    overlap_backward=mode != "fused",
                                    bucket_cap_mb=0.004, **STAGES[cls_name], **kw)
    if mode == "pipelined":
        opt.backend.pipeline = PieceTuner(256)  # every bucket in pieces of one block per rank
    return model, opt


def flat_params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()


def errors_of(opt):
    """Error-buffer key -> (worker, server) of every fused buffer so far."""
    return opt._channel.exchange.error_buffers()


def _train(rank, world, cls_name, mode):
    import torch.distributed as dist

    model, opt = build(cls_name, mode)
    head = flat_params(model.unused_head)
    per_step, in_backward = [], []
    for step in range(STEPS[cls_name]):
        x, y = batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        in_backward.append((opt.overlap_stats() or {}).get("launched_in_backward", 0))
        opt.step()
        mine = torch.from_numpy(flat_params(model))
        every = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(every, mine)
        # 0/1 Adam's ranks differ between syncs by design; they meet at each sync.
        if opt.last_stage.replicas_match:
            assert all(torch.equal(e, every[0]) for e in every), f"replicas differ at step {step + 1}"
        per_step.append(mine.numpy().copy())
    assert np.array_equal(flat_params(model.unused_head), head), "a param without grad moved"
    return per_step, dict(opt.overlap_stats() or {}, in_backward=in_backward)


@pytest.mark.parametrize("cls_name", ["OnebitAdam", "OnebitLamb", "ZeroOneAdam"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_bucketed_pipelined_and_fused_give_bitwise_identical_parameters(cls_name, world):
    runs = {mode: run_workers(_train, world, cls_name, mode, timeout=240)
            for mode in ("fused", "bucketed", "pipelined")}
    for mode in ("bucketed", "pipelined"):
        for rank, (steps, stats) in enumerate(runs[mode]):
            for t, (a, b) in enumerate(zip(runs["fused"][rank][0], steps)):
                assert np.array_equal(a, b), (f"{mode} differs from fused on rank {rank} after "
                                              f"step {t + 1}: max {np.abs(a - b).max()}")
            # Exchanges really started during backward, and the bucket of the
            # head that has no gradient was launched by step() on the first one.
            assert stats["launched_in_backward"] > 0 and stats["launched_in_step"] > 0, stats
            assert stats["redone"] == 0, stats
            if cls_name == "ZeroOneAdam":  # its syncs that follow a sync (11, 12) too
                frozen = STAGES[cls_name]["var_freeze_step"]
                assert stats["in_backward"][-1] > stats["in_backward"][frozen], stats
    assert "launched_in_backward" not in runs["fused"][0][1]  # no overlap, no stats
    assert not np.array_equal(runs["fused"][0][0][0], runs["fused"][0][0][-1])


def _lr_changed_after_backward(rank, world, mode):
    """A schedule that steps between backward and step(): 0/1 Adam's sync
    input bakes in lr, so what backward exchanged must be done again."""
    model, opt = build("ZeroOneAdam", mode)
    for step in range(STEPS["ZeroOneAdam"]):
        x, y = batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        for g in opt.param_groups:
            g["lr"] *= 0.9
        opt.step()
    return flat_params(model), opt.overlap_stats()


def test_zero_one_adam_sync_is_exchanged_again_when_lr_changes_after_backward():
    fused = run_workers(_lr_changed_after_backward, 2, "fused", timeout=180)
    bucketed = run_workers(_lr_changed_after_backward, 2, "bucketed", timeout=180)
    for (a, _), (b, stats) in zip(fused, bucketed):
        assert np.array_equal(a, b)
        assert stats["redone"] > 0 and stats["launched_in_backward"] > stats["redone"], stats


class CountingState(collections.defaultdict):
    """An optimizer's state dict that counts its lookups by param."""

    lookups = 0

    def __getitem__(self, key):
        self.lookups += 1
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.lookups += 1
        return super().get(key, default)


def _state_lookups_in_backward(rank, world):
    """0/1 Adam's syncs, 48 params in buckets of about one each: how many
    state lookups each backward makes, against the number of params."""
    import onebit

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(32)) for _ in range(48)]
    opt = onebit.ZeroOneAdam(params, lr=1e-2, weight_decay=1e-3, var_freeze_step=2,
                             overlap_backward=True, bucket_cap_mb=100 / 2**20)
    opt.state = CountingState(dict, opt.state)
    x = torch.randn(32, generator=torch.Generator().manual_seed(rank))
    per_backward, buckets = [], []
    for _ in range(6):
        opt.zero_grad()
        loss = sum((p * x).sum() * (k + 1) for k, p in enumerate(params))
        launched, before = opt.overlap_stats()["launched_in_backward"], opt.state.lookups
        loss.backward()
        per_backward.append(opt.state.lookups - before)
        buckets.append(opt.overlap_stats()["launched_in_backward"] - launched)
        opt.step()
    return per_backward, buckets, len(params)


def test_a_bucket_input_looks_up_its_own_params_state_not_the_groups():
    """Written during backward, each bucket's sync input looked up the state
    of every trained param of its group: buckets x params lookups per
    backward (on 2000 small tensors in many buckets, the host's time grew
    with both). Now the group's v is read only when the caches of the
    frozen v miss."""
    for per_backward, buckets, n in run_workers(_state_lookups_in_backward, 2, timeout=120):
        assert min(buckets[3:]) >= n // 2, buckets  # many buckets launched in backward
        # Syncs with warm caches: the buckets' own params' states, a few per param.
        assert max(per_backward[3:]) <= 3 * n, per_backward


def _nonfinite_on_one_rank(rank, world, use_scaler):
    """Rank 1's gradient is inf at a compressed step (without a scaler:
    after the buckets were exchanged): params, state and error buffers must
    be as before."""
    model, opt = build("OnebitAdam", "bucketed")
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0) if use_scaler else None
    outcome = []
    for step in range(6):
        x, y = batch(rank, step)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        if step == 4 and rank == 1:
            loss = loss * float("inf")
        if step == 4:
            before = (flat_params(model), {k: v.clone() for k, v in
                                           ((k, torch.cat([e.reshape(-1) for e in errs]))
                                            for k, errs in errors_of(opt).items())},
                      [opt.state[p]["exp_avg"].clone() for p in model.parameters()
                       if "exp_avg" in opt.state[p]])
        (scaler.scale(loss) if scaler else loss).backward()
        if step != 4:
            (scaler.step(opt), scaler.update()) if scaler else opt.step()
            continue
        launched = opt.overlap_stats()["launched_in_backward"]
        try:
            scaler.step(opt) if scaler else opt.step()
            outcome.append("skipped")
        except ValueError as exc:
            assert "NaN or Inf gradient" in str(exc)
            outcome.append("raised")
        # Without a scaler the exchange had started before step() saw the inf;
        # with one, buckets wait for step() once a step was scaled.
        assert (launched == 0) if scaler else (launched > 0), launched
        params, errors, moments = before
        assert np.array_equal(flat_params(model), params)
        assert set(errors) == set(errors_of(opt)) and errors
        for k, e in errors.items():
            assert torch.equal(torch.cat([t.reshape(-1) for t in errors_of(opt)[k]]), e), k
        now = [opt.state[p]["exp_avg"] for p in model.parameters() if "exp_avg" in opt.state[p]]
        assert all(torch.equal(a, b) for a, b in zip(now, moments))
        if scaler:
            scaler.update()
    return outcome, flat_params(model)


@pytest.mark.parametrize("use_scaler", [False, True])
def test_inf_after_buckets_were_exchanged_changes_nothing_on_every_rank(use_scaler):
    results = run_workers(_nonfinite_on_one_rank, 3, use_scaler, timeout=180)
    assert [o for o, _ in results] == [["skipped" if use_scaler else "raised"]] * 3
    assert all(np.array_equal(results[0][1], p) for _, p in results)


def _accumulate(rank, world, mode):
    """Two micro-batches per step: inside no_overlap() (no warning), without
    it (a warning, every bucket exchanged again), or fused."""
    model, opt = build("OnebitAdam", "fused" if mode == "fused" else "bucketed")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(6):
            opt.zero_grad()
            for micro in range(2):
                x, y = batch(rank, 2 * step + micro)
                ctx = opt.no_overlap() if (mode == "no_overlap" and micro == 0) else _null()
                with ctx:
                    torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    told = [w for w in caught if "no_overlap" in str(w.message)]
    return flat_params(model), len(told), opt.overlap_stats()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_gradient_accumulation_with_and_without_no_overlap_matches_fused():
    fused = run_workers(_accumulate, 2, "fused", timeout=180)
    quiet = run_workers(_accumulate, 2, "no_overlap", timeout=180)
    noisy = run_workers(_accumulate, 2, "careless", timeout=180)
    for (a, _, _), (b, nb, sb), (c, nc, sc) in zip(fused, quiet, noisy):
        assert np.array_equal(a, b) and np.array_equal(a, c)
        assert nb == 0 and sb["redone"] == 0 and sb["launched_in_backward"] > 0
        assert nc == 1 and sc["redone"] > 0  # warned once, exchanged again


def _with_scaler(rank, world, mode):
    model, opt = build("OnebitLamb", mode)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    for step in range(7):
        x, y = batch(rank, step)
        opt.zero_grad()
        scaler.scale(torch.nn.functional.cross_entropy(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()
    stats = opt.overlap_stats()
    return flat_params(model), (stats and dict(stats, buckets=len(opt._wiring.overlap.buckets)))


def test_grad_scaler_steps_are_exchanged_in_step_from_unscaled_gradients():
    fused = run_workers(_with_scaler, 2, "fused", timeout=180)
    bucketed = run_workers(_with_scaler, 2, "bucketed", timeout=180)
    for (a, _), (b, stats) in zip(fused, bucketed):
        assert np.array_equal(a, b)
        # Buckets that went out scaled are exchanged again: those of the
        # first compressed step at most (launched in backward, or by step()
        # before its agreement so that every rank queues the same
        # exchanges); after a scaled step, backward leaves them to step()
        # rather than send them twice. 4 compressed steps.
        assert stats["launched_in_backward"] <= stats["redone"] <= stats["buckets"], stats
        assert stats["launched_in_step"] >= 3 * stats["buckets"], stats


def _changed_after_backward(rank, world, cls_name, mode, how):
    """The user changes the gradients between backward and step(): clips
    them in place, or unscales them with a GradScaler first (torch's
    unscale_ leaves no mark on .grad, and hands step() no scale)."""
    import onebit

    model, opt = build(cls_name, mode)
    scaler = onebit.amp.GradScaler("cpu", init_scale=2.0 ** 12) if how == "unscale_" else None
    for step in range(STEPS[cls_name]):
        x, y = batch(rank, step)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)  # clips every step
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
    return flat_params(model), opt.overlap_stats()


@pytest.mark.parametrize("how", ["clip_grad_norm_", "unscale_"])
@pytest.mark.parametrize("cls_name", ["OnebitAdam", "ZeroOneAdam"])
def test_gradients_changed_between_backward_and_step_are_what_is_exchanged(cls_name, how):
    """The buckets went out during backward with the gradients before the
    clip (and the scale): step() updated from them, and the params grew to
    1e9 where the fused step's stayed small. Now such buckets are exchanged
    again from the gradients step() sees: the fused step's bits."""
    fused = run_workers(_changed_after_backward, 2, cls_name, "fused", how, timeout=180)
    bucketed = run_workers(_changed_after_backward, 2, cls_name, "bucketed", how, timeout=180)
    for (a, _), (b, stats) in zip(fused, bucketed):
        assert np.array_equal(a, b), f"max {np.abs(a - b).max()}"
        assert stats["redone"] > 0, stats


def _refused(rank, world):
    import onebit

    out = []
    for kw in (dict(max_grad_norm=1.0),):
        try:
            onebit.OnebitAdam(Model().parameters(), overlap_backward=True, **kw)
            out.append("accepted")
        except ValueError as exc:
            out.append(str(exc))
    return out


def test_overlap_refuses_clipping_clearly():
    for msgs in run_workers(_refused, 2, timeout=120):
        assert "max_grad_norm=0" in msgs[0]


def _a_refused_group(rank, world, cls_name):
    import onebit

    a, b = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(3))
    stage = "var_freeze_step" if cls_name == "ZeroOneAdam" else "freeze_step"
    opt = getattr(onebit, cls_name)([a], lr=0.1, overlap_backward=True, timeout_s=60,
                                    **{stage: 1})
    counters = {k: list(v) if isinstance(v, list) else v for k, v in opt.counters.items()}
    try:
        opt.add_param_group({"params": [b], "max_grad_norm": 1.0})
        refused = "accepted"
    except ValueError as exc:
        refused = str(exc)
    groups, same_counters = len(opt.param_groups), opt.counters == counters
    for _ in range(4):  # past the freeze: 0/1 Adam's local steps read every group's lr sum
        a.grad, b.grad = torch.full((4,), 0.5 + rank), torch.full((3,), 0.5 + rank)
        opt.step()
    return refused, groups, same_counters, b.detach().tolist(), a.detach().tolist()


@pytest.mark.parametrize("cls_name", ["OnebitAdam", "OnebitLamb", "ZeroOneAdam"])
def test_a_refused_param_group_leaves_the_optimizer_as_it_was(cls_name):
    """The group's refusal came after torch had added it: it stayed and
    trained, and 0/1 Adam's per-group lr sums missed it (IndexError)."""
    out = run_workers(_a_refused_group, 2, cls_name, timeout=120)
    for refused, groups, same_counters, b, a in out:
        assert "max_grad_norm=0" in refused
        assert groups == 1 and same_counters
        assert b == [1.0] * 3  # never trained
        assert a != [1.0] * 4 and a == out[0][4]  # the optimizer goes on, replicas alike


def _two_groups(rank, world):
    import onebit
    from onebit.feedback.exchange import BucketKey

    torch.manual_seed(0)
    model = Model()
    groups = [{"params": [model.emb.weight, *model.hidden.parameters()]},
              {"params": [model.out, *model.unused_head.parameters()]}]
    opt = onebit.OnebitAdam(groups, lr=1e-2, overlap_backward=True, bucket_cap_mb=0.004,
                            freeze_step=2)
    for step in range(4):
        x, y = batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    state = opt.error_feedback_state_dict()["groups"]
    live = {k: v for k, v in errors_of(opt).items() if isinstance(k, BucketKey)}
    same = all(torch.equal(state[k.name]["worker"], w) and torch.equal(state[k.name]["server"], s)
               for k, (w, s) in live.items())
    return list(state), sorted(k.name for k in live), same


def test_bucket_numbers_run_across_groups_in_the_saved_error_names():
    """Buckets are numbered in plan order over the whole plan (the last group
    first), so "1.0" holds group 1's params and group 0's follow as "0.1",
    "0.2" (1048 elements a bucket: hidden's 520, then the embedding's 3600);
    the saved names are the groups, then the buckets in plan order."""
    for names, live, same in run_workers(_two_groups, 2, timeout=120):
        assert names == ["0", "1", "1.0", "0.1", "0.2"], names
        assert live == ["0.1", "0.2", "1.0"] and same, (live, same)


def _under_ddp(rank, world, cls_name, mode):
    """The same training through DistributedDataParallel with onebit's comm
    hook (DDP averages warmup gradients, sends nothing after)."""
    import onebit

    model, opt = build(cls_name, mode)
    ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    ddp.register_comm_hook(opt.ddp_hook_state(), onebit.ddp_comm_hook)
    for step in range(STEPS[cls_name]):
        x, y = batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    return flat_params(model), opt.overlap_stats()


@pytest.mark.parametrize("cls_name", ["OnebitAdam", "ZeroOneAdam"])
def test_overlap_under_ddp_with_the_comm_hook_matches_fused(cls_name):
    fused = run_workers(_under_ddp, 3, cls_name, "fused", timeout=180)
    bucketed = run_workers(_under_ddp, 3, cls_name, "bucketed", timeout=180)
    for (a, _), (b, stats) in zip(fused, bucketed):
        assert np.array_equal(a, b), f"max {np.abs(a - b).max()}"
        assert stats["launched_in_backward"] > 0 and stats["redone"] == 0, stats


def _branch_on_some_ranks(rank, world, cls_name, overlap):
    """A head every rank trains at every step but step 4, where rank 0
    alone uses it: the others wait in backward for a gradient that never
    comes (it came at step 3)."""
    import onebit

    torch.manual_seed(0)
    body, head = torch.nn.Linear(5, 9), torch.nn.Linear(5, 3)
    kw = dict(freeze_step=2) if cls_name != "ZeroOneAdam" else dict(var_freeze_step=2)
    opt = getattr(onebit, cls_name)(list(body.parameters()) + list(head.parameters()), lr=1e-2,
                                    overlap_backward=overlap, bucket_cap_mb=1e-4, timeout_s=20,
                                    **kw)
    for t in range(1, 7):
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(t * 10 + rank))
        loss = body(x).pow(2).mean()
        if t != 4 or rank == 0:
            loss = loss + head(x).pow(2).mean()
        loss.backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # step 5's exchanged-again notice
            opt.step()
        opt.zero_grad()
    return [p.detach().tolist() for p in list(body.parameters()) + list(head.parameters())]


@pytest.mark.parametrize("cls_name", ["OnebitAdam", "OnebitLamb", "ZeroOneAdam"])
def test_a_param_with_a_gradient_on_some_ranks_only_neither_hangs_nor_changes_bits(cls_name):
    """The ranks without its gradient launched fewer buckets in backward,
    queued step()'s agreement ahead of exchanges the others queued it
    behind, and each waited for the other until the deadline. Now step()
    queues every bucket first: no wait, the bits of the fused step, and
    the same params on every rank."""
    overlapped = run_workers(_branch_on_some_ranks, 2, cls_name, True, timeout=90)
    fused = run_workers(_branch_on_some_ranks, 2, cls_name, False, timeout=90)
    assert overlapped == fused
    if cls_name != "ZeroOneAdam":  # (its ranks differ between syncs by design)
        assert overlapped[0] == overlapped[1]


def _group_added_mid_run(rank, world, cls_name, add_at, overlap):
    import onebit

    torch.manual_seed(0)
    body, head = torch.nn.Linear(5, 9), torch.nn.Linear(9, 2)
    kw = dict(freeze_step=4) if cls_name != "ZeroOneAdam" else dict(var_freeze_step=4,
                                                                     var_update_scaler=2)
    opt = getattr(onebit, cls_name)(body.parameters(), lr=1e-2, overlap_backward=overlap,
                                    timeout_s=20, **kw)
    for t in range(1, 9):
        if t == add_at:
            opt.add_param_group({"params": list(head.parameters())})
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(t * 10 + rank))
        h = body(x)
        loss = h.pow(2).mean() + (head(h).sum() if t >= add_at else 0)
        loss.backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the restart notice of the error buffers
            opt.step()
        opt.zero_grad()
    return [p.detach().tolist() for p in list(body.parameters()) + list(head.parameters())]


@pytest.mark.parametrize("cls_name,add_at", [("OnebitAdam", 6), ("ZeroOneAdam", 3),
                                             ("ZeroOneAdam", 6)])
def test_a_param_group_added_mid_run_with_overlap_matches_the_fused_step(cls_name, add_at):
    """A group added in a 1-bit stage: backward planned its params into the
    buckets, then step() took them apart (late joiners) and dropped the
    buffers those exchanges ran over: a KeyError on the communication
    thread, its peer at the deadline. The queued exchanges are undone first
    now, and step() exchanges again: the fused step's bits."""
    overlapped = run_workers(_group_added_mid_run, 2, cls_name, add_at, True, timeout=90)
    fused = run_workers(_group_added_mid_run, 2, cls_name, add_at, False, timeout=90)
    assert overlapped == fused
