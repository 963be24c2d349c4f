"""The 2-bit wire (backends/codecs.py's TernaryCodec): its bytes against a
numpy decoder written here from docs/design.md, its decisions against the
float64 reference (tests/reference.py's `ternary`), and the compressed
allreduce carrying it on 3 real ranks: every round's output is what the
reference gives, and error feedback loses nothing (output = the mean of
the inputs plus the errors' change, element by element)."""
import numpy as np
import pytest
import torch

from onebit.backends.codecs import TernaryCodec
from tests import reference
from tests.backends.codec_rounds import ROUNDS, check_round, logged_rounds
from tests.distributed import run_workers

BLOCK = 64


def _numpy_fields(codes: np.ndarray, n: int) -> np.ndarray:
    """-1, 0, +1 per element from the wire bytes: element 4 i + j in bits
    2 j, 2 j + 1 of byte i; 01 is +1, 10 is -1, 00 is 0."""
    fields = (codes[:, None] >> np.array([0, 2, 4, 6])) & 3
    fields = fields.reshape(-1)[:n]
    assert not (fields == 3).any(), "11 is not a code"
    return np.where(fields == 1, 1.0, np.where(fields == 2, -1.0, 0.0))


def _bf16(values):
    return torch.tensor(values, dtype=torch.float32).to(torch.bfloat16).double().numpy()


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_ternary_message_is_the_reference_code(scale_dtype):
    """One message: err <- buf + err, the codes, the scales and the new error,
    against the float64 reference. Blocks of very different magnitudes, an
    all-zero block, one with a single value, a last block with 5 real
    elements (its count), and buf shorter than the message."""
    g = torch.Generator().manual_seed(7)
    n = BLOCK * 9
    buf = torch.randn(n - 40, generator=g) * torch.logspace(-4, 3, n - 40)
    err0 = torch.randn(n, generator=g) * 0.01
    buf[BLOCK:2 * BLOCK] = 0.0
    err0[BLOCK:2 * BLOCK] = 0.0
    buf[2 * BLOCK:3 * BLOCK] = 0.0
    err0[2 * BLOCK:3 * BLOCK] = 0.0
    buf[2 * BLOCK + 3] = -2.5
    err0[n - BLOCK + 5:] = 0.0  # the pads of the last block are zero, as the backend keeps them
    buf[n - BLOCK + 5:] = 0.0
    real = np.ones(n, dtype=bool)
    real[n - BLOCK + 5:] = False
    counts = torch.tensor(real.reshape(-1, BLOCK).sum(1), dtype=torch.float64)
    err = err0.clone()
    scales = torch.empty(n // BLOCK * scale_dtype.itemsize, dtype=torch.uint8)
    codes = torch.empty(n // 4, dtype=torch.uint8)
    TernaryCodec.compress(buf, err, counts, BLOCK, scale_dtype, scales, codes)

    # x as the codec adds it (in fp32); the reference decides from there in float64.
    x32 = (err0.clone().index_add_(0, torch.arange(buf.numel()), buf)).double().numpy()
    round_scale = (lambda s: s.astype(np.float32).astype(np.float64)) if scale_dtype == torch.float32 \
        else (lambda s: _bf16(s.astype(np.float32)))
    want_q, want_err, want_s = reference.ternary(x32, real, BLOCK, round_scale)
    got_s = scales.view(scale_dtype).double().numpy()
    np.testing.assert_array_equal(got_s, want_s)
    got_code = _numpy_fields(codes.numpy(), n)
    want_code = np.sign(want_q)
    assert (got_code == want_code).all()
    assert got_code[BLOCK:2 * BLOCK].sum() == 0 and got_s[1] == 0.0  # zeros stay zeros
    assert (got_code[2 * BLOCK:3 * BLOCK] != 0).sum() == 1 and got_s[2] == 2.5  # one value
    assert (got_code == 0).mean() > 0.2 and (got_code != 0).mean() > 0.2  # a real ternary code
    # x - s rounded once to fp32 is what fp32 arithmetic gives.
    np.testing.assert_array_equal(err.numpy()[real], want_err.astype(np.float32)[real])


def test_ternary_decode_mean_sums_rows_in_order():
    g = torch.Generator().manual_seed(3)
    rows, cols = 3, BLOCK * 4 + 13
    nblocks = -(-cols // BLOCK)
    fields = torch.randint(0, 3, (rows, nblocks * BLOCK), generator=g, dtype=torch.uint8)
    codes = torch.stack([_pack(f) for f in fields])
    row_bytes = torch.cat([codes, torch.full((rows, 7), 255, dtype=torch.uint8)], 1)  # + trailing
    scales = torch.rand(rows, nblocks, generator=g) + 0.5
    out = torch.empty(cols)
    TernaryCodec.decode_mean(row_bytes, scales, cols, out, BLOCK)
    values = [(_numpy_fields(codes[r].numpy(), cols) *
               np.repeat(scales[r].numpy(), BLOCK)[:cols]).astype(np.float32) for r in range(rows)]
    total = np.zeros(cols, dtype=np.float32)
    for v in values:  # in row order, in fp32, then times 1 / rows: the sign decode's order
        total = total + v
    np.testing.assert_array_equal(out.numpy(), total * np.float32(1.0 / rows))
    reordered = (values[2] + values[1] + values[0]) * np.float32(1.0 / rows)
    assert (reordered != total * np.float32(1.0 / rows)).any()  # (the order shows in the bits)


def _pack(fields: torch.Tensor) -> torch.Tensor:
    f = fields.view(-1, 4).int()
    return (f[:, 0] + 4 * f[:, 1] + 16 * f[:, 2] + 64 * f[:, 3]).to(torch.uint8)


@pytest.mark.slow
def test_ternary_allreduce_on_three_ranks_is_the_reference_and_loses_nothing():
    results = run_workers(logged_rounds, 3, TernaryCodec, BLOCK, timeout=180)
    for r in range(ROUNDS):
        got, want = check_round(results, r, BLOCK, reference.ternary)
        for i, (a, b) in enumerate(zip(got, want)):
            scale = np.abs(b).max() + 1e-30
            close = np.abs(a - b) <= 1e-5 * scale
            assert close.mean() > 0.995, (r, i, close.mean())  # decisions at the threshold may flip


def _refused_backend(rank, world):
    import onebit

    params = [torch.nn.Parameter(torch.zeros(10))]
    inner = torch.optim.SGD(params, lr=0.1)
    try:
        onebit.DiLoCo(params, inner, sync_every=2, compression="2bit",
                      comm_backend_name="hierarchical")
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.slow
def test_diloco_2bit_refuses_a_backend_without_the_code():
    """Only the flat torch.distributed backend takes the 2-bit code: asking
    for another is a clear error at construction, on every rank."""
    for message in run_workers(_refused_backend, 2, timeout=120):
        assert message is not None and "'compressed' backend only" in message
