"""The communication thread's side of an exchange: its own process group,
and the device-work ordering between it and the training thread. The
optimizers' backward overlap and streaming DiLoCo both run their exchanges
on such a thread."""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import collectives
from .accelerator import accelerator_for


class StreamHandoff:
    """Orders device work that crosses between the compute thread and the
    communication thread (the design's "Devices and streams"): the producer
    records an event on its stream, the consumer's stream waits on it, and
    no host sync is needed. The communication thread binds the data's device
    once and runs every exchange on a stream of its own. On the host (or an
    accelerator without streams) the events are trivially complete."""

    def __init__(self) -> None:
        self.comm_stream = None

    @staticmethod
    def _accelerator(device: torch.device):
        return accelerator_for(device)

    def produced(self, device: torch.device):
        """An event after what the calling thread's stream queued so far."""
        acc = self._accelerator(device)
        event = acc.Event()
        event.record(acc.current_stream(device.index))
        return event

    def run_on_comm_thread(self, device: torch.device, ready, work) -> object:
        """On the communication thread: once `ready` has happened, `work()`
        on this thread's stream; returns the event after it."""
        acc = self._accelerator(device)
        if self.comm_stream is None:
            acc.bind_thread(device)
            self.comm_stream = acc.Stream(device=device)
        with acc.stream(self.comm_stream):
            self.comm_stream.wait_event(ready)
            work()
            done = acc.Event()
            done.record(self.comm_stream)
        return done

    def consume(self, device: torch.device, done) -> None:
        """The calling thread's stream waits for `done` before what it queues next."""
        acc = self._accelerator(device)
        acc.current_stream(device.index).wait_event(done)


def exchange_group(process_group):
    """A process group of the same ranks and backends as `process_group`
    (None: the world), for the exchanges of the communication thread alone.
    The same backends, not the world's: a gloo group for host tensors in a
    job whose world is cuda:gloo or nccl must stay one."""
    group = process_group if process_group is not None else dist.group.WORLD
    return dist.new_group(dist.get_process_group_ranks(group),
                          backend=collectives.backend_config(group),
                          use_local_synchronization=True)
