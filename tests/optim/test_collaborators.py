"""The optimizer's collaborators, each built on its own, without an
optimizer: rank agreement, telemetry, late joiners, static buffers, the
stage value, and the subclass contract. (The error-feedback exchange has
its own file, test_exchange.py.)"""
import math
import warnings

import pytest
import torch

from onebit.backends.stats import TrafficStats
from onebit.agreement import ReplicaDivergenceError, RankAgreement, nonfinite_flag
from onebit.optim.base import OnebitOptimizer
from onebit.optim.capture import StaticBuffers
from onebit.optim.late import FROZEN, LATE, LATE_KEY, TRAINED, LateJoiners
from onebit.optim.stage import Stage
from onebit.feedback.telemetry import StepTelemetry

from tests.distributed import run_workers

CPU = torch.device("cpu")


# ----------------------------------------------------------------- stage --
def test_stage_names_v_only_while_it_stands_still():
    moving = Stage(3, "warmup", full_precision=True, compressed=False, variance_frozen=False,
                   variance_updates=3, variance_moves=True)
    still = Stage(9, "compression", full_precision=False, compressed=True, variance_frozen=True,
                  variance_updates=5, variance_moves=False)
    assert moving.variance_version is None and still.variance_version == 5
    assert still.replicas_match  # unless a stage says otherwise
    with pytest.raises(AttributeError):
        still.step = 10  # a value: decided once per step


# ------------------------------------------------------- static buffers --
def test_static_buffers_keep_their_addresses_until_the_shapes_change():
    buffers = StaticBuffers()
    like = [torch.ones(3, 2), torch.ones(5)]
    first = buffers.scratch("update", 0, like)
    assert [b.data_ptr() for b in buffers.scratch("update", 0, like)] == \
        [b.data_ptr() for b in first]
    assert buffers.scratch("update", 1, like)[0].data_ptr() != first[0].data_ptr()
    resized = buffers.scratch("update", 0, [torch.ones(4)])
    assert resized[0].shape == (4,) and len(resized) == 1

    resized_again = buffers.scratch("update", 0, like)
    buffers.clear()  # `first` is still alive, so fresh buffers cannot reuse its memory
    assert buffers.scratch("update", 0, like)[0].data_ptr() != resized_again[0].data_ptr()


def test_static_buffers_fit_other_tensors_of_the_same_shapes_and_refit_new_shapes():
    buffers = StaticBuffers()
    like = [torch.ones(3, 2), torch.ones(5)]
    first = buffers.scratch("update", 0, like)
    twins = [torch.zeros(3, 2), torch.zeros(5)]  # other tensors, the same shapes
    assert all(a is b for a, b in zip(buffers.scratch("update", 0, twins), first))
    assert all(a is b for a, b in zip(buffers.scratch("update", 0, like), first))
    longer = buffers.scratch("update", 0, like + [torch.ones(7)])
    assert [b.shape for b in longer] == [(3, 2), (5,), (7,)]
    other = buffers.scratch("update", 0, [torch.ones(5), torch.ones(3, 2)])  # order swapped
    assert [b.shape for b in other] == [(5,), (3, 2)]


# ------------------------------------------------------------ telemetry --
def test_telemetry_windows_sum_both_counters_and_totals_keep_growing():
    mine, backend = TrafficStats(), TrafficStats()
    telemetry = StepTelemetry([mine, backend])
    mine.add(100, 100, 100, comm_s=0.5)
    backend.add(10, 10, 400, comm_s=0.25, compress_s=0.125)
    telemetry.end_step(1, "warmup", skipped=False)
    backend.add(20, 20, 400)
    telemetry.end_step(2, "compression", skipped=True)
    errors = [(torch.tensor([3.0, 0.0]), torch.tensor([1.0])),
              (torch.tensor([4.0]), torch.tensor([2.0, 2.0]))]
    report = telemetry.report(2, 4, errors)
    assert report["stage"] == "compression" and report["world_size"] == 4
    assert report["bytes_sent"] == 20 and report["compression_ratio"] == 20.0
    assert report["total_bytes_sent"] == 130 and report["total_fp32_bytes"] == 900
    assert report["total_compression_ratio"] == pytest.approx(900 / 130)
    assert report["total_comm_s"] == pytest.approx(0.75)
    assert report["skipped_steps"] == 1
    assert report["worker_error_norm"] == pytest.approx(5.0)  # sqrt(9 + 16)
    assert report["server_error_norm"] == pytest.approx(3.0)  # sqrt(1 + 4 + 4)


def test_telemetry_before_any_step_reports_zeros_and_no_ratio():
    report = StepTelemetry([TrafficStats()]).report(0, 1, [])
    assert report["bytes_sent"] == 0 and report["compression_ratio"] is None
    assert report["worker_error_norm"] == 0.0 and report["stage"] is None


# --------------------------------------------------------- late joiners --
def test_late_joiners_take_their_own_warmup_then_join():
    late = LateJoiners(warmup_length=2)
    old, new, frozen = (torch.nn.Parameter(torch.zeros(2)) for _ in range(3))
    frozen.requires_grad_(False)
    state = {old: {"exp_avg_sq": torch.ones(2)}}
    groups = [{"params": [old, new, frozen]}]
    codes = late.codes(_defaultdict(state), groups, variance_frozen=False)  # v not frozen: nobody
    assert not late.params(state, groups[0]) and codes == [[TRAINED, TRAINED, FROZEN]]
    state = _defaultdict(state)
    codes = late.codes(state, groups, variance_frozen=True)
    assert late.params(state, groups[0]) == [new]  # not the one with v, not the frozen one
    assert codes == [[TRAINED, LATE, FROZEN]]
    assert state[new][LATE_KEY] == 0 and LateJoiners.steps_done(state, new) == 0
    LateJoiners.advance(state, [new])
    assert late.is_late(state, new)
    LateJoiners.advance(state, [new])
    assert not late.is_late(state, new) and not late.params(state, groups[0])


def test_without_a_warmup_a_param_without_v_is_refused():
    # It was marked TRAINED, and v = 0 held it still for good: freeze_step=0
    # on a fresh run moved nothing, silently.
    late, p = LateJoiners(warmup_length=0, warmup_option="var_freeze_step"), \
        torch.nn.Parameter(torch.zeros(1))
    state, groups = _defaultdict({}), [{"params": [p], "lr": 1e-3}]
    assert late.codes(state, groups, variance_frozen=False) == [[TRAINED]]
    with pytest.raises(ValueError, match=r"var_freeze_step=0 leaves a param of shape \(1,\)"):
        late.codes(state, groups, variance_frozen=True)
    assert LATE_KEY not in state[p]
    # A step at lr 0 moves nothing: DCP takes one to make a fresh optimizer's state
    assert late.codes(state, [{"params": [p], "lr": 0.0}], variance_frozen=True) == [[TRAINED]]
    state[p]["exp_avg_sq"] = torch.ones(1)  # a loaded checkpoint's v: trains in 1 bit
    assert late.codes(state, groups, variance_frozen=True) == [[TRAINED]]
    assert not late.is_late(state, p) and LATE_KEY not in state[p]


def _defaultdict(d):
    from collections import defaultdict

    out = defaultdict(dict)
    out.update(d)
    return out


# --------------------------------------------------- the non-finite flag --
@pytest.mark.parametrize("bad, found_inf, expected", [
    (None, None, 0), (math.nan, None, 1), (math.inf, None, 1), (-math.inf, None, 1),
    (1e30, None, 1),  # its square overflows the norm: counted as overflow
    (None, torch.tensor([0.0]), 0), (None, torch.tensor([1.0]), 1)])
def test_nonfinite_flag(bad, found_inf, expected):
    grads = [[torch.ones(3), torch.zeros(0)], [torch.ones(2, 2)]]
    if bad is not None:
        grads[1][0][1, 0] = bad
    flag = nonfinite_flag(grads, CPU, found_inf)
    assert flag.dim() == 0 and flag.dtype == torch.int64 and int(flag) == expected
    assert int(nonfinite_flag([], CPU)) == 0


# ------------------------------------------------------ rank agreement --
def _agreement(rank, world):
    import torch.distributed as dist

    agree = RankAgreement("Tested", None, timeout_s=30)
    p = torch.nn.Parameter(torch.ones(4))
    groups = [{"params": [p], "lr": 0.1}]
    out = {}
    agree.check_construction({"freeze_step": 5}, groups, "compressed")  # all alike: passes
    try:
        agree.check_construction({"freeze_step": 5 + rank}, groups, "compressed")
    except ValueError as exc:
        out["settings"] = str(exc)
    flag = torch.tensor(int(rank == world - 1))
    # No gradient for flags 0 and 2 anywhere, for flag 1 on rank 0 only, and
    # 70 flags (two words) with the last set everywhere.
    no_grad = [True, rank == 0, True] + [False] * 66 + [True]
    out["verdict"] = tuple(agree.before_step(7, flag, 42, redo_buckets=rank == 0,
                                             param_groups=groups, no_grad=no_grad))
    # 70 flags set by some rank (flag k on rank k % 4: none for k % 4 == 3)
    used = torch.tensor([k % 4 == rank for k in range(70)])
    out["used"] = agree.before_step(7, torch.tensor(0), 42, False, groups, no_grad=no_grad,
                                    used=used).used
    try:
        agree.before_step(7, torch.tensor(0), 42 + rank, False, groups)
    except ValueError as exc:
        out["trainable"] = str(exc)
    agree.check_replicas(7, groups, {})  # same values: passes
    with torch.no_grad():
        p[1] += rank == 1
    try:
        agree.check_replicas(8, groups, {})
    except ReplicaDivergenceError as exc:
        out["replicas"] = str(exc)
    dist.barrier()
    return out


def test_rank_agreement_on_real_ranks():
    for out in run_workers(_agreement, 3, timeout=90):
        assert "Tested: ranks disagree on hyper-parameters" in out["settings"]
        # rank 2's non-finite flag, rank 0's redo; not every rank is non-finite;
        # the params no rank has a gradient for
        assert out["verdict"] == (True, True, False, (True, False, True) + (False,) * 66 + (True,),
                                  ())
        assert out["used"] == tuple(k % 4 != 3 for k in range(70))
        assert "disagree on which parameters require grad at step 7" in out["trainable"]
        assert "group 0: 1 of 1 params" in out["trainable"]
        assert "diverged by step 8" in out["replicas"] and "rank(s) [1]" in out["replicas"]


# ------------------------------------------------- the subclass contract --
def test_a_subclass_must_say_its_maths_and_what_it_exchanges():
    from onebit.optim.options import CommOptions
    from onebit.optim.stage_schedules import FreezeStepSchedule

    class Incomplete(OnebitOptimizer):
        def _exchange_input_(self, index, params, grads, out, positions):
            pass

    with pytest.raises(TypeError, match="_update"):
        Incomplete([torch.nn.Parameter(torch.zeros(1))], {"lr": 0.1}, FreezeStepSchedule(3),
                   CommOptions())


def _broadcast_in_buckets(rank, world):
    import torch.distributed as dist

    from onebit import collectives

    g = torch.Generator().manual_seed(rank)
    tensors = [torch.randn(300, generator=g, dtype=torch.float64),   # exactly, not via fp32
               torch.randn(5, generator=g).to(torch.bfloat16),
               torch.randn(2000, generator=g), torch.randn(0, generator=g),
               torch.randn(7, 3, generator=g), torch.randn(100, generator=g).half()]
    before = [t.clone() for t in tensors]
    calls = []
    real = dist.broadcast

    def counting(t, *a, **k):
        calls.append((t.dtype, t.numel()))
        return real(t, *a, **k)
    dist.broadcast = counting
    try:  # 4 KB buckets: the 8 KB fp32 tensor alone, the fp64 one alone, ...
        collectives.broadcast_from_first_rank("test", tensors, bucket_bytes=4096)
    finally:
        dist.broadcast = real
    every = [None] * world
    dist.all_gather_object(every, [t.tolist() for t in tensors])
    kept = rank != 0 or all(torch.equal(a, b) for a, b in zip(before, tensors))
    return calls, all(e == every[0] for e in every), kept


def test_the_first_ranks_values_reach_every_rank_exactly_in_buckets_of_one_dtype():
    """Rank 0's values, float64 ones too (the fused fp32 broadcast this
    replaced rounded them, on rank 0 as well), in buckets of one dtype."""
    for calls, same, kept in run_workers(_broadcast_in_buckets, 3, timeout=60):
        assert same and kept
        assert sorted(calls, key=str) == sorted([(torch.float64, 300), (torch.bfloat16, 5),
                                                 (torch.float32, 2000), (torch.float32, 21),
                                                 (torch.float16, 100)], key=str), calls


# -------------------------------------------------- error-feedback channel --
def test_channel_keys_name_world_rank_and_shard():
    from onebit.feedback.channel import ErrorFeedbackChannel
    from onebit.wire import WIRE_FORMAT_VERSION

    whole = ErrorFeedbackChannel("X", None, 3, 2, 64, {})
    sharded = ErrorFeedbackChannel("X", None, 3, 2, 64, {"shard": 1, "shards": 4})
    assert whole.key("errs") == "errs.world3.rank2"
    assert sharded.key("errs") == "errs.world3.rank2.shard1of4"
    assert sharded.identity({"step": 7}) == {
        "rank": 2, "world_size": 3, "wire_format": WIRE_FORMAT_VERSION, "block_size": 64,
        "step": 7, "shard": 1, "shards": 4}


def test_channel_restores_only_its_own_identity_and_the_notice_follows():
    from onebit.feedback.channel import ErrorFeedbackChannel

    channel = ErrorFeedbackChannel("X", None, 1, 0, 64, {})
    saved = channel.state_dict({}, CPU, {"step": 5})
    channel.owner_loaded(errors_lost=True)
    assert not channel.load_state_dict(saved, {}, {"step": 6})  # another step: not these
    with pytest.warns(UserWarning, match="X: the error-feedback buffers restarted"):
        channel.restart_notice.before_step()
    channel = ErrorFeedbackChannel("X", None, 1, 0, 64, {})
    channel.owner_loaded(errors_lost=True)
    assert channel.load_state_dict(saved, {}, {"step": 5})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        channel.restart_notice.before_step()  # restored: nothing to warn about


def test_channel_names_a_code_other_than_the_signs_and_restores_only_under_it():
    """Errors carried under the 2-bit code are not the signs': the identity
    names the code (and, for the signs, stays what it was, so older
    checkpoints still load)."""
    from types import SimpleNamespace

    from onebit.backends.codecs import SignCodec, TernaryCodec
    from onebit.feedback.channel import ErrorFeedbackChannel

    def channel(codec):
        return ErrorFeedbackChannel("X", SimpleNamespace(codec=codec, stats=TrafficStats()),
                                    1, 0, 64, {})

    assert "code" not in channel(SignCodec).identity({"step": 1})
    assert channel(TernaryCodec).identity({"step": 1})["code"] == "2bit"
    saved = channel(SignCodec).state_dict({}, CPU, {"step": 5})
    assert not channel(TernaryCodec).load_state_dict(saved, {}, {"step": 5})
    assert channel(SignCodec).load_state_dict(saved, {}, {"step": 5})


def test_feedback_diloco_and_shards_import_nothing_from_optim():
    """The layering issue 45 asked for: DiLoCo and the optimizers are peers
    over onebit.feedback, which knows neither."""
    import ast
    import pathlib

    import onebit

    root = pathlib.Path(onebit.__file__).parent
    # agreement.py and handoff.py serve both peers, as feedback/ does: they know neither.
    shared = [*root.joinpath("feedback").glob("*.py"), root / "agreement.py", root / "handoff.py"]
    files = [*shared, *root.joinpath("diloco").glob("*.py"), root / "shards.py", root / "checks.py"]
    for path in files:
        package = "onebit" + "".join(f".{part}" for part in path.relative_to(root).parent.parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)] \
                    if node.level else []
                name = ".".join(base + ([node.module] if node.module else []))
            elif isinstance(node, ast.Import):
                name = " ".join(a.name for a in node.names)
            else:
                continue
            assert "onebit.optim" not in name, f"{path.name} imports {name}"
            if path in shared:
                assert "onebit.diloco" not in name, f"{path.name} imports {name}"


# ------------------------------------------------------- stage schedules --
def _drive(schedule, steps, groups=1):
    """Every stage of steps 1..steps, the counters moved as step() moves them."""
    counters = schedule.initial_counters("X", groups)
    stages = []
    for t in range(1, steps + 1):
        stage = schedule.stage_at(counters, t)
        stages.append(stage)
        counters["step"] = t
        schedule.advance(counters, stage)
    return stages, counters


def test_zero_one_schedule_doubles_its_intervals_as_the_paper_says():
    """0/1 Adam's policies worked out by hand (Lu et al., 2022, Alg. 1): v is
    updated at steps that are multiples of an interval that doubles after
    every 2 updates; after step 20, the ranks sync at multiples of an
    interval that doubles every 3 steps, up to 4."""
    from onebit.optim.stage_schedules import ZeroOneSchedule

    schedule = ZeroOneSchedule(var_freeze_step=20, var_update_scaler=2, local_step_scaler=3,
                               local_step_clipper=4)
    stages, counters = _drive(schedule, 36)
    assert [s.step for s in stages if s.full_precision] == [1, 2, 4, 6, 8, 12, 16]
    assert [s.step for s in stages if s.name == "sync"] == [21, 22, 23, 24, 26, 28, 32, 36]
    assert {s.name for s in stages[:20]} == {"variance update", "1-bit gradients"}
    assert all(s.replicas_match == (s.name != "local step") for s in stages)
    assert counters["var_updates"] == 7 and counters["last_sync"] == 36
    assert [s.variance_updates for s in stages[:6]] == [1, 2, 2, 3, 3, 4]
    # backward can start the 1-bit gradients and a sync that follows a sync
    # (no lr since: `lrs` all 0), not a variance update nor the first frozen step
    c = schedule.initial_counters("X", 2)
    c.update(var_interval=2)  # v updates at even steps
    assert schedule.exchanges_during_backward(c, 3) and not schedule.exchanges_during_backward(c, 2)
    assert not schedule.exchanges_during_backward(c, 21)
    assert schedule.exchanges_during_backward(c, 22)
    c["lrs"][1] = 0.1
    assert not schedule.exchanges_during_backward(c, 22)


def test_freeze_step_schedule_switches_after_freeze_step():
    from onebit.optim.stage_schedules import FreezeStepSchedule

    stages, counters = _drive(FreezeStepSchedule(3), 5)
    assert [(s.name, s.full_precision, s.compressed, s.variance_updates) for s in stages] == [
        ("warmup", True, False, 1), ("warmup", True, False, 2), ("warmup", True, False, 3),
        ("compression", False, True, 3), ("compression", False, True, 3)]
    assert counters == {"optimizer": "X", "step": 5, "var_updates": 3}
    # A run whose v froze with more updates than freeze_step (a torch Adam
    # checkpoint of 7 steps) keeps its count; without the count (a checkpoint
    # written before it was kept) the run is one of this freeze_step.
    assert FreezeStepSchedule(3).stage_at({"step": 7, "var_updates": 7}, 8).variance_updates == 7
    assert FreezeStepSchedule(3).stage_at({"step": 7}, 8).variance_updates == 3
    assert FreezeStepSchedule(3).stage_at({"step": 1}, 2).variance_updates == 2
    assert not FreezeStepSchedule(3).had_error_feedback(counters, 3)
    assert FreezeStepSchedule(3).had_error_feedback(counters, 4)
