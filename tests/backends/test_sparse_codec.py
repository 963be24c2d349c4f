"""The sparse 2-bit wire (backends/sparse_codec.py): its bytes against a
numpy decoder written here from the module's format, its decisions against
the float64 reference (tests/reference.py's `sparse`), and the compressed
allreduce carrying it on 2, 3 and 4 real ranks: every round's output is
what the reference gives, the same bits on every rank, and error feedback
loses nothing."""
import numpy as np
import pytest
import torch

from onebit.backends.sparse_codec import SparseCodec
from tests import reference
from tests.backends.codec_rounds import ROUNDS, check_round, logged_rounds
from tests.distributed import run_workers

BLOCK, KEEP = 64, 4


def _numpy_decode(codes: np.ndarray, scales: np.ndarray, block: int, keep: int) -> np.ndarray:
    """Decoded values from the wire bytes, read as the format says: per
    block a little-endian bit stream of `keep` indices (ceil(log2 block)
    bits each), then `keep` 2-bit fields (bit 0 sign, bit 1 magnitude 2 s);
    a slot repeating the index before it is unused."""
    width = int(np.ceil(np.log2(block)))
    per_block = -(-keep * (width + 2) // 8)
    out = np.zeros((len(scales), block))
    for b, s in enumerate(scales):
        raw = codes[b * per_block:(b + 1) * per_block]
        bits = np.unpackbits(raw, bitorder="little")
        index = [int(sum(int(bits[j * width + t]) << t for t in range(width)))
                 for j in range(keep)]
        field = [int(bits[keep * width + 2 * j]) | int(bits[keep * width + 2 * j + 1]) << 1
                 for j in range(keep)]
        for j in range(keep):
            if j and index[j] == index[j - 1]:
                assert field[j] == 0, "an unused slot carries no value"
                continue
            if j:
                assert index[j] > index[j - 1], "used slots ascend"
            magnitude = 2.0 * s if field[j] & 2 else s
            out[b, index[j]] = -magnitude if field[j] & 1 else magnitude
    return out.reshape(-1)


def _bf16(values):
    return torch.tensor(values, dtype=torch.float32).to(torch.bfloat16).double().numpy()


def test_bytes_per_block_follow_the_format():
    assert SparseCodec(256, 4).code_bytes(256) == 5  # 4 index bytes + 1 byte of values
    assert SparseCodec(4096, 64).code_bytes(4096 * 3) == 3 * 64 * 14 // 8  # SparseLoCo's
    assert SparseCodec(64, 3).code_bytes(128) == 2 * 3  # 3 * (6 + 2) bits: 3 bytes a block
    assert SparseCodec(8, 1).code_bytes(8) == 1  # 3 + 2 bits
    with pytest.raises(ValueError, match="topk"):
        SparseCodec(64, 65)
    with pytest.raises(ValueError, match="topk"):
        SparseCodec(64, 0)


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_sparse_message_is_the_reference_code(scale_dtype):
    """One message: err <- buf + err, then the codes, scales and new error
    against the float64 reference. Blocks of very different magnitudes, an
    all-zero block, one with two values (fewer than k: unused slots), one
    of equal magnitudes (ties to the lower index), a last block with 5
    real elements, and buf shorter than the message."""
    g = torch.Generator().manual_seed(7)
    n = BLOCK * 9
    buf = torch.randn(n - 40, generator=g) * torch.logspace(-4, 3, n - 40)
    err0 = torch.randn(n, generator=g) * 0.01
    for b in (1, 2, 3):
        buf[b * BLOCK:(b + 1) * BLOCK] = 0.0
        err0[b * BLOCK:(b + 1) * BLOCK] = 0.0
    buf[2 * BLOCK + 3], buf[2 * BLOCK + 40] = -2.5, 7.0
    buf[3 * BLOCK:4 * BLOCK] = torch.tensor([1.0, -1.0] * (BLOCK // 2))
    err0[n - BLOCK + 5:] = 0.0  # the pads of the last block are zero, as the backend keeps them
    buf[n - BLOCK + 5:] = 0.0
    real = np.ones(n, dtype=bool)
    real[n - BLOCK + 5:] = False
    counts = torch.tensor(real.reshape(-1, BLOCK).sum(1), dtype=torch.float64)
    codec = SparseCodec(BLOCK, KEEP)
    err = err0.clone()
    scales = torch.empty(n // BLOCK * scale_dtype.itemsize, dtype=torch.uint8)
    codes = torch.empty(codec.code_bytes(n), dtype=torch.uint8)
    codec.compress(buf, err, counts, BLOCK, scale_dtype, scales, codes)

    x32 = (err0.clone().index_add_(0, torch.arange(buf.numel()), buf)).double().numpy()
    round_scale = (lambda s: s.astype(np.float32).astype(np.float64)) if scale_dtype == torch.float32 \
        else (lambda s: _bf16(s.astype(np.float32)))
    want_q, want_err, want_s = reference.sparse(x32, real, BLOCK, round_scale, KEEP)
    got_s = scales.view(scale_dtype).double().numpy()
    np.testing.assert_array_equal(got_s, want_s)
    got_q = _numpy_decode(codes.numpy(), got_s, BLOCK, KEEP)
    np.testing.assert_array_equal(got_q, want_q)
    assert not got_q[BLOCK:2 * BLOCK].any() and got_s[1] == 0.0  # zeros stay zeros
    assert np.flatnonzero(got_q[2 * BLOCK:3 * BLOCK]).tolist() == [3, 40]  # two used slots
    assert np.flatnonzero(got_q[3 * BLOCK:4 * BLOCK]).tolist() == [0, 1, 2, 3]  # ties: lowest
    assert ((got_q.reshape(-1, BLOCK) != 0).sum(1) <= KEEP).all()
    assert (np.abs(got_q) == 2 * np.repeat(got_s, BLOCK)).any()  # both magnitudes occur
    # x - q rounded once to fp32 is what fp32 arithmetic gives; the rest of x is kept whole.
    np.testing.assert_array_equal(err.numpy()[real], want_err.astype(np.float32)[real])


def test_decode_mean_sums_rows_in_order():
    """Rows compressed from different data, decoded and averaged: the sum
    over rows in order, in fp32, then times 1 / rows (the other codes'
    order), over a width that ends inside a block."""
    codec = SparseCodec(BLOCK, KEEP)
    g = torch.Generator().manual_seed(3)
    rows, cols = 3, BLOCK * 4 + 13
    nblocks = -(-cols // BLOCK)
    messages, scale_rows = [], []
    for _ in range(rows):
        x = torch.randn(nblocks * BLOCK, generator=g) * (1 + torch.rand(1, generator=g))
        x[cols:] = 0.0
        scales = torch.empty(nblocks * 4, dtype=torch.uint8)
        codes = torch.empty(codec.code_bytes(nblocks * BLOCK), dtype=torch.uint8)
        codec.compress(torch.zeros(0), x, None, BLOCK, torch.float32, scales, codes)
        messages.append(torch.cat([codes, scales, torch.full((7,), 255, dtype=torch.uint8)]))
        scale_rows.append(scales.view(torch.float32))
    out = torch.empty(cols)
    codec.decode_mean(torch.stack(messages), torch.stack(scale_rows), cols, out, BLOCK)
    values = [_numpy_decode(m.numpy(), s.double().numpy(), BLOCK, KEEP)[:cols].astype(np.float32)
              for m, s in zip(messages, scale_rows)]
    total = np.zeros(cols, dtype=np.float32)
    for v in values:
        total = total + v
    np.testing.assert_array_equal(out.numpy(), total * np.float32(1.0 / rows))
    assert (out.numpy() != 0).sum() > rows * KEEP  # the rows picked different positions


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow),
                                   pytest.param(4, marks=pytest.mark.slow)])
def test_sparse_allreduce_is_the_reference_on_every_rank_and_loses_nothing(world):
    results = run_workers(logged_rounds, world, SparseCodec(BLOCK, KEEP), BLOCK, timeout=180)
    numel, n = results[0]["numel"], results[0]["padded"]
    for r in range(ROUNDS):
        got, want = check_round(results, r, BLOCK,
                                lambda x, rl, b, rs: reference.sparse(x, rl, b, rs, KEEP))
        for i, (a, b) in enumerate(zip(got, want)):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * (np.abs(b).max() + 1e-30),
                                       err_msg=f"round {r}, tensor {i}")
        # the servers' top-k: at most k values per block reach the output
        out = np.pad(results[0]["log"][r]["out"], (0, n - numel))
        assert (out.reshape(-1, BLOCK) != 0).sum(1).max() <= KEEP
    # What the bytes say: 2 (p - 1) message rows a round, each the chunk's
    # blocks at 4 bytes of codes (4 slots of 6 + 2 bits) and a 4-byte scale.
    row = n // world // BLOCK * (4 + 4)
    assert results[0]["sent"] == ROUNDS * 2 * (world - 1) * row
