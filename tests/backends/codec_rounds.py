"""Rounds of the compressed allreduce with a given code on real ranks, and
the checks every code must pass, shared by the code tests (test_ternary.py,
test_sparse_codec.py): every rank holds the same bits, each round is in
lockstep with the float64 reference, and error feedback loses nothing."""
import numpy as np
import torch

from tests import reference

SIZES = [300, 5, 1000, 64, 2049]  # fused, one tensor orders of magnitude below the rest
ROUNDS = 4


def logged_rounds(rank, world, codec, block):
    """ROUNDS compressed allreduces of SIZES-shaped random tensors with
    `codec`, each logged with its inputs, output and errors before and after."""
    import torch.distributed as dist

    from onebit.backends import CompressedBackend

    backend = CompressedBackend(block_size=block, codec=codec)
    layout = backend.layout(SIZES)
    werr, serr = torch.zeros(layout.padded), torch.zeros(layout.padded // world)
    log = []
    for r in range(ROUNDS):
        g = torch.Generator().manual_seed(100 * r + rank)
        parts = [torch.randn(s, generator=g) * (1 + rank) for s in SIZES]
        parts[3].mul_(1e-5)
        flat = torch.zeros(layout.numel)
        for v, t in zip(layout.views(flat, [(s,) for s in SIZES]), parts):
            v.copy_(t)
        before = (werr.clone(), serr.clone())
        backend.compressed_allreduce(flat, werr, serr, layout=layout)
        log.append({"inputs": [t.numpy() for t in parts], "out": flat.clone().numpy(),
                    "werr_before": before[0].numpy(), "serr_before": before[1].numpy(),
                    "werr": werr.clone().numpy(), "serr": serr.clone().numpy()})
    dist.barrier()
    return {"log": log, "offsets": list(layout.offsets), "numel": layout.numel,
            "padded": layout.padded, "sent": backend.stats.totals["bytes_sent"]}


def check_round(results, r, block, quantize):
    """Round r of every rank's `logged_rounds`: the same output bits on
    every rank, and error feedback loses nothing (out = mean(x + w - w') +
    s - s', element by element). Returns (output per tensor, the
    reference's output per tensor), the reference in lockstep from the
    backend's own errors with `quantize` (tests/reference.py)."""
    offsets, numel, n = results[0]["offsets"], results[0]["numel"], results[0]["padded"]
    logs = [res["log"][r] for res in results]
    outs = [lg["out"] for lg in logs]
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])
    tensors = [[t.astype(np.float64) for t in lg["inputs"]] for lg in logs]
    ref_out, _, _, _ = reference.reference_round(
        tensors, [lg["werr_before"].astype(np.float64) for lg in logs],
        [lg["serr_before"].astype(np.float64) for lg in logs], block, quantize=quantize)
    x = np.zeros((len(logs), n))
    for k, lg in enumerate(logs):
        for o, t in zip(offsets, lg["inputs"]):
            x[k, o:o + len(t)] = t
    w_change = np.mean([lg["werr_before"] - lg["werr"] for lg in logs], 0)
    s_change = np.concatenate([lg["serr_before"] - lg["serr"] for lg in logs])
    expected = x.mean(0) + w_change + s_change
    real = np.zeros(n, dtype=bool)
    for o, s in zip(offsets, SIZES):
        real[o:o + s] = True
    np.testing.assert_allclose(outs[0][:numel][real[:numel]], expected[:numel][real[:numel]],
                               rtol=0, atol=1e-5 * np.abs(expected).max())
    return [outs[0][o:o + s] for o, s in zip(offsets, SIZES)], ref_out
