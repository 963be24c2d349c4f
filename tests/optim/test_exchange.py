"""ErrorFeedbackExchange on its own: no optimizer, no process group. A fake
backend stands in for the compressed allreduce, so each test sees exactly
which buffer and which errors an exchange used."""
import pytest
import torch

from onebit.backends.layout import BlockLayout
from onebit.feedback.exchange import (BucketKey, ErrorFeedbackExchange, GroupKey, LateKey,
                                   key_from_name)
from onebit.optim.step_exchange import StepExchange

BLOCK, WORLD = 8, 2


class FakeBackend:
    """The real layout; an "allreduce" that doubles the buffer and counts
    into the errors, so the tests can see what it touched."""

    def __init__(self) -> None:
        self.calls = []

    def layout(self, sizes):
        return BlockLayout(sizes, BLOCK, WORLD)

    def compressed_allreduce(self, buffer_m, worker_error, server_error, layout=None):
        self.calls.append((buffer_m.data_ptr(), layout.key))
        buffer_m.mul_(2.0)
        worker_error.add_(1.0)
        server_error.add_(10.0)


def tensors(*sizes):
    return [torch.arange(float(n)).reshape(s) for n, s in
            ((torch.Size(s).numel(), s) for s in sizes)]


def test_keys_are_distinct_types_and_names_round_trip():
    assert GroupKey(0) != LateKey(0) and len({GroupKey(0), LateKey(0), BucketKey(0, 0)}) == 3
    assert GroupKey(3).name == "3" and BucketKey(3, 1).name == "3.1"
    for key in (GroupKey(3), BucketKey(3, 1), BucketKey(0, 12)):
        assert key_from_name(key.name) == key
    assert key_from_name("a") is None and key_from_name("1.2.3") is None


def test_buffer_keeps_its_storage_while_the_sizes_stay():
    ex = ErrorFeedbackExchange(FakeBackend())
    a = ex.buffer(GroupKey(0), tensors((3, 2), (5,)))
    assert ex.buffer(GroupKey(0), [torch.ones(3, 2), torch.ones(5)]).data_ptr() == a.data_ptr()
    assert ex.buffer(GroupKey(0), tensors((4,))).data_ptr() != a.data_ptr()
    assert ex.buffer(LateKey(0), tensors((4,))) is not ex.buffer(GroupKey(0), tensors((4,)))


def test_views_put_each_tensor_on_its_own_blocks():
    ex = ErrorFeedbackExchange(FakeBackend())
    ts = tensors((3, 2), (5,))
    ex.buffer(GroupKey(1), ts)
    ex.flatten_into(GroupKey(1), ts)
    views = ex.views(GroupKey(1), ts)
    assert [v.shape for v in views] == [t.shape for t in ts]
    assert all(torch.equal(v, t) for v, t in zip(views, ts))
    flat = ex.buffer(GroupKey(1), ts)
    assert torch.equal(flat[6:BLOCK], torch.zeros(2))  # the gap to the next block stays zero
    out = [torch.empty_like(t) for t in ts]
    ex.unflatten_from(GroupKey(1), out)
    assert all(torch.equal(o, t) for o, t in zip(out, ts))


def compressed_average_(ex, key, ts):
    """ts <- their "average" through buffer `key`, as a step's exchange does."""
    views = ex.prepare(key, ts)
    torch._foreach_copy_(views, ts)
    ex.allreduce(key)
    torch._foreach_copy_(ts, views)


def test_allreduce_goes_through_the_keys_buffer_and_errors():
    backend = FakeBackend()
    ex = ErrorFeedbackExchange(backend)
    ts = tensors((3,), (9,))
    expected = [t * 2 for t in ts]
    compressed_average_(ex, BucketKey(0, 1), ts)
    assert all(torch.equal(t, e) for t, e in zip(ts, expected))
    assert backend.calls == [(ex.buffer(BucketKey(0, 1), ts).data_ptr(),
                              ex.layout_for([3, 9]).key)]
    worker, server = ex.errors(BucketKey(0, 1))
    assert (worker.numel(), server.numel()) == ex.layout_for([3, 9]).error_sizes
    assert torch.all(worker == 1.0) and torch.all(server == 10.0)
    assert list(ex.error_buffers()) == [BucketKey(0, 1)]


def test_average_lands_the_callers_mean_in_the_tensors():
    ex = ErrorFeedbackExchange(FakeBackend())
    ts = tensors((5,))
    ex.average_(LateKey(0), ts, lambda flat: flat.mul_(3.0).sub_(1.0))
    assert torch.equal(ts[0], torch.arange(5.0) * 3 - 1)
    assert ex.error_buffers() == {}  # full precision: no errors


def test_a_mean_that_raises_leaves_the_tensors_as_they_were():
    ex = ErrorFeedbackExchange(FakeBackend())
    ts = tensors((5,))

    def overflowed(flat):
        flat.fill_(float("inf"))
        raise ValueError("out of range")

    with pytest.raises(ValueError):
        ex.average_(LateKey(0), ts, overflowed)
    assert torch.equal(ts[0], torch.arange(5.0))


def test_restore_puts_back_the_errors_of_before_the_backup():
    ex = ErrorFeedbackExchange(FakeBackend())
    key, ts = BucketKey(1, 0), tensors((20,))
    compressed_average_(ex, key, ts)
    before = [e.clone() for e in ex.errors(key)]
    ex.backup(key)
    ex.allreduce(key)
    assert not torch.equal(ex.errors(key)[0], before[0])
    ex.restore(key)
    assert all(torch.equal(a, b) for a, b in zip(ex.errors(key), before))


def test_reset_keeps_the_buffers_forget_layouts_drops_them():
    ex = ErrorFeedbackExchange(FakeBackend())
    ts = tensors((20,))
    compressed_average_(ex, GroupKey(0), ts)
    flat = ex.buffer(GroupKey(0), ts)
    ex.reset()
    assert ex.error_buffers() == {}
    assert ex.buffer(GroupKey(0), ts) is flat  # graphs keep its address
    assert torch.all(ex.errors(GroupKey(0))[0] == 0)
    ex.forget_layouts()
    assert ex.error_buffers() == {}
    with pytest.raises(KeyError):
        ex.views(GroupKey(0), ts)


def test_errors_state_round_trips_through_load_errors():
    ex = ErrorFeedbackExchange(FakeBackend())
    trained = [tensors((3,), (4,)), [], tensors((30,))]
    buckets = [(BucketKey(2, 0), [30]), (BucketKey(0, 1), [4, 3])]
    layouts = ex.layouts(trained, buckets)
    assert list(layouts) == [GroupKey(0), GroupKey(2), BucketKey(2, 0), BucketKey(0, 1)]
    compressed_average_(ex, GroupKey(2), trained[2])
    state = ex.errors_state(layouts, torch.device("cpu"))
    assert list(state) == ["0", "2", "2.0", "0.1"]
    assert torch.all(state["2"]["worker"] == 1.0) and torch.all(state["0"]["worker"] == 0.0)
    assert state["2"]["layout"] == repr(layouts[GroupKey(2)].key)

    fresh = ErrorFeedbackExchange(FakeBackend())
    assert fresh.layouts_match(state, fresh.layouts(trained, buckets))
    assert not fresh.layouts_match(state, fresh.layouts(trained))  # no buckets here
    fresh.load_errors(state)
    fresh.buffer(GroupKey(2), trained[2])
    assert all(torch.equal(a, state["2"][n]) for a, n in zip(fresh.errors(GroupKey(2)),
                                                               ("worker", "server")))
    fresh.load_errors(None)
    fresh.buffer(GroupKey(2), trained[2])
    assert torch.all(fresh.errors(GroupKey(2))[0] == 0)


def test_no_backend_no_layouts():
    assert ErrorFeedbackExchange(None).layouts([tensors((3,))]) == {}


# ------------------------------------------------- a step's exchange --
def test_step_exchange_takes_the_input_in_the_fused_buffer_and_lands_it_masked():
    backend = FakeBackend()
    ex = ErrorFeedbackExchange(backend)
    step = StepExchange(ex, None, WORLD).group(0)
    out = tensors((3,), (9,), (2,))
    inputs = step.inputs(out)
    assert [v.data_ptr() for v in inputs] == [v.data_ptr() for v in ex.views(GroupKey(0), out)]
    for v in inputs:
        v.fill_(1.5)
    assert backend.calls == []  # nothing on the wire before parts()
    masks = [None, (torch.arange(9) % 2 == 0).float(), None]  # (guards.py's form)
    seen = [True, True, False]
    parts = list(step.parts(out, seen, masks))
    assert parts == [[0, 1, 2]] and len(backend.calls) == 1
    assert torch.equal(out[0], torch.full((3,), 3.0))
    assert torch.equal(out[1], torch.where(masks[1] > 0, 3.0, 0.0))
    assert torch.equal(out[2], torch.zeros(2))  # a tensor v never saw gets nothing


def test_step_exchange_at_world_size_one_is_the_input_itself():
    step = StepExchange(ErrorFeedbackExchange(FakeBackend()), None, 1).group(0)
    out = tensors((4,))
    assert step.inputs(out) is out
    out[0].fill_(2.0)
    step.average_(out, [True], [torch.tensor([1.0, 0.0, 1.0, 0.0])])
    assert torch.equal(out[0], torch.tensor([2.0, 0.0, 2.0, 0.0]))


def test_step_exchange_can_leave_the_average_in_the_buffer():
    step = StepExchange(ErrorFeedbackExchange(FakeBackend()), None, WORLD).group(2)
    like = tensors((5,))
    inputs = step.inputs(like)
    inputs[0].fill_(-1.0)
    step.average_(None, [True], [None])
    assert torch.equal(inputs[0], torch.full((5,), -2.0))
    assert torch.equal(like[0], torch.arange(5.0))  # untouched
