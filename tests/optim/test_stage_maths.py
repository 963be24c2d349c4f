"""Each optimizer's stage maths as a function, with no optimizer and no
process group: a fake exchange stands in for the ranks, and every result is
checked against a float64 numpy reference written here."""
import numpy as np
import pytest
import torch

from onebit.optim.adam import onebit_adam
from onebit.optim.functional import adam_moments_
from onebit.optim.lamb import onebit_lamb_fresh_step_
from onebit.optim.zoadam import sync_local_steps_, sync_single_

EPS = 1e-8


class HalvingExchange:
    """As if a second rank sent zeros: the "average" is half the input."""

    def __init__(self) -> None:
        self.sent = None

    def inputs(self, out):
        self.sent = [torch.empty_like(o) for o in out]
        return self.sent

    def parts(self, out, seen, masks):
        if out is None:
            for s in self.sent:
                s.mul_(0.5)
        else:
            for o, s, ok in zip(out, self.sent, seen):
                o.copy_(s * 0.5 if ok else torch.zeros_like(s))
        yield list(range(len(self.sent)))

    def average_(self, out, seen, masks):
        for _ in self.parts(out, seen, masks):
            pass


def tensors(seed, *shapes, positive=False):
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(s, generator=g) for s in shapes]
    return [t.abs() + 0.1 for t in out] if positive else out


def f64(ts):
    return [t.double().numpy().copy() for t in ts]


def denominators(v, bc2):
    return [torch.sqrt(x / bc2) + EPS for x in v]


@pytest.mark.parametrize("compressed", [False, True], ids=["warmup", "compression"])
def test_onebit_adam_matches_a_float64_adam_step(compressed):
    shapes = [(3, 4), (5,)]
    params, grads, m = tensors(0, *shapes), tensors(1, *shapes), tensors(2, *shapes)
    v = tensors(3, *shapes, positive=True)
    P, G, M, V = f64(params), f64(grads), f64(m), f64(v)
    b1, b2, lr, wd, bc1, bc2 = 0.9, 0.99, 0.1, 0.01, 0.5, 0.25
    exchange = HalvingExchange() if compressed else None
    if not compressed:  # the warmup's moments first: the denominators are the new v's
        adam_moments_(grads, m, v, beta1=b1, beta2=b2)
    onebit_adam(params, grads, m, denominators(v, bc2), seen=[True] * len(v),
                masks=[None] * len(v), exchange=exchange, exp_avg_mask=None,
                beta1=b1, lr=lr, weight_decay=wd, bc1=bc1)
    for p, g, mm, vv, p_t, m_t, v_t in zip(P, G, M, V, params, m, v):
        new_m = b1 * mm + (1 - b1) * g
        if compressed:  # v frozen; m is the exchanged average of the new momentum
            new_m, new_v = 0.5 * new_m, vv
        else:
            new_v = b2 * vv + (1 - b2) * g * g
        expected = p - lr * (new_m / bc1 / (np.sqrt(new_v / bc2) + EPS) + wd * p)
        np.testing.assert_allclose(m_t.numpy(), new_m, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(v_t.numpy(), new_v, rtol=1e-6)
        np.testing.assert_allclose(p_t.numpy(), expected, rtol=1e-5, atol=1e-6)


def test_onebit_adam_moves_nothing_v_never_saw():
    params, grads, m = tensors(0, (4,), (3,)), tensors(1, (4,), (3,)), tensors(2, (4,), (3,))
    v = tensors(3, (4,), (3,), positive=True)
    before = [p.clone() for p in params]
    onebit_adam(params, grads, m, denominators(v, 1.0), seen=[True, False], masks=[None, None],
                exchange=HalvingExchange(), exp_avg_mask=None,
                beta1=0.9, lr=0.1, weight_decay=0.1, bc1=1.0)
    assert torch.equal(params[1], before[1]) and not torch.equal(params[0], before[0])
    assert torch.equal(m[1], torch.zeros(3))  # its exchanged momentum landed as 0


def test_lamb_fresh_step_scales_the_update_by_the_clamped_ratio():
    params, m, smoothed = tensors(0, (6,), (2, 3)), tensors(1, (6,), (2, 3)), tensors(2, (6,), (2, 3))
    d = [x + 1.0 for x in tensors(3, (6,), (2, 3), positive=True)]
    P, M, S, D = f64(params), f64(m), f64(smoothed), f64(d)
    beta, lr, wd, bc1, lo, hi = 0.8, 0.05, 0.01, 0.5, 0.01, 10.0
    coeffs = onebit_lamb_fresh_step_(params, m, d, smoothed,
                                     scratch=lambda like: [torch.empty_like(x) for x in like],
                                     whole_norms=None, trust_ratio_beta=beta, lr=lr,
                                     weight_decay=wd, bc1=bc1, min_coeff=lo, max_coeff=hi)
    for p, mm, s, dd, p_t, c in zip(P, M, S, D, params, coeffs):
        s = beta * s + (1 - beta) * mm
        ratio = np.clip(np.linalg.norm(p) / np.linalg.norm(s / bc1 / dd + wd * p), lo, hi)
        assert c == pytest.approx(ratio, rel=1e-5)
        np.testing.assert_allclose(p_t.numpy(), p - lr * ratio * (mm / bc1 / dd + wd * p),
                                   rtol=1e-5, atol=1e-6)


def test_zero_one_sync_lands_every_rank_on_anchor_plus_the_mean_direction():
    shapes = [(4,), (2, 2)]
    params, anchors, m = tensors(0, *shapes), tensors(1, *shapes), tensors(2, *shapes)
    u, d = tensors(3, *shapes), [x + 1.0 for x in tensors(4, *shapes, positive=True)]
    A, U, D = f64(anchors), f64(u), f64(d)
    bc1, lrs = 0.3, 0.07
    sync_local_steps_(params, anchors, m, u, d, exchange=HalvingExchange(),
                      seen=[True, True], masks=[None, None], exp_avg_mask=None,
                      bc1=bc1, lrs=lrs)
    for a, uu, dd, p_t, m_t, u_t in zip(A, U, D, params, m, u):
        avg = 0.5 * uu * dd / lrs  # the mean direction, "averaged"
        np.testing.assert_allclose(p_t.numpy(), a + lrs * avg / dd, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(m_t.numpy(), -avg * bc1, rtol=1e-5, atol=1e-6)
        assert torch.equal(u_t, torch.zeros_like(u_t))  # the next interval starts from 0


def test_zero_one_sync_after_a_sync_exchanges_this_steps_direction():
    params, grads, m = tensors(0, (5,)), tensors(1, (5,)), tensors(2, (5,))
    d = [x + 1.0 for x in tensors(3, (5,), positive=True)]
    P, G, M, D = f64(params), f64(grads), f64(m), f64(d)
    b1, lr, wd, bc1 = 0.9, 0.02, 0.1, 0.4
    sync_single_(params, grads, m, d, exchange=HalvingExchange(), seen=[True], masks=[None],
                 exp_avg_mask=None, beta1=b1, lr=lr, weight_decay=wd, bc1=bc1)
    direction = -((b1 * M[0] + (1 - b1) * G[0]) / bc1 + wd * P[0] * D[0])
    avg = 0.5 * direction
    np.testing.assert_allclose(params[0].numpy(), P[0] + lr * avg / D[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m[0].numpy(), -avg * bc1, rtol=1e-5, atol=1e-6)
