"""overlap_backward hands work between threads behind events, never by
luck of a shared default stream: the compute thread records an event after
writing a bucket's input, the communication thread's own stream waits on it
before the exchange and records one after, and step()'s stream waits on
that before it reads the result. The communication thread binds the data's
device once. Checked without a GPU through an accelerator that records
every stream, event and device call, on 2 real ranks."""
import contextlib
import itertools
import threading

import torch

from tests.distributed import run_workers
from tests.optim.test_overlap import Model, batch


def _recording_accelerator():
    from onebit.accelerator import CpuAccelerator

    class Recording(CpuAccelerator):
        def __init__(self):
            self.log, self.ids, self.current = [], itertools.count(), {}

        def note(self, *what):
            on_comm = threading.current_thread().name.startswith("onebit-exchange")
            self.log.append(("comm" if on_comm else "main",) + what)

        def bind_thread(self, device):
            self.note("bind", str(device))

        def current_stream(self, index=None):
            me = threading.current_thread()
            if me not in self.current:
                self.current[me] = self.Stream()
            return self.current[me]

        def stream(self, s):
            @contextlib.contextmanager
            def entered():
                me = threading.current_thread()
                before, self.current[me] = self.current.get(me), s
                try:
                    yield
                finally:
                    self.current[me] = before
            return entered()

        @property
        def Stream(self):  # noqa: N802
            rec = self

            class S:
                def __init__(s, device=None, **_):
                    s.id = next(rec.ids)

                def wait_event(s, e):
                    rec.note("wait", s.id, e.id)
            return S

        @property
        def Event(self):  # noqa: N802
            rec = self

            class E:
                def __init__(e, enable_timing=False, **_):
                    e.id, e.timing = next(rec.ids), enable_timing

                def record(e, stream=None):
                    if not e.timing:  # timing events (the tuner's clock) hand nothing over
                        rec.note("record", e.id, stream.id)

                def synchronize(e):
                    pass

                def elapsed_time(e, end):
                    return 1.0
            return E

    return Recording()


def _overlap_log(rank, world):
    import onebit
    from onebit.accelerator import set_accelerator

    acc = _recording_accelerator()
    set_accelerator(acc)
    torch.manual_seed(0)
    model = Model()
    opt = onebit.OnebitAdam(model.parameters(), lr=1e-2, freeze_step=2, overlap_backward=True,
                            bucket_cap_mb=0.004)
    exchange = opt.backend.compressed_allreduce

    def logged(*args, **kw):
        acc.note("exchange", acc.current_stream().id)
        return exchange(*args, **kw)

    opt.backend.compressed_allreduce = logged
    for step in range(5):
        x, y = batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return acc.log, opt.overlap_stats()


def test_exchanges_are_ordered_by_events_on_a_stream_of_their_own():
    for log, stats in run_workers(_overlap_log, 2, timeout=120):
        assert stats["launched_in_backward"] > 3
        binds = [e for e in log if e[1] == "bind"]
        assert binds == [("comm", "bind", "cpu")], binds  # once, on the comm thread
        recorded = {e[2]: (e[0], e[3]) for e in log if e[1] == "record"}  # event -> thread, stream
        comm = [e for e in log if e[0] == "comm"]  # the communication thread's own order
        exchanges = [i for i, e in enumerate(comm) if e[1] == "exchange"]
        assert len(exchanges) == stats["launched_in_backward"] + stats["launched_in_step"]
        for i in exchanges:
            comm_stream = comm[i][2]
            wait = comm[i - 1]  # right before: the comm stream waits on the input's event
            assert wait[:3] == ("comm", "wait", comm_stream), comm[i - 3:i + 1]
            assert recorded[wait[3]][0] == "main" and recorded[wait[3]][1] != comm_stream
            done = comm[i + 1]  # right after: the exchange's own event, on the comm stream
            assert done[:2] == ("comm", "record") and done[3] == comm_stream
            after = log[log.index(done) + 1:]
            consumed = [e for e in after if e[:2] == ("main", "wait") and e[3] == done[2]]
            assert consumed, f"step() never waited for event {done[2]}"
            assert consumed[0][2] != comm_stream
