""""The same bits", guarded in the repo: a committed fixture holds a hash of
every parameter, every state tensor and every error-feedback buffer after
40 steps of each optimizer through all its stages, on 3 real ranks, fused
and with overlap_backward, of 1-bit Adam on the hierarchical backend
(2 nodes of 2 ranks), and of DiLoCo over inner AdamW (1-bit, bf16 and fp32
rounds; streaming with a warmup, outer momentum and a stepped outer lr).
Any change to the arithmetic of an optimizer, of DiLoCo or of the backend,
down to the rounding of one element, changes a hash here.

The gradients are exact by construction: the loss is a sum of each
parameter times an integer-valued tensor scaled by a power of two, so
backward hands every optimizer the same bits on any CPU. A real forward
pass would not: its matmuls go through the BLAS, whose summation order
depends on the CPU (an AVX-512 AMD EPYC and the machine that first wrote
this fixture disagreed on 365 of its 602 hashes through the model alone).
Backward still runs, so overlap_backward's hooks fire as in training.

The fixture is keyed by what may legitimately change bits: the torch
version, the CPU kernel in use (native C++ or the pure-torch fallback), and
the instruction set torch's own CPU kernels dispatch to (with FMA or
without, its elementwise ops round differently). `ATEN_CPU_CAPABILITY`
lowers the latter, so one machine can write every entry:
`ATEN_CPU_CAPABILITY=avx2 ONEBIT_WRITE_FIXTURE=1 pytest tests/optim/test_bits_fixture.py`.
Elsewhere the test skips and says so. A change that alters bits on purpose
regenerates the fixture (ONEBIT_WRITE_FIXTURE=1) and commits its diff with
the reason; a change that keeps the maths must leave it as it is.
"""
import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from tests.distributed import run_workers

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "bits.json"
STEPS = 40
OPTIMIZERS = {
    "OnebitAdam": dict(freeze_step=10),
    "OnebitLamb": dict(freeze_step=10),
    # variance updates at 1, 2, 4, 8; 1-bit gradients until 16; then syncs
    # every step for 2 steps, every 2 for 2, ... (local steps from 19 on)
    "ZeroOneAdam": dict(var_freeze_step=16, var_update_scaler=1, local_step_scaler=2,
                        local_step_clipper=4),
}


class Model(torch.nn.Module):
    """Looks like a real model: an embedding most of whose rows a step never
    touches, gradients 2^12 apart in scale, and a head that never gets a
    gradient."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(300, 12)
        self.hidden = torch.nn.Linear(12, 40)
        self.out = torch.nn.Parameter(torch.randn(40, 6) * 1e2)
        self.emb.weight.data.mul_(1e-2)
        self.unused_head = torch.nn.Linear(40, 3)

    def exact_loss(self, g: torch.Generator) -> torch.Tensor:
        """A loss whose gradient is, bit for bit, an integer tensor times a
        power of two: 24 distinct embedding rows, the hidden layer, and the
        output 2^12 smaller than the hidden layer."""

        def ints(*shape):
            return torch.randint(-2 ** 12, 2 ** 12, shape, generator=g).float()

        rows = torch.randperm(300, generator=g)[:24]
        return ((self.emb(rows) * ints(24, 12) * 2.0 ** -16).sum()
                + (self.hidden.weight * ints(40, 12) * 2.0 ** -14).sum()
                + (self.hidden.bias * ints(40) * 2.0 ** -14).sum()
                + (self.out * ints(40, 6) * 2.0 ** -26).sum())


def _digest(t: torch.Tensor) -> str:
    raw = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
    return f"{t.dtype}:{tuple(t.shape)}:" + hashlib.sha256(raw).hexdigest()[:16]


def _hashes(model, opt, errors_of=None) -> dict:
    """Hashes of the params, `opt`'s state and the error buffers of
    `errors_of` (default: `opt`; DiLoCo keeps its own)."""
    out = {}
    names = {p: n for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        out[f"param {n}"] = _digest(p)
    for p, st in opt.state.items():
        for k, v in sorted(st.items()):
            if isinstance(v, torch.Tensor) and v.numel():
                out[f"state {names[p]} {k}"] = _digest(v)
    for g, bufs in sorted((errors_of or opt).error_feedback_state_dict()["groups"].items()):
        out[f"errors {g} worker"] = _digest(bufs["worker"])
        out[f"errors {g} server"] = _digest(bufs["server"])
    return out


def _run(rank, world, runs):
    import onebit

    result = {}
    for name, cls_name, extra in runs:
        torch.manual_seed(0)
        model = Model()
        opt = getattr(onebit, cls_name)(model.parameters(), lr=1e-3, weight_decay=1e-3,
                                        bucket_cap_mb=0.004, **OPTIMIZERS[cls_name], **extra)
        for step in range(STEPS):
            opt.zero_grad()
            model.exact_loss(torch.Generator().manual_seed(1000 * rank + step)).backward()
            opt.step()
        result[name] = _hashes(model, opt)
    return result


DILOCO = {
    "DiLoCo 1bit H4": dict(sync_every=4, outer_lr="stepped"),
    "DiLoCo bf16 H4": dict(sync_every=4, compression="bf16"),
    "DiLoCo fp32 H4": dict(sync_every=4, compression="none"),
    # fragments land 2 inner steps after their launch, some after the lr's switch
    "DiLoCo 1bit streaming": dict(sync_every=6, fragments=3, overlap_steps=2, warmup_steps=4,
                                  outer_momentum=0.5, nesterov=True, outer_lr="stepped"),
    # the same, each landing re-adding the rank's own steps since the launch
    "DiLoCo 1bit streaming, local progress kept": dict(
        sync_every=6, fragments=3, overlap_steps=2, warmup_steps=4, outer_momentum=0.5,
        nesterov=True, outer_lr="stepped", keep_local_progress=1.0),
}


def _run_diloco(rank, world, runs):
    import onebit

    result = {}
    for name in runs:
        settings = dict(DILOCO[name])
        if settings.get("outer_lr") == "stepped":
            settings["outer_lr"] = onebit.SteppedOuterLR(1.3, 2.0, from_step=21)
        torch.manual_seed(0)
        model = Model()
        inner = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-3)
        diloco = onebit.DiLoCo(model, inner, **settings)
        for step in range(STEPS):
            inner.zero_grad()
            model.exact_loss(torch.Generator().manual_seed(1000 * rank + step)).backward()
            inner.step()
        diloco.drain()
        out = _hashes(model, inner, errors_of=diloco)
        state = diloco.state_dict()
        for i, anchor in enumerate(state["anchors"]):
            out[f"anchor {i}"] = _digest(anchor)
        for i, st in state["outer_optimizer"]["state"].items():
            out[f"outer momentum {i}"] = _digest(st["momentum_buffer"])
        result[name] = out
    return result


def _cpu_vendor() -> str:
    """The CPU's vendor_id (GenuineIntel, AuthenticAMD), from /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown vendor"


def _key() -> str:
    # The vendor too: the same torch build at the same ATen capability gave
    # other bits on an Intel Xeon (Sapphire Rapids) than on the AMD EPYC
    # that wrote the first entries, in the param updates only (every
    # momentum, variance and error buffer equal), at each of ATen's AVX512,
    # AVX2 and DEFAULT levels alike, with MKL held to AVX2 too.
    from onebit import ops

    return (f"torch {torch.__version__.split('+')[0]}, "
            f"cpu kernel {ops.kernels_for(torch.device('cpu')).name}, "
            f"aten {torch.backends.cpu.get_cpu_capability()}, {_cpu_vendor()}")


def current_bits() -> dict:
    flat = [(f"{c} {m} p3", c, dict(overlap_backward=m == "overlap"))
            for c in OPTIMIZERS for m in ("fused", "overlap")]
    bits = run_workers(_run, 3, flat, timeout=240)
    hier = [("OnebitAdam hierarchical 2x2", "OnebitAdam", dict(comm_backend_name="hierarchical"))]
    bits4 = run_workers(_run, 4, hier, timeout=240, env={"ONEBIT_RANKS_PER_NODE": "2"})
    diloco = run_workers(_run_diloco, 3, list(DILOCO), timeout=240)
    return {f"rank {r}": {**bits[r], **bits4[r], **diloco[r]} for r in range(3)} | {
        "rank 3": bits4[3]}


def test_bits_match_the_committed_fixture():
    fixture = json.loads(FIXTURE.read_text()) if FIXTURE.exists() else {}
    key = _key()
    now = current_bits()
    if os.environ.get("ONEBIT_WRITE_FIXTURE") == "1":
        fixture[key] = now
        FIXTURE.write_text(json.dumps(fixture, indent=1, sort_keys=True) + "\n")
        return
    if key not in fixture:
        pytest.skip(f"the fixture has no entry for {key!r} (it has {sorted(fixture)}); "
                    "write one with ONEBIT_WRITE_FIXTURE=1")
    want = fixture[key]
    differ = [f"{r}: {run}: {k}" for r in want for run in want[r] for k in want[r][run]
              if now.get(r, {}).get(run, {}).get(k) != want[r][run][k]]
    assert not differ and now == want, (
        f"{len(differ)} hashes differ from the committed fixture ({key}), first: {differ[:8]}. "
        "If the change means to alter bits, rerun with ONEBIT_WRITE_FIXTURE=1 and commit the "
        "fixture diff with the reason")


def test_the_foreach_forms_of_many_small_tensors_keep_the_bits():
    """On an accelerator, lists of many small tensors take the foreach forms
    (functional.foreach_pays: a copy, then the op in place) instead of an
    out= launch per tensor. ONEBIT_FOREACH_BELOW forces them here: the three
    optimizers, fused and overlapped, give the fixture's bits."""
    fixture = json.loads(FIXTURE.read_text()) if FIXTURE.exists() else {}
    if _key() not in fixture:
        pytest.skip(f"the fixture has no entry for {_key()!r}")
    flat = [(f"{c} {m} p3", c, dict(overlap_backward=m == "overlap"))
            for c in OPTIMIZERS for m in ("fused", "overlap")]
    now = run_workers(_run, 3, flat, timeout=240, env={"ONEBIT_FOREACH_BELOW": str(1 << 40)})
    want = fixture[_key()]
    for r in range(3):
        for run, _, _ in flat:
            assert now[r][run] == want[f"rank {r}"][run], (r, run)
