"""benchmarks/chunked.py, anchors.py and inner.py: the chunks, the DCT, the
2-bit quantizer and the byte counts against numpy written apart; a
SparseLoCo round and a DeMo step on 2 gloo ranks against a float64 numpy
simulation of both workers; and short benchmarks.lm runs of the new rows."""
import math

import numpy as np
import pytest
import torch

from benchmarks import chunked
from tests.distributed import run_workers

BLOCKS_2D = [((4097, 64), (17, 64)), ((96, 80), (48, 40)), ((64, 256), (64, 64)),
             ((7, 3), (7, 3)), ((128, 131), (64, 1))]


def np_chunks(x: np.ndarray):
    """(chunks as a list of flat arrays, their (row, col) slices): numpy, by loops."""
    if x.ndim == 2:
        m, n = x.shape
        h = max(d for d in range(1, 65) if m % d == 0)
        w = max(d for d in range(1, 65) if n % d == 0)
        where = [(slice(i, i + h), slice(j, j + w)) for i in range(0, m, h) for j in range(0, n, w)]
        return [x[s] for s in where], where
    flat = x.reshape(-1)
    c = max(d for d in range(1, 65) if len(flat) % d == 0)
    where = [slice(i, i + c) for i in range(0, len(flat), c)]
    return [flat[s] for s in where], where


def _np_dct_basis(n: int) -> np.ndarray:
    """The orthonormal DCT-II matrix of size n, in float64 (row k: frequency k)."""
    i = np.arange(n)
    basis = np.array([np.cos(np.pi * (2 * i + 1) * k / (2 * n)) for k in range(n)])
    basis *= np.sqrt(2 / n)
    basis[0] /= np.sqrt(2)
    return basis


def _np_along_each_axis(block: np.ndarray, inverse: bool) -> np.ndarray:
    """The DCT-II matrix (or, orthonormal, its transpose) applied along every axis."""
    out = block.astype(np.float64)
    for axis in range(block.ndim):
        basis = _np_dct_basis(out.shape[axis])
        out = np.moveaxis(np.tensordot(basis.T if inverse else basis,
                                       np.moveaxis(out, axis, 0), axes=1), 0, axis)
    return out


def np_dct(block: np.ndarray) -> np.ndarray:
    """The orthonormal DCT-II of a 1-D or 2-D block (scipy's if installed)."""
    try:
        from scipy.fft import dctn
        return dctn(block, norm="ortho")
    except ImportError:
        return _np_along_each_axis(block, inverse=False)


def np_idct(coeffs: np.ndarray) -> np.ndarray:
    try:
        from scipy.fft import idctn
        return idctn(coeffs, norm="ortho")
    except ImportError:  # orthonormal: the inverse is the transpose, axis by axis
        return _np_along_each_axis(coeffs, inverse=True)


def np_quantize(v: np.ndarray):
    """SparseLoCo's 2-bit quantizer in float64: (codes, dequantized values)."""
    mu = v.mean()
    c = v - mu
    step = 1.5 * c.std(ddof=1)
    codes = np.clip(np.round(c / step + 2), 0, 3).astype(int)
    table = np.array([c[codes == b].mean() if (codes == b).any() else 0.0 for b in range(4)])
    return codes, table[codes] + mu


# ------------------------------------------------------------- the pieces --
@pytest.mark.parametrize("shape,block", BLOCKS_2D)
def test_2d_chunks_are_the_blocks_of_largest_divisors_at_most_64(shape, block):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    assert chunked.chunk_shape(shape) == block
    chunks = chunked.to_chunks(x)
    blocks, _ = np_chunks(x.numpy())
    assert chunks.shape == (len(blocks), block[0] * block[1])
    for got, want in zip(chunks.numpy(), blocks):
        np.testing.assert_array_equal(got, want.reshape(-1))
    assert torch.equal(chunked.from_chunks(chunks, shape), x)


@pytest.mark.parametrize("length,run", [(64, 64), (256, 64), (130, 26), (97, 1), (4097, 17)])
def test_1d_chunks_are_runs_of_the_largest_divisor_at_most_64(length, run):
    x = torch.arange(length, dtype=torch.float32)
    chunks = chunked.to_chunks(x)
    assert chunks.shape == (length // run, run)
    assert torch.equal(chunks[1 % chunks.shape[0]], x[run * (1 % chunks.shape[0]):][:run])
    assert torch.equal(chunked.from_chunks(chunks, x.shape), x)


@pytest.mark.parametrize("shape", [(96, 80), (64, 64), (7, 3), (200,), (64,), (5,)])
def test_chunk_dct_is_the_orthonormal_dct_ii_of_each_chunk_and_inverts(shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    dct = chunked.ChunkDCT(shape, torch.float64)
    coeffs = dct.forward(chunked.to_chunks(x))
    blocks, _ = np_chunks(x.numpy())
    for got, block in zip(coeffs.numpy(), blocks):
        np.testing.assert_allclose(got, np_dct(block).reshape(-1), atol=1e-12)
    back = chunked.from_chunks(dct.inverse(coeffs), shape)
    np.testing.assert_allclose(back.numpy(), x.numpy(), atol=1e-12)
    for n in (1, 17, 64):  # D D^T = I
        d = chunked.dct_matrix(n, torch.float64)
        np.testing.assert_allclose((d @ d.T).numpy(), np.eye(n), atol=1e-12)


@pytest.mark.parametrize("n,seed", [(64, 0), (4097, 1), (1000, 2), (2, 3)])
def test_2bit_quantizer_matches_numpy(n, seed):
    v = torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 3 + 1
    codes, mu, table = chunked.quantize_2bit(v)
    want_codes, want = np_quantize(v.numpy())
    np.testing.assert_array_equal(codes.numpy(), want_codes)
    np.testing.assert_allclose(chunked.dequantize_2bit(codes, mu, table).numpy(), want, atol=1e-12)
    assert set(codes.tolist()) <= {0, 1, 2, 3}


def test_2bit_quantizer_of_equal_values_is_exact():
    v = torch.full((10,), 2.5)
    codes, mu, table = chunked.quantize_2bit(v)
    assert torch.equal(chunked.dequantize_2bit(codes, mu, table), v)
    codes, mu, table = chunked.quantize_2bit(torch.tensor([-4.0]))
    assert chunked.dequantize_2bit(codes, mu, table).item() == -4.0


def test_mean_of_selections_averages_over_the_workers_that_chose_each_position():
    idx = [torch.tensor([[0, 2]]), torch.tensor([[2, 3]])]
    vals = [torch.tensor([[1.0, 4.0]]), torch.tensor([[8.0, -2.0]])]
    got = chunked.mean_of_selections(idx, vals, 5)
    assert got.tolist() == [[1.0, 0.0, 6.0, -2.0, 0.0]]


def test_payload_bytes_by_hand():
    # SparseLoCo, per tensor: selected x (index bits + 2), rounded up to bytes, + 5 fp32.
    # (64, 64): one 4096 chunk, 64 values of 12 + 2 bits = 112 B.
    # (4097, 64): 241 chunks of 17 x 64 = 1088 (11-bit index), 17 each: 4097 x 13 bits.
    # (64,): one run of 64, 1 value, 6 + 2 bits = 1 B.   (7,): a run of 7, 1 value, 3 + 2 bits.
    assert chunked.sparseloco_payload_bytes([(64, 64)]) == 112 + 20
    assert chunked.sparseloco_payload_bytes([(4097, 64)]) == math.ceil(4097 * 13 / 8) + 20
    assert chunked.sparseloco_payload_bytes([(64,)]) == 1 + 20
    assert chunked.sparseloco_payload_bytes([(7,)]) == 1 + 20
    assert chunked.sparseloco_payload_bytes([(64, 64), (64,)]) == 132 + 21
    # DeMo: 32 per chunk (clamped), index bits + 32 value bits.
    assert chunked.demo_payload_bytes([(64, 64)], 32, 32) == 32 * 44 // 8
    assert chunked.demo_payload_bytes([(4097, 64)], 32, 32) == 241 * 32 * 43 // 8
    assert chunked.demo_payload_bytes([(64,)], 32, 32) == 32 * 38 // 8
    assert chunked.demo_payload_bytes([(10,)], 32, 32) == 10 * 36 // 8  # k clamped to 10
    assert chunked.demo_payload_bytes([(64, 64)], 32, 16) == 32 * 28 // 8


# ------------------------------------------------ two workers, simulated --
SHAPES = [(96, 80), (70,), (130,), (64, 64)]
LR = 0.7


def _worker_params(rank: int, move: int):
    """Rank `rank`'s params after its `move`-th inner phase from `anchors`."""
    g = torch.Generator().manual_seed(100 * move + rank)
    return [torch.randn(s, generator=g) * 0.1 for s in SHAPES]


def _anchors():
    g = torch.Generator().manual_seed(12345)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _sparseloco_rounds(rank, world):
    from benchmarks.anchors import SparseLoCo

    params = [torch.nn.Parameter(a.clone()) for a in _anchors()]
    sl = SparseLoCo(params, torch.optim.SGD(params, lr=0.0), sync_every=1, outer_lr=LR)
    out = []
    for move in range(2):  # two rounds: the second carries the first's errors
        with torch.no_grad():
            for p, d in zip(params, _worker_params(rank, move)):
                p.sub_(d)
        sl.round()
        # numpy across the process boundary (torch tensors would go by shared memory)
        out.append(([p.detach().numpy().copy() for p in params],
                    [e.numpy().copy() for e in sl.errors]))
    return out, sl.comm_stats()


def _np_sparseloco(world):
    """Both workers' two rounds in float64: (params after each round, errors per worker)."""
    anchors = [a.double().numpy() for a in _anchors()]
    errors = [[np.zeros(s) for s in SHAPES] for _ in range(world)]
    history = []
    for move in range(2):
        new = []
        for t, shape in enumerate(SHAPES):
            sums, counts = np.zeros(shape), np.zeros(shape)
            for r in range(world):
                e = errors[r][t]
                e *= 0.95
                e += _worker_params(r, move)[t].double().numpy()  # anchor - param
                blocks, where = np_chunks(e)
                picked = []  # (slice, flat positions within the chunk)
                for block, s in zip(blocks, where):
                    flat = block.reshape(-1)
                    k = max(1, round(flat.size * 64 / 4096))
                    picked.append((s, np.argsort(-np.abs(flat), kind="stable")[:k]))
                values = np.concatenate([np.asarray(e[s]).reshape(-1)[i] for s, i in picked])
                _, sent = np_quantize(values)
                at = 0
                for s, i in picked:  # e[s], sums[s], counts[s]: views into the tensor
                    pos, n = np.unravel_index(i, e[s].shape), len(i)
                    e[s][pos] -= sent[at:at + n]
                    sums[s][pos] += sent[at:at + n]
                    counts[s][pos] += 1
                    at += n
            new.append(anchors[t] - LR * np.where(counts > 0, sums / np.maximum(counts, 1), 0))
        anchors = new
        history.append(([a.copy() for a in anchors], [[e.copy() for e in w] for w in errors]))
    return history


def test_sparseloco_rounds_match_a_float64_simulation_of_both_workers():
    world = 2
    results = run_workers(_sparseloco_rounds, world, timeout=120)
    want = _np_sparseloco(world)
    for round_index, (params, errors) in enumerate(want):
        for rank, (rounds, _) in enumerate(results):
            got_params, got_errors = rounds[round_index]
            for t in range(len(SHAPES)):
                np.testing.assert_allclose(got_params[t], params[t], atol=1e-5)
                np.testing.assert_allclose(got_errors[t], errors[rank][t], atol=1e-5)
        assert all(np.array_equal(a, b) for a, b in zip(results[0][0][round_index][0],
                                                          results[1][0][round_index][0]))
    stats = results[0][1]
    assert stats["total_bytes_sent"] == 2 * (world - 1) * chunked.sparseloco_payload_bytes(SHAPES)


def _grads(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _demo_steps(rank, world):
    from benchmarks.anchors import DeMo

    params = [torch.nn.Parameter(a.clone()) for a in _anchors()]
    opt = DeMo(params, lr=LR * 0.01, momentum_decay=0.9)
    out = []
    for step in range(2):
        for p, g in zip(params, _grads(rank, step)):
            p.grad = g
        opt.step()
        out.append([p.detach().numpy().copy() for p in params])
    return out, [opt.state[p]["delta"].numpy().copy() for p in params], opt.comm_stats()


def _np_demo(world, lr, decay=0.9, k=32):
    params = [a.double().numpy() for a in _anchors()]
    deltas = [[np.zeros(s) for s in SHAPES] for _ in range(world)]
    history = []
    for step in range(2):
        for t, shape in enumerate(SHAPES):
            chunk_shape = np_chunks(np.zeros(shape))[0][0].shape
            n_chunks = len(np_chunks(np.zeros(shape))[1])
            sums = np.zeros((n_chunks, int(np.prod(chunk_shape))))
            counts = np.zeros_like(sums)
            for r in range(world):
                d = deltas[r][t]
                d *= decay
                d += lr * _grads(r, step)[t].double().numpy()
                _, where = np_chunks(d)
                for c, s in enumerate(where):
                    coeffs = np_dct(np.asarray(d[s])).reshape(-1)
                    top = np.argsort(-np.abs(coeffs), kind="stable")[:min(k, coeffs.size)]
                    kept = np.zeros_like(coeffs)
                    kept[top] = coeffs[top]
                    d[s] = d[s] - np_idct(kept.reshape(chunk_shape))
                    sums[c, top] += coeffs[top]
                    counts[c, top] += 1
            average = np.where(counts > 0, sums / np.maximum(counts, 1), 0)
            _, where = np_chunks(params[t])
            update = np.zeros(shape)
            for c, s in enumerate(where):
                update[s] = np_idct(average[c].reshape(chunk_shape))
            params[t] = params[t] - lr * np.sign(update)
        history.append([p.copy() for p in params])
    return history, deltas


def test_demo_steps_match_a_float64_simulation_of_both_workers():
    world, lr = 2, LR * 0.01
    results = run_workers(_demo_steps, world, timeout=120)
    history, deltas = _np_demo(world, lr)
    for step, params in enumerate(history):
        for t in range(len(SHAPES)):
            for rank in range(world):
                np.testing.assert_allclose(results[rank][0][step][t], params[t], atol=1e-5)
            assert np.array_equal(results[0][0][step][t], results[1][0][step][t])
    for rank in range(world):
        for t in range(len(SHAPES)):
            np.testing.assert_allclose(results[rank][1][t], deltas[rank][t], atol=1e-5)
    stats = results[0][2]
    assert stats["total_bytes_sent"] == 2 * (world - 1) * chunked.demo_payload_bytes(SHAPES, 32, 32)


# ----------------------------------------------------------- inner Muon --
def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    from benchmarks.inner import MuonWithAdamW, inner_optimizer
    from benchmarks.lm import TinyGPT

    model = TinyGPT(50, 16, 2, 2, 8)
    opt = inner_optimizer(model, "muon", lr=1e-3, muon_lr=0.05)
    assert isinstance(opt, MuonWithAdamW)
    muon, adamw = opt.optimizers
    muon_ids = {id(p) for g in muon.param_groups for p in g["params"]}
    for name, p in model.named_parameters():
        hidden = p.ndim == 2 and not name.startswith(("tok.", "pos."))
        assert (id(p) in muon_ids) == hidden, name
    assert len(muon_ids) == 2 * 4  # per block: attention in/out, MLP in/out
    # One LambdaLR on the composite scales both optimizers' lrs from their own.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.5 ** i)
    fired = []
    opt.register_step_post_hook(lambda *_: fired.append(1))
    x = torch.randint(50, (2, 9))
    model(x[:, :-1]).square().mean().backward()
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    sched.step()
    assert fired == [1]
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert muon.param_groups[0]["lr"] == 0.025 and adamw.param_groups[0]["lr"] == 5e-4


# -------------------------------------------------- benchmarks.lm rows --
SMOKE = dict(steps=16, freeze=0.2, nproc=2, seeds=[0], lr=2e-3, lamb_lr_scale=3.0, vocab=512,
             dim=16, layers=1, heads=2, context=16, batch=4, eval_batch=16, every=8,
             block_size=256, scale_dtype="float32", schedule="cosine", warmup=0.1,
             sync_every=8, outer_lr=1.3, outer_momentum=0.0, nesterov=False)


def _tiny_shapes():
    from benchmarks.lm import TinyGPT

    model = TinyGPT(513, SMOKE["dim"], SMOKE["layers"], SMOKE["heads"], SMOKE["context"])
    return [p.shape for p in model.parameters()]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_lm_anchor_rows_run_finite_and_count_the_published_bytes():
    from benchmarks.lm import compare

    rows, runs = compare(dict(SMOKE, only=["SparseLoCo", "DeMo"]))
    by = {r["optimizer"]: r for r in rows}
    assert set(by) == {"SparseLoCo", "DeMo"} and all(r["finite"] for r in runs), rows
    assert by["SparseLoCo"]["baseline"] == "DiLoCo-fp32" and by["DeMo"]["baseline"] == "Adam"
    for r in runs:
        assert all(math.isfinite(loss) for _, loss in r["curve"]), r["optimizer"]
    shapes = _tiny_shapes()
    rounds = SMOKE["steps"] // SMOKE["sync_every"]
    assert by["SparseLoCo"]["bytes_per_step"] == pytest.approx(
        rounds * chunked.sparseloco_payload_bytes(shapes) / SMOKE["steps"])
    assert by["DeMo"]["bytes_per_step"] == chunked.demo_payload_bytes(shapes, 32, 32)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_lm_diloco_with_inner_muon_runs_finite():
    from benchmarks.lm import compare

    rows, runs = compare(dict(SMOKE, only=["DiLoCo-1bit"], inner="muon", muon_lr=0.02))
    assert all(r["finite"] for r in runs), rows
    assert {r["optimizer"] for r in runs} == {"DiLoCo-1bit", "DiLoCo-fp32"}
