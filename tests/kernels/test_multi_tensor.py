"""How 0/1 Adam hands its passes to the device's fused kernels
(onebit/multi_tensor.py), checked on the CPU: each kernel is stood in for by
its contract written in torch (what its docstring and the CUDA source
promise), and a run that takes them must follow the run that does not,
with tensors never seen, rows masked and every stage of 0/1 Adam. The
kernels themselves are checked against torch's ops on a GPU
(tests/gpu/test_gpu.py)."""
import pytest
import torch

import onebit
import onebit.multi_tensor as multi_tensor


def _zero_one_step(lists, sizes, w, bc1, wd, neg_lr):
    for p, g, m, d in zip(*lists):
        m.lerp_(g, w)
        u = m / d
        if bc1 != 1.0:
            u = u / bc1
        if wd:
            u = u + wd * p
        p.add_(u * neg_lr)


def _zero_one_local_step(lists, sizes, w, wd_alpha, value):
    for p, g, m, d, u, a in zip(*lists):
        m.lerp_(g, w)
        if wd_alpha:
            u.add_(wd_alpha * p)
        u.add_(value * (m / d))
        p.copy_(a + u)


def _zero_one_sync_input(lists, sizes, w, neg_inv_bc1, neg_wd):
    for out, p, m, g, d in zip(*lists):
        o = torch.lerp(m, g, w) * neg_inv_bc1
        if neg_wd:
            o = o + neg_wd * (p * d)
        out.copy_(o)


def _zero_one_land(lists, sizes, lr, neg_bc1):
    for p, m, d in zip(*lists):
        p.add_(lr * (m / d))
        m.mul_(neg_bc1)


CONTRACTS = {"zero_one_step": _zero_one_step, "zero_one_local_step": _zero_one_local_step,
             "zero_one_sync_input": _zero_one_sync_input, "zero_one_land": _zero_one_land}


def _run(scaler: int, calls=None):
    """16 steps of 0/1 Adam on a model with an embedding whose rows 0-2
    never get a gradient, a tensor that never gets one, and scales far
    apart; `calls` (a list): the kernels' contracts stand in, each call
    recorded as (name, number of tensors)."""
    if calls is not None:
        def kernel(name, *lists):
            def launch(*args):
                calls.append((name, len(args[0][0])))
                CONTRACTS[name](*args)
            return launch if name in CONTRACTS else None
        saved, multi_tensor.list_kernel = multi_tensor.list_kernel, kernel
    try:
        g = torch.Generator().manual_seed(0)
        emb = torch.nn.Parameter(torch.randn(10, 4, generator=g))
        params = [emb, torch.nn.Parameter(torch.randn(30, generator=g) * 1e-3),
                  torch.nn.Parameter(torch.randn(7, generator=g)),  # never a gradient
                  torch.nn.Parameter(torch.randn(5, 3, generator=g) * 100)]
        start = [p.detach().clone() for p in params]
        opt = onebit.ZeroOneAdam(params, lr=1e-2, weight_decay=0.01, var_freeze_step=3,
                                 var_update_scaler=1, local_step_scaler=scaler,
                                 local_step_clipper=4)
        for _ in range(16):
            rows = torch.zeros(10, 4)
            rows[3:] = torch.randn(7, 4, generator=g)
            emb.grad = rows
            params[1].grad = torch.randn(30, generator=g)
            params[3].grad = torch.randn(5, 3, generator=g)
            opt.step()
        return start, [p.detach().clone() for p in params]
    finally:
        if calls is not None:
            multi_tensor.list_kernel = saved


@pytest.mark.parametrize("scaler", [2, 10**6])  # local steps after two syncs; syncs only
def test_zero_one_adam_through_the_kernels_contracts_follows_torchs_ops(scaler):
    calls = []
    start, fused = _run(scaler, calls)
    _, plain = _run(scaler)
    names = {name for name, _ in calls}
    want = {"zero_one_step", "zero_one_land", "zero_one_sync_input"}
    assert want | ({"zero_one_local_step"} if scaler == 2 else set()) == names, calls
    # The tensor never seen stays out of every kernel, and the embedding
    # (rows masked) out of the sync's input.
    assert all(n == 3 for name, n in calls if name != "zero_one_sync_input"), calls
    assert all(n == 2 for name, n in calls if name == "zero_one_sync_input"), calls
    for a, b in zip(fused, plain):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
    moved = [not torch.equal(a, b) for a, b in zip(fused, start)]
    assert moved == [True, True, False, True]  # never a gradient: never moved


def test_a_list_spread_over_devices_takes_torchs_ops(monkeypatch):
    """A kernel launches on one device with a table of pointers: a list
    with a tensor elsewhere (the host, another GPU) must not reach it. Meta
    tensors stand in for GPU tensors: their get_device gives the GPU's
    number the test assigns (a real one's is its index; the host's is -1,
    as torch gives)."""
    import types

    import onebit.ops as ops

    kernel = object()
    monkeypatch.setattr(ops, "kernels_for", lambda device: types.SimpleNamespace(tensor_norms=kernel))
    gpu_of = {}
    host_index = torch.Tensor.get_device
    monkeypatch.setattr(torch.Tensor, "get_device", lambda t: gpu_of.get(id(t), host_index(t)))

    def on_gpu(number, n, dtype=torch.float32):
        t = torch.empty(n, device="meta", dtype=dtype)
        gpu_of[id(t)] = number
        return t

    here = [on_gpu(0, 4), on_gpu(0, 3)]
    assert multi_tensor.list_kernel("tensor_norms", here) is kernel
    assert multi_tensor.list_kernel("tensor_norms", here + [torch.zeros(2)]) is None
    assert multi_tensor.list_kernel("tensor_norms", here, [torch.zeros(4), here[1]]) is None
    assert multi_tensor.list_kernel("tensor_norms", here + [on_gpu(1, 2)]) is None
    assert multi_tensor.list_kernel("tensor_norms", [on_gpu(1, 2), on_gpu(1, 5)]) is kernel
    assert multi_tensor.list_kernel("tensor_norms", here + [on_gpu(0, 2, torch.float16)]) is None


def test_norms_without_the_kernel_keep_empty_tensors_out_of_foreach_norm(monkeypatch):
    """torch 2.2-2.5's CUDA _foreach_norm gave wrong norms for lists holding
    empty tensors (pytorch#140066): they get 0 without it. Against numpy's
    float64 norms, to fp32's summing error."""
    import numpy as np

    seen, real = [], torch._foreach_norm
    monkeypatch.setattr(torch, "_foreach_norm", lambda ts: seen.append(list(ts)) or real(ts))
    g = torch.Generator().manual_seed(3)
    tensors = [torch.empty(0), torch.randn(5, generator=g), torch.empty(0, 3),
               torch.randn(2, 3, generator=g) * 1e-3]
    out = multi_tensor.tensor_norms(tensors)
    assert all(t.numel() for ts in seen for t in ts) and len(seen) == 1
    want = [np.linalg.norm(t.double().numpy()) for t in tensors]
    assert out.dtype == torch.float32
    np.testing.assert_allclose(out.double().numpy(), want, rtol=1e-6, atol=0)
    seen.clear()
    assert multi_tensor.tensor_norms([torch.empty(0), torch.empty(2, 0)]).tolist() == [0.0, 0.0]
    assert not seen
