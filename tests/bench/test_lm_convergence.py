"""Short version of `python -m benchmarks.lm`: a tiny GPT on real text
(4k-word vocabulary, tied embeddings) on 2 gloo ranks. Every optimizer stays
finite at every step and ends near its full-precision baseline."""
import pytest

from benchmarks.lm import compare

pytestmark = pytest.mark.slow  # the fast tier (-m "not slow") leaves these out

SHORT = dict(steps=100, freeze=0.2, nproc=2, seeds=[0], lr=2e-3, lamb_lr_scale=3.0, vocab=4096, dim=32, layers=1,
             heads=2, context=16, batch=8, eval_batch=64, every=50, block_size=256,
             scale_dtype="float32", schedule="cosine", warmup=0.1)


@pytest.mark.timeout(600)
def test_language_model_gaps_and_no_nan():
    rows, runs = compare(SHORT)
    report = "\n".join(f"{r['optimizer']}: held-out {r['loss']:.4f} vs {r['baseline_loss']:.4f} "
                       f"({r['gap_pct']:+.2f}%), finite {r['finite']}" for r in rows)
    print(report)
    assert all(r["finite"] for r in runs), report
    first = {r["optimizer"]: r["curve"][0][1] for r in runs}
    for r in rows:
        assert r["loss"] < first[r["optimizer"]], report  # they all learned
        assert r["gap_pct"] <= 5.0, report  # the short run's bar; the benchmark's is 1-2%


@pytest.mark.timeout(600)
def test_diloco_1bit_learns_like_fp32_diloco_for_a_fraction_of_the_bytes():
    rows, runs = compare(dict(SHORT, only=["DiLoCo-1bit"], sync_every=8, outer_lr=1.3,
                              outer_momentum=0.0, nesterov=False))
    (row,) = rows
    report = (f"DiLoCo-1bit {row['loss']:.4f} vs fp32 {row['baseline_loss']:.4f} "
              f"({row['gap_pct']:+.2f}%), bytes/step {row['bytes_per_step']:.0f} vs "
              f"{row['baseline_bytes_per_step']:.0f}")
    print(report)
    assert all(r["finite"] for r in runs), report
    first = {r["optimizer"]: r["curve"][0][1] for r in runs}
    assert row["loss"] < first["DiLoCo-1bit"], report
    assert row["gap_pct"] <= 5.0, report
    # 1/8 byte of sign + 4/256 of scale per element, each way, against 8 bytes of fp32
    assert row["bytes_per_step"] * 20 < row["baseline_bytes_per_step"], report


@pytest.mark.timeout(600)
def test_the_ddp_hook_baselines_learn_and_count_what_their_hooks_send():
    """Issue 47's baselines: DDP with torch's fp16 hook, the bf16 hook, and
    PowerSGD at ranks 1 and 4 (from the freeze step), each with Adam. Bytes
    per step against torch's own rule for which matrices PowerSGD
    compresses (its `_should_compress`, min_compression_rate 2)."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

    from benchmarks.lm import TinyGPT
    from onebit.backends.stats import fp32_allreduce_bytes

    rows, runs = compare(dict(SHORT, only=["Adam-fp16", "Adam-bf16", "PowerSGD-r1",
                                           "PowerSGD-r4"]))
    by = {r["optimizer"]: r for r in rows}
    assert all(r["finite"] for r in runs)
    first = {r["optimizer"]: r["curve"][0][1] for r in runs}
    for r in rows:
        assert r["loss"] < first[r["optimizer"]] and r["gap_pct"] <= 20.0, r
    adam = by["Adam-fp16"]["baseline_bytes_per_step"]
    assert by["Adam-fp16"]["bytes_per_step"] == by["Adam-bf16"]["bytes_per_step"] == adam / 2
    model = TinyGPT(4097, SHORT["dim"], SHORT["layers"], SHORT["heads"], SHORT["context"])
    numel = sum(p.numel() for p in model.parameters())
    start, steps = int(SHORT["freeze"] * SHORT["steps"]), SHORT["steps"]
    for rank in (1, 4):
        sent = 0
        for p in model.parameters():
            matrix = p.detach().view(p.shape[0], -1)
            n, m = matrix.shape
            r = min(n, m, rank)
            sent += (n + m) * r if _should_compress(n, m, r, 2)[0] else n * m
        want = (fp32_allreduce_bytes(numel, 2) * start
                + fp32_allreduce_bytes(sent, 2) * (steps - start)) / steps
        assert by[f"PowerSGD-r{rank}"]["bytes_per_step"] == pytest.approx(want), rank
    assert by["PowerSGD-r1"]["bytes_per_step"] < by["PowerSGD-r4"]["bytes_per_step"] < adam / 2
    assert torch.isfinite(torch.tensor([r["loss"] for r in rows])).all()
