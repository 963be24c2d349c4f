"""Run a test body on real local processes (gloo over loopback) with a deadline:
a hang costs seconds, never CI's 90 minutes. A thin wrapper over
onebit.launch.spawn_local, with one thread per rank (p ranks share 2 cores),
forked from a server that has imported torch (a rank starts in a fraction of
the second that a fresh interpreter importing torch takes)."""
from onebit.launch import spawn_local


def run_workers(fn, world_size, *args, timeout=120, env=None, pg_timeout=60, may_die=(),
                backend="gloo"):
    try:
        return spawn_local(fn, world_size, *args, timeout=timeout, env=env,
                           pg_timeout_s=pg_timeout, threads=1, may_die=may_die,
                           start_method="forkserver", backend=backend)
    except RuntimeError as exc:
        raise AssertionError(str(exc)) from None
