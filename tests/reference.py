"""Independent float64 reference of the compressed allreduce, written from the
1-bit Adam paper (Tang et al., 2021, Alg. 1) and DESIGN.md -- it imports
nothing from onebit, so a bug there cannot hide here."""
import numpy as np


def sign(x):
    """+1 where x >= 0 (so sign(0) = +1), -1 elsewhere."""
    return np.where(x >= 0, 1.0, -1.0)


def reference_round(buffers, worker_errors, server_errors):
    """One compressed allreduce across p simulated ranks.

    buffers: p arrays of numel values (rank i's momentum).
    worker_errors: p arrays of N; server_errors: p arrays of N/p.
    Returns (output[numel], new worker_errors, new server_errors, server_values)
    where server_values[N] holds each chunk's compensated server value c
    (used by the tests to skip positions whose sign is a coin toss).
    """
    p = len(buffers)
    n = len(worker_errors[0])
    chunk = n // p
    numel = len(buffers[0])
    w_scaled, new_w = [], []
    for i in range(p):
        x = np.zeros(n)
        x[:numel] = buffers[i]
        x = x + worker_errors[i]
        s = np.linalg.norm(x) / np.sqrt(n)
        w_scaled.append(s * sign(x))
        new_w.append(x - s * sign(x))
    out, new_s, server_values = np.zeros(n), [], np.zeros(n)
    for k in range(p):
        part = slice(k * chunk, (k + 1) * chunk)
        c = np.mean([w_scaled[i][part] for i in range(p)], axis=0) + server_errors[k]
        s = np.linalg.norm(c) / np.sqrt(chunk)
        new_s.append(c - s * sign(c))
        out[part] = s * sign(c)
        server_values[part] = c
    return out[:numel], new_w, new_s, server_values
