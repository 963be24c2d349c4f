"""Independent float64 reference of the compressed allreduce (wire format v2),
written from the 1-bit Adam paper (Tang et al., 2021, Alg. 1) and docs/design.md's
block-scale contract -- it imports nothing from onebit, so a bug there cannot
hide here.

The maths, for p ranks, tensors t_1..t_m and block size B:
- place each tensor at the next multiple of B; N = the smallest multiple of
  B*p that holds them all (at least B*p); every other position is "not real";
- worker i: x = its tensors + worker error; for each block b of B positions,
  s_b = sqrt(sum of x^2 over b's real positions / their count) (0 if none);
  q = s_b * sign(x) on real positions, 0 elsewhere; new error = x - q;
- rank k serves positions [k*N/p, (k+1)*N/p): c = mean_i q_i + server error,
  compressed the same way (per block, real positions only);
- every rank's output is the concatenation of the p compressed chunks.
"""
import numpy as np


def sign(x):
    """+1 where x >= 0 (so sign(0) = +1), -1 elsewhere."""
    return np.where(x >= 0, 1.0, -1.0)


def placement(sizes, block, p):
    """(offsets, N, real mask[N]) of tensors of `sizes` elements."""
    offsets, pos = [], 0
    for s in sizes:
        offsets.append(pos)
        pos += -(-s // block) * block
    unit = block * p
    n = max(unit, -(-pos // unit) * unit)
    real = np.zeros(n, dtype=bool)
    for o, s in zip(offsets, sizes):
        real[o:o + s] = True
    return offsets, n, real


def compress(x, real, block, round_scale):
    """(q, new error, scales) of x, one scale per block over its real positions."""
    xb, rb = x.reshape(-1, block), real.reshape(-1, block)
    count = rb.sum(1)
    s = np.sqrt((np.where(rb, xb, 0.0) ** 2).sum(1) / np.maximum(count, 1))
    s = round_scale(s)
    q = np.where(rb, s[:, None] * sign(xb), 0.0).reshape(-1)
    return q, np.where(real, x - q, 0.0), s


def ternary(x, real, block, round_scale):
    """The 2-bit code (Ternary Weight Networks, Li and Liu 2016): per block,
    t = 0.7 * mean |x| over its real positions; q = s * sign(x) where |x| >
    t, else 0, with s = the mean |x| over those positions (0 if none).
    Returns (q, new error, scales) as `compress` does."""
    xb, rb = x.reshape(-1, block), real.reshape(-1, block)
    a = np.where(rb, np.abs(xb), 0.0)
    t = 0.7 * (a.sum(1) / np.maximum(rb.sum(1), 1))
    kept = rb & (a > t[:, None])
    s = round_scale(np.where(kept, a, 0.0).sum(1) / np.maximum(kept.sum(1), 1))
    q = np.where(kept, s[:, None] * sign(xb), 0.0).reshape(-1)
    return q, np.where(real, x - q, 0.0), s


def sparse(x, real, block, round_scale, keep=4):
    """The sparse 2-bit code (after SparseLoCo, Sarfi et al. 2025), from
    its definition: per block, the `keep` positions of largest |x| among
    the real nonzero ones, ties to the lower position; s = the mean |x|
    over them (0 if none); q = sign(x) * (2 s where |x| > 1.5 s, else s)
    there, 0 elsewhere. Returns (q, new error, scales) as `compress` does."""
    xb, rb = x.reshape(-1, block), real.reshape(-1, block)
    q, scales = np.zeros_like(xb), np.zeros(len(xb))
    for b in range(len(xb)):
        a = np.where(rb[b], np.abs(xb[b]), 0.0)
        order = np.argsort(-a, kind="stable")[:keep]
        chosen = order[a[order] > 0]
        s = round_scale(np.array([a[chosen].mean() if chosen.size else 0.0]))[0]
        magnitude = np.where(a[chosen] > 1.5 * s, 2.0 * s, s)
        q[b, chosen] = np.where(xb[b, chosen] < 0, -magnitude, magnitude)
        scales[b] = s
    q = q.reshape(-1)
    return q, np.where(real, x - q, 0.0), scales


def compressed_round(xs, worker_errors, server_errors, real, block, round_scale=lambda s: s,
                     quantize=compress):
    """One compressed allreduce of already placed buffers xs[i] (N each,
    zeros where `real` is False) across len(xs) simulated ranks.
    Returns (output[N], new worker_errors, new server_errors, c[N])."""
    p, n = len(xs), len(xs[0])
    chunk = n // p
    qs, new_w = [], []
    for i in range(p):
        q, err, _ = quantize(xs[i] + worker_errors[i], real, block, round_scale)
        qs.append(q)
        new_w.append(err)
    out, new_s, server_values = np.zeros(n), [], np.zeros(n)
    for k in range(p):
        part = slice(k * chunk, (k + 1) * chunk)
        c = np.mean([q[part] for q in qs], axis=0) + server_errors[k]
        c = np.where(real[part], c, 0.0)
        q, err, _ = quantize(c, real[part], block, round_scale)
        new_s.append(err)
        out[part] = q
        server_values[part] = c
    return out, new_w, new_s, server_values


def place(tensors, offsets, n):
    x = np.zeros(n)
    for o, t in zip(offsets, tensors):
        x[o:o + len(t)] = t
    return x


def reference_round(tensors, worker_errors, server_errors, block, round_scale=lambda s: s,
                    quantize=compress):
    """One compressed allreduce across p simulated ranks.

    tensors: p lists (one per rank) of 1-D arrays, the same sizes on every rank.
    worker_errors: p arrays of N; server_errors: p arrays of N/p.
    round_scale: what the wire does to a scale (identity for fp32 within the
    tests' tolerance; bf16 rounding for 16-bit scales). quantize: `compress`
    (1 bit), `ternary` (2 bits) or `sparse` (top-k, 2 bits).
    Returns (outputs: one array per tensor, new worker_errors, new
    server_errors, server_values[N]) where server_values holds each chunk's
    compensated value c (the tests skip positions whose sign is a coin toss).
    """
    p = len(tensors)
    sizes = [len(t) for t in tensors[0]]
    offsets, n, real = placement(sizes, block, p)
    assert len(worker_errors[0]) == n, (len(worker_errors[0]), n)
    xs = [place(ts, offsets, n) for ts in tensors]
    out, new_w, new_s, c = compressed_round(xs, worker_errors, server_errors, real, block,
                                            round_scale, quantize)
    return [out[o:o + s] for o, s in zip(offsets, sizes)], new_w, new_s, c


def hierarchical_round(tensors, worker_errors, server_errors, block, nodes):
    """The hierarchical allreduce (full precision inside a node, 1 bit
    between nodes) across simulated ranks, from its three-stage definition:

    - place the tensors as for K*M ranks (K ranks on each of M nodes), N
      elements, and cut N into K shards of S = N/K;
    - each node averages its ranks' buffers exactly;
    - shard s: the compressed allreduce above among the M nodes, node n
      played by its s-th rank (nodes[n][s]) with that rank's errors
      (worker S, server S/M); with one node, the exact mean and no errors;
    - every rank's output is the concatenation of the shards.

    tensors, worker_errors, server_errors: indexed by rank. Returns
    (outputs per tensor, new worker_errors, new server_errors, c[N]) with
    errors indexed by rank as given.
    """
    k, m = len(nodes[0]), len(nodes)
    sizes = [len(t) for t in tensors[0]]
    offsets, n, real = placement(sizes, block, k * m)
    s_len = n // k
    means = [np.mean([place(tensors[r], offsets, n) for r in ranks], axis=0) for ranks in nodes]
    out, c = np.zeros(n), np.zeros(n)
    new_w, new_s = list(worker_errors), list(server_errors)
    for s in range(k):
        part = slice(s * s_len, (s + 1) * s_len)
        if m == 1:
            out[part], c[part] = means[0][part], means[0][part]
            continue
        members = [ranks[s] for ranks in nodes]
        o, w, sv, cs = compressed_round([mean[part] for mean in means],
                                        [worker_errors[r] for r in members],
                                        [server_errors[r] for r in members], real[part], block)
        out[part], c[part] = o, cs
        for r, w_, s_ in zip(members, w, sv):
            new_w[r], new_s[r] = w_, s_
    return [out[o:o + s] for o, s in zip(offsets, sizes)], new_w, new_s, c
