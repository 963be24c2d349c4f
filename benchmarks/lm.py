"""`python -m benchmarks.lm`: the headline convergence figure -- a small
GPT-style language model on real text, 1-bit optimizers against their
full-precision baselines at equal steps.

Model: token + position embeddings, --layers pre-LN transformer blocks
(causal self-attention, GELU MLP), a final LayerNorm and an output head tied
to the token embedding. Text: benchmarks/data/pydocs.txt.gz (CPython's
docstrings and reference topics, see benchmarks/make_lm_corpus.py), split
into words and punctuation; the --vocab most frequent words are the
vocabulary (the rest map to <unk>), so most embedding rows are absent from
any one batch. The last 10% of the text is held out. `--model gpt2`:
Hugging Face's GPT-2 (--dim, --layers, --heads, --context) over the
corpus's first 400k characters instead, one token each (issue 46's small
GPT-2).

Pairs (equal steps, the same seeds, --nproc local gloo ranks; the baselines
average gradients in full precision):
  OnebitAdam  vs torch.optim.Adam           freeze_step = --freeze * steps
  ZeroOneAdam vs torch.optim.Adam           var_freeze_step = --freeze * steps
  OnebitLamb  vs LAMB (OnebitLamb kept in warmup: the same code, uncompressed)
  OnebitAdam-bf16warmup, ZeroOneAdam-bf16warmup vs Adam, OnebitLamb-bf16warmup
    vs LAMB: the same with communication_data_type="bf16" (the warmup's
    exchanges in bf16)
  DiLoCo-1bit vs DiLoCo-fp32, DiLoCo-2bit vs DiLoCo-fp32 (the ternary wire),
  DiLoCo-sparse vs DiLoCo-fp32 (compression="sparse2bit": --topk values of
    each block of --sparse-block-size, an index and 2 bits each),
  DiLoCo-bf16 vs DiLoCo-fp32, DiLoCo-fp32 vs Adam:
    onebit.DiLoCo over inner AdamW (weight decay 0: Adam's maths, local
    steps), an outer step every --sync-every steps (outer SGD: --outer-lr,
    --outer-momentum, --nesterov; DiLoCo's defaults; --later-outer-lr and
    --later-outer-lr-full from --later-from of the steps on), after an fp32
    gradient-averaging warmup of --diloco-warmup of the steps
  DiLoCo-stream vs DiLoCo-fp32: streaming DiLoCo-1bit, --fragments
    fragments synced at staggered steps, each exchange --overlap-steps
    inner steps behind on the communication thread, each landing keeping
    --keep-local-progress of the rank's steps since the launch, or mixing
    --fragment-update-alpha of the rank's params into the new anchor
  What a PyTorch user picks instead, each vs torch.optim.Adam:
    Adam-fp16, Adam-bf16: DDP with torch's fp16_compress_hook or
      bf16_compress_hook (gradients all-reduced in half precision), Adam;
    PowerSGD-r1, -r2, -r4: DDP with torch's powerSGD_hook at that rank,
      start_powerSGD_iter = --freeze * steps (full precision before, as
      the 1-bit optimizers' warmup), error feedback and warm start on,
      Adam (--powersgd-adamw: AdamW, weight decay 0.01).
  Published anchors (benchmarks/anchors.py, written from the papers):
    SparseLoCo vs DiLoCo-fp32: a round every --sync-every inner steps, the
      pseudo-gradient's top 1.56% per 4096-element chunk, 2-bit, with error
      feedback (decay 0.95), outer plain SGD at --sparseloco-lr (the
      published 1.0; --outer-lr is DiLoCo's and does not apply), no warmup;
    DeMo vs Adam: every step, the 32 largest DCT coefficients per chunk of
      a momentum (decay 0.999) exchanged, a sign step at --demo-lr (default
      --lr; its sign step wants its own lr: sweep it).
  --inner muon: every DiLoCo row's inner optimizer (SparseLoCo's too) is
    torch.optim.Muon at --muon-lr on the hidden weight matrices, AdamW at
    --lr on the rest (benchmarks/inner.py).
Everything else is at its default. Reports held-out loss every --every steps,
the final gap, and the bytes each rank sent per step; --plot writes the curves.

--shards S: sharded training on a (nproc / S nodes) x (S shards) mesh.
Every model is under FSDP2 (each block, then the whole): the onebit rows on
the shard dim, averaging over the replicate group; the Adam baseline as HSDP
(FSDP2 on both dims, its own full-precision replicate all-reduce). Bytes
are then what a rank sends to the other nodes.
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import math
import os
import re
import time
from typing import Dict, List

import torch
import torch.distributed as dist

from onebit.bench import hooks
from onebit.bench.table import int_arg
from onebit import launch
from onebit.wire import DEFAULT_BLOCK_SIZE
from onebit.optim.lamb import TRUST_RATIOS

from .anchors import DeMo, SparseLoCo
from .inner import MUON_LR, inner_optimizer

TRUST_RATIO = TRUST_RATIOS[0]  # OnebitLamb's default

PAIRS = [("OnebitAdam", "Adam"), ("OnebitLamb", "Lamb"), ("ZeroOneAdam", "Adam"),
         ("OnebitAdam-bf16warmup", "Adam"), ("OnebitLamb-bf16warmup", "Lamb"),
         ("ZeroOneAdam-bf16warmup", "Adam"),
         ("DiLoCo-1bit", "DiLoCo-fp32"), ("DiLoCo-2bit", "DiLoCo-fp32"),
         ("DiLoCo-sparse", "DiLoCo-fp32"),
         ("DiLoCo-stream", "DiLoCo-fp32"),
         ("DiLoCo-bf16", "DiLoCo-fp32"), ("DiLoCo-fp32", "Adam"),
         ("Adam-fp16", "Adam"), ("Adam-bf16", "Adam"), ("PowerSGD-r1", "Adam"),
         ("PowerSGD-r2", "Adam"), ("PowerSGD-r4", "Adam"),
         ("SparseLoCo", "DiLoCo-fp32"), ("DeMo", "Adam")]
DEFAULT_PAIRS = [p[0] for p in PAIRS[:3]]  # the optimizers' figure; DiLoCo with --only
# Held-out loss gap goals, %; None: reported, not judged.
GOALS = {"OnebitAdam": 1.0, "OnebitLamb": 1.0, "ZeroOneAdam": 2.0, "DiLoCo-1bit": 1.0,
         "OnebitAdam-bf16warmup": 1.0, "OnebitLamb-bf16warmup": 1.0,
         "ZeroOneAdam-bf16warmup": 2.0,
         "DiLoCo-2bit": 1.0, "DiLoCo-sparse": 1.0,
         "DiLoCo-stream": None, "DiLoCo-bf16": 1.0, "DiLoCo-fp32": None,
         "Adam-fp16": None, "Adam-bf16": None, "PowerSGD-r1": None, "PowerSGD-r2": None,
         "PowerSGD-r4": None, "SparseLoCo": None, "DeMo": None}
# DDP comm hooks (the baselines a user would pick): name -> (hook kind, PowerSGD rank)
HOOKS = {"Adam-fp16": ("fp16", 0), "Adam-bf16": ("bf16", 0), "PowerSGD-r1": ("powersgd", 1),
         "PowerSGD-r2": ("powersgd", 2), "PowerSGD-r4": ("powersgd", 4)}
DILOCO = {"DiLoCo-1bit": "1bit", "DiLoCo-2bit": "2bit", "DiLoCo-sparse": "sparse2bit",
          "DiLoCo-stream": "1bit",
          "DiLoCo-bf16": "bf16",
          "DiLoCo-fp32": "none"}
INNER_LOOP = set(DILOCO) | {"SparseLoCo"}  # the rows with an inner optimizer (--inner)
ANCHORS = ("SparseLoCo", "DeMo")  # benchmarks/anchors.py: unsharded, no DiLoCo warmup
HALF_WARMUP = "-bf16warmup"  # a 1-bit row with communication_data_type="bf16"
CORPUS = os.path.join(os.path.dirname(__file__), "data", "pydocs.txt.gz")


def load_tokens(vocab: int):
    """(train ids, held-out ids, vocabulary size including <unk>)."""
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        words = re.findall(r"[a-z]+|[0-9]+|[^\sa-z0-9]", f.read().lower())
    common = [w for w, _ in collections.Counter(words).most_common(vocab)]
    index = {w: i + 1 for i, w in enumerate(common)}  # 0 is <unk>
    ids = torch.tensor([index.get(w, 0) for w in words], dtype=torch.int64)
    cut = int(0.9 * len(ids))
    return ids[:cut], ids[cut:], len(common) + 1


class Block(torch.nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.attn = torch.nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(),
                                       torch.nn.Linear(4 * dim, dim))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(torch.nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Embedding(context, dim)
        torch.nn.init.normal_(self.tok.weight, std=0.02)
        torch.nn.init.normal_(self.pos.weight, std=0.02)
        self.blocks = torch.nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = torch.nn.LayerNorm(dim)
        mask = torch.triu(torch.ones(context, context, dtype=torch.bool), 1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, ids):
        t = ids.shape[1]
        x = self.tok(ids) + self.pos.weight[:t]
        for b in self.blocks:
            x = b(x, self.mask[:t, :t])
        return self.ln(x) @ self.tok.weight.t()  # tied output head


def load_chars():
    """(train ids, held-out ids, vocabulary size) of the corpus's first
    400k characters, one token each; the last 10% held out."""
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        text = f.read()[:400_000]
    index = {c: i for i, c in enumerate(sorted(set(text)))}
    ids = torch.tensor([index[c] for c in text], dtype=torch.int64)
    cut = int(0.9 * len(ids))
    return ids[:cut], ids[cut:], len(index)


class GPT2Logits(torch.nn.Module):
    """transformers' GPT2LMHeadModel, returning logits as TinyGPT does."""

    def __init__(self, vocab: int, a: dict) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        self.gpt2 = GPT2LMHeadModel(GPT2Config(
            vocab_size=vocab, n_positions=a["context"], n_embd=a["dim"], n_layer=a["layers"],
            n_head=a["heads"], bos_token_id=0, eos_token_id=0))

    def forward(self, ids):
        return self.gpt2(ids).logits


def load_data(a: dict):
    """--model's (train ids, held-out ids, vocabulary size): words for
    TinyGPT, characters for GPT-2."""
    return load_chars() if a.get("model") == "gpt2" else load_tokens(a["vocab"])


def model_name(a: dict) -> str:
    return "GPT-2 (characters)" if a.get("model") == "gpt2" else "TinyGPT"


def make_model(vocab: int, a: dict) -> torch.nn.Module:
    if a.get("model") == "gpt2":
        return GPT2Logits(vocab, a)
    return TinyGPT(vocab, a["dim"], a["layers"], a["heads"], a["context"])


def make_optimizer(name: str, params, a: dict, group=None):
    import onebit

    steps, lr = a["steps"], a["lr"]
    f = max(1, int(a["freeze"] * steps))
    wire = dict(block_size=a["block_size"], scale_dtype=a["scale_dtype"],
                comm_backend_name=a.get("backend"), process_group=group)
    if name.endswith(HALF_WARMUP):
        name, wire["communication_data_type"] = name[:-len(HALF_WARMUP)], "bf16"
    if name.startswith("PowerSGD") and a.get("powersgd_adamw"):
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    if name == "Adam" or name in HOOKS:
        return torch.optim.Adam(params, lr=lr)
    if name == "DeMo":
        return DeMo(params, lr=a.get("demo_lr") or lr, process_group=group)
    if name == "OnebitAdam":
        return onebit.OnebitAdam(params, lr=lr, freeze_step=f, **wire)
    if name == "ZeroOneAdam":
        return onebit.ZeroOneAdam(params, lr=lr, var_freeze_step=f, **wire)
    if name == "OnebitLamb":
        return onebit.OnebitLamb(params, lr=lr * a["lamb_lr_scale"], freeze_step=f,
                                 trust_ratio=a.get("trust_ratio", TRUST_RATIO), **wire)
    if name == "Lamb":  # the same code, kept in warmup
        return onebit.OnebitLamb(params, lr=lr * a["lamb_lr_scale"], freeze_step=10 * steps,
                                 comm_backend_name="compressed", process_group=group)
    raise ValueError(name)


LATER_FROM = 0.2  # --later-from's default: the measured switch at H = 16 (docs/benchmarks.md)


def _outer_lr(name: str, a: dict):
    """DiLoCo's outer lr: --outer-lr, and from --later-from of the steps on
    --later-outer-lr for the 1-bit and 2-bit rows or --later-outer-lr-full for the
    bf16 / fp32 rows (each form at its own settings, in one run); the sparse
    row takes a constant --sparse-outer-lr where given (its values, sent
    rounds late, want a larger step from the start)."""
    if DILOCO[name] == "sparse2bit" and a.get("sparse_outer_lr") is not None:
        return a["sparse_outer_lr"]
    compressed = DILOCO[name] in ("1bit", "2bit", "sparse2bit")
    later = a.get("later_outer_lr" if compressed else "later_outer_lr_full")
    if later is None:
        return a["outer_lr"]
    import onebit

    from_step = int(a.get("later_from", LATER_FROM) * a["steps"])
    return onebit.SteppedOuterLR(a["outer_lr"], later, from_step)


def _wire(compression: str, a: dict) -> dict:
    """DiLoCo's block size (and the sparse wire's topk and error decay) for a row."""
    if compression == "sparse2bit":  # None: the library's defaults
        decay = a.get("error_decay")
        return {"block_size": a.get("sparse_block_size"), "topk": a.get("topk"),
                **({} if decay is None else {"error_decay": decay})}
    return {"block_size": a["block_size"]}


def lr_factor(a: dict):
    """The lr multiplier at each step: "constant", or "cosine" -- linear warmup
    over --warmup of the steps, then a cosine decay to 10% of the peak, the
    schedule most language models are trained with."""
    steps, warm = a["steps"], max(1, int(a["warmup"] * a["steps"]))
    if a["schedule"] == "constant":
        return lambda i: 1.0

    def factor(i: int) -> float:  # i: steps taken so far
        if i < warm:
            return (i + 1) / warm
        done = min(1.0, (i - warm) / max(1, steps - warm))
        return 0.1 + 0.45 * (1 + math.cos(math.pi * done))
    return factor


def sample_batch(ids: torch.Tensor, gen: torch.Generator, batch: int, context: int) -> torch.Tensor:
    starts = torch.randint(len(ids) - context - 1, (batch,), generator=gen)
    return torch.stack([ids[s:s + context + 1] for s in starts.tolist()])


def held_out_loss(model: torch.nn.Module, held: torch.Tensor, vocab: int) -> float:
    """The model's next-token cross-entropy on the held-out sequences `held`."""
    model.eval()
    with torch.no_grad():
        out = model(held[:, :-1])
        loss = torch.nn.functional.cross_entropy(out.reshape(-1, vocab), held[:, 1:].reshape(-1))
    model.train()
    return loss.item()


def _shard(model: torch.nn.Module, name: str, world: int, shards: int):
    """FSDP2 on a (world / shards) x shards mesh (the module doc's
    --shards); returns the replicate group the onebit rows average over."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world // shards, shards), mesh_dim_names=("replicate", "shard"))
    on = mesh if name == "Adam" else mesh["shard"]  # Adam: HSDP, averaging across nodes itself
    for block in model.blocks:
        fully_shard(block, mesh=on)
    fully_shard(model, mesh=on)
    return mesh.get_group("replicate")


def _hooked(model: torch.nn.Module, name: str, a: dict) -> torch.nn.Module:
    """The model under DDP with the comm hook `name` names (HOOKS)."""
    kind, rank = HOOKS[name]
    return hooks.hooked(model, kind, rank, start_iter=_hook_start(a))


def _hook_start(a: dict) -> int:
    """PowerSGD's first compressed step: the freeze step, as the 1-bit warmup."""
    return max(2, int(a["freeze"] * a["steps"]))


def _hook_bytes(model: torch.nn.Module, name: str, a: dict, world: int, steps: int) -> float:
    """What a rank of a hooked DDP run has sent after `steps` steps."""
    kind, rank = HOOKS[name]
    return hooks.sent_bytes(model.parameters(), kind, world, steps, rank, _hook_start(a))


def train(rank: int, world: int, name: str, seed: int, a: dict) -> Dict:
    """One run; returns rank 0's held-out loss curve and whether every step was finite."""
    train_ids, held_ids, vocab = load_data(a)
    torch.manual_seed(seed)
    model = make_model(vocab, a)
    for p in model.parameters():  # torch.optim.Adam does not broadcast: start equal anyway
        dist.broadcast(p.data, 0)
    shards = a.get("shards") or 1
    group = _shard(model, name, world, shards) if shards > 1 else None
    bare = model
    # Where each param started (this rank's shard): which elements ever moved.
    start_values = [(p.to_local() if shards > 1 else p).detach().clone()
                    for p in model.parameters()]
    if name in HOOKS:  # DDP averages through the hook during backward
        model = _hooked(model, name, a)
    if name in INNER_LOOP:
        opt = inner_optimizer(model, a.get("inner", "adamw"), a["lr"], a.get("muon_lr", MUON_LR))
    else:
        opt = make_optimizer(name, model.parameters(), a, group)
    diloco = None
    if name == "SparseLoCo":  # its rounds hang off the inner optimizer's step, as DiLoCo's
        diloco = SparseLoCo(model.parameters(), opt, a["sync_every"],
                            outer_lr=a.get("sparseloco_lr", 1.0),
                            error_decay=a.get("sparseloco_error_decay", 0.95), process_group=group)
    if name in DILOCO:  # the outer loop hangs off the inner optimizer's step
        import onebit

        streaming = name == "DiLoCo-stream"
        diloco = onebit.DiLoCo(model, opt, sync_every=a["sync_every"], outer_lr=_outer_lr(name, a),
                               fragments=a.get("fragments", 4) if streaming else 1,
                               overlap_steps=a.get("overlap_steps", 1) if streaming else 0,
                               keep_local_progress=a.get("keep_local_progress", 0.0)
                               if streaming else 0.0,
                               fragment_update_alpha=a.get("fragment_update_alpha", 0.0)
                               if streaming else 0.0,
                               outer_momentum=a["outer_momentum"], nesterov=a["nesterov"],
                               warmup_steps=int(a.get("diloco_warmup", 0.0) * a["steps"]),
                               compression=DILOCO[name], scale_dtype=a["scale_dtype"],
                               comm_backend_name=a.get("backend"), process_group=group,
                               **_wire(DILOCO[name], a))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(a))
    # The elements this rank holds and the ranks they are averaged over.
    numel = sum(p.to_local().numel() if shards > 1 else p.numel() for p in model.parameters())
    replicas = world // shards
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    held = sample_batch(held_ids, torch.Generator().manual_seed(7), a["eval_batch"], a["context"])
    curve, finite, error_norms, sent_by_then = [], True, [], []
    step_seconds = []  # this rank's wall time of each step, the held-out evaluations left out

    for t in range(1, a["steps"] + 1):
        start = time.perf_counter()
        x = sample_batch(train_ids, gen, a["batch"], a["context"])
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).reshape(-1, vocab),
                                                 x[:, 1:].reshape(-1))
        loss.backward()
        if name == "Adam" and shards == 1:  # the baseline averages in full precision
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= world
        opt.step()
        sched.step()
        step_seconds.append(time.perf_counter() - start)  # host tensors: the work is done
        finite = finite and math.isfinite(loss.item()) and all(
            bool(torch.isfinite(p.to_local() if shards > 1 else p).all())
            for p in model.parameters())
        if hasattr(opt, "comm_stats"):  # the error-feedback residual, step by step
            error_norms.append((t, opt.comm_stats()["worker_error_norm"]))
        if t % a["every"] == 0 or t == a["steps"]:
            curve.append((t, held_out_loss(model, held, vocab)))
            sent_by_then.append(_hook_bytes(bare, name, a, world, t) if name in HOOKS
                                else _bytes_sent(diloco or opt, numel, replicas, t))
    if diloco is not None:
        sent = diloco.comm_stats()["bytes_per_inner_step"] * a["steps"]  # the rounds'
        diloco.close()
    elif name in HOOKS:
        sent = _hook_bytes(bare, name, a, world, a["steps"])
    else:
        sent = _bytes_sent(opt, numel, replicas, a["steps"])
    return {"optimizer": name, "seed": seed, "curve": curve, "final": curve[-1][1], "finite": finite,
            "error_norms": error_norms, "bytes_per_step": sent / a["steps"],
            "bytes_sent": sent_by_then, "step_seconds": step_seconds,
            "moved_pct": _moved_pct(model, diloco, start_values, shards)}


def _moved_pct(model: torch.nn.Module, diloco, start_values: List[torch.Tensor],
               shards: int) -> float:
    """The share of this rank's parameter elements, %, that differ from
    where they started; for an outer loop, of its last synced point (the
    anchors: a sparse outer wire moves only what it sent)."""
    now = [(p.to_local() if shards > 1 else p).detach() for p in model.parameters()]
    if diloco is not None and len(diloco.anchors) == len(now):  # (no param left out)
        now = diloco.anchors
    moved = sum(int((a != b).sum()) for a, b in zip(now, start_values))
    return 100.0 * moved / max(1, sum(t.numel() for t in now))


def _bytes_sent(opt, numel: int, world: int, steps: int) -> float:
    """What this rank has sent after `steps` steps: a onebit optimizer's or
    DiLoCo's count (DiLoCo's warmup included), else an fp32 ring all-reduce
    of every gradient, every step."""
    if hasattr(opt, "comm_stats"):
        stats = opt.comm_stats()
        return stats["total_bytes_sent"] + stats.get("warmup_bytes_sent", 0)
    from onebit.backends.stats import fp32_allreduce_bytes

    return fp32_allreduce_bytes(numel, world) * steps


def _all_runs(rank: int, world: int, names: List[str], seeds: List[int], a: dict):
    return [train(rank, world, n, s, a) for s in seeds for n in names]


def compare(a: dict) -> tuple:
    """(rows: one per pair, averaged over seeds; runs: every run)."""
    pairs = [p for p in PAIRS if p[0] in a.get("only", DEFAULT_PAIRS)]
    names = list(dict.fromkeys(n for pair in pairs for n in pair))
    env = {"ONEBIT_RANKS_PER_NODE": str(a["ranks_per_node"])} if a.get("ranks_per_node") else None
    runs = launch.spawn_local(_all_runs, a["nproc"], names, a["seeds"], a, threads=1, env=env)[0]
    by = collections.defaultdict(list)
    for r in runs:
        by[r["optimizer"]].append(r)
    rows = []
    for onebit_name, base_name in pairs:
        mine = sum(r["final"] for r in by[onebit_name]) / len(by[onebit_name])
        base = sum(r["final"] for r in by[base_name]) / len(by[base_name])
        gaps = [(x["final"] - y["final"]) / y["final"] * 100
                for x, y in zip(by[onebit_name], by[base_name])]
        finite = all(r["finite"] for r in by[onebit_name] + by[base_name])
        gap = (mine - base) / base * 100
        goal = GOALS[onebit_name]
        rows.append({"optimizer": onebit_name, "baseline": base_name, "loss": mine,
                     "baseline_loss": base, "gap_pct": gap, "worst_seed_gap_pct": max(gaps),
                     "bytes_per_step": by[onebit_name][0]["bytes_per_step"],
                     "baseline_bytes_per_step": by[base_name][0]["bytes_per_step"],
                     "finite": finite, "ok": finite and (goal is None or gap <= goal),
                     "moved_pct": sum(r["moved_pct"] for r in by[onebit_name]) /
                     len(by[onebit_name])})
    return rows, runs


def plot(runs: List[Dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = [p for p in PAIRS if any(r["optimizer"] == p[0] for r in runs)]
    fig, axes = plt.subplots(1, len(pairs), figsize=(4.4 * len(pairs), 3.8), sharey=True,
                             squeeze=False)
    axes = axes[0]
    for ax, (onebit_name, base_name) in zip(axes, pairs):
        for name, style in ((base_name, "--"), (onebit_name, "-")):
            for r in (r for r in runs if r["optimizer"] == name):
                steps, losses = zip(*r["curve"])
                ax.plot(steps, losses, style, label=f"{name} seed {r['seed']}", linewidth=1)
        ax.set_title(f"{onebit_name} vs {base_name}")
        ax.set_xlabel("step")
        ax.legend(fontsize=6)
    axes[0].set_ylabel("held-out loss")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run(args: argparse.Namespace) -> bool:
    a = {k: v for k, v in vars(args).items() if k not in ("json", "plot")}
    print(f"# benchmarks.lm: {model_name(a)} d={a['dim']} layers={a['layers']} context={a['context']} "
          + (f"vocab={a['vocab']}+1, " if a.get("model") != "gpt2" else "")
          + f"ranks={a['nproc']} batch={a['batch']}/rank steps={a['steps']} "
          f"freeze={a['freeze']:.0%} lr={a['lr']} (LAMB x{a['lamb_lr_scale']:g}, "
          f"trust_ratio={a.get('trust_ratio', TRUST_RATIO)}) "
          f"schedule={a['schedule']}" + (f" warmup={a['warmup']:.0%}" if a['schedule'] == "cosine" else "")
          + f" seeds={a['seeds']} "
          f"block_size={a['block_size']} scale_dtype={a['scale_dtype']}"
          + (f" backend={a['backend']}" if a.get("backend") else "")
          + (f" ranks/node={a['ranks_per_node']}" if a.get("ranks_per_node") else "")
          + (f" shards={a['shards']} (FSDP2; Adam as HSDP)" if a.get("shards") else ""))
    if any(n in INNER_LOOP for n in a["only"]):  # SparseLoCo runs beside DiLoCo-fp32
        print(f"# DiLoCo: sync_every={a['sync_every']} outer_lr={a['outer_lr']} "
              f"later_outer_lr={a.get('later_outer_lr')} (bf16/fp32: "
              f"{a.get('later_outer_lr_full')}) from {a.get('later_from', LATER_FROM):.0%} "
              f"outer_momentum={a['outer_momentum']} nesterov={a['nesterov']}"
              + (f" sparse: block={a.get('sparse_block_size') or 'default'}"
                 f" topk={a.get('topk') or 'default'}"
                 f" outer_lr={a.get('sparse_outer_lr') or 'as 1-bit'}"
                 f" error_decay={a.get('error_decay') or 'default'}"
                 if "DiLoCo-sparse" in a["only"] else "")
              + (f" stream: fragments={a.get('fragments', 4)} overlap_steps="
                 f"{a.get('overlap_steps', 1)} keep_local_progress="
                 f"{a.get('keep_local_progress', 0.0)} fragment_update_alpha="
                 f"{a.get('fragment_update_alpha', 0.0)}" if "DiLoCo-stream" in a["only"] else ""))
        print(f"# inner optimizer: {a.get('inner', 'adamw')}"
              + (f" (Muon lr={a.get('muon_lr', MUON_LR)} on the hidden matrices, AdamW lr={a['lr']} "
                 f"on the rest)" if a.get("inner") == "muon" else ""))
    if "SparseLoCo" in a["only"]:
        print(f"# SparseLoCo: sync_every={a['sync_every']} outer_lr={a.get('sparseloco_lr', 1.0)} "
              f"(SGD, no momentum) top-k 64/4096 2-bit "
              f"error_decay={a.get('sparseloco_error_decay', 0.95)}")
    if "DeMo" in a["only"]:
        print(f"# DeMo: lr={a.get('demo_lr') or a['lr']} momentum_decay=0.999 top-k 32 per chunk")
    w = max([12] + [len(n) for n in a["only"]])  # the -bf16warmup rows' names are longer
    print(f"#{'optimizer':>{w}} {'baseline':>11} {'held-out':>9} {'base':>8} {'gap%':>6} "
          f"{'worst%':>7} {'goal%':>6} {'B/step':>9} {'base B/step':>11} {'moved%':>6} finite ok")
    rows, runs = compare(a)
    for r in rows:
        goal = GOALS[r["optimizer"]]
        print(f" {r['optimizer']:>{w}} {r['baseline']:>11} {r['loss']:9.4f} {r['baseline_loss']:8.4f} "
              f"{r['gap_pct']:6.2f} {r['worst_seed_gap_pct']:7.2f} "
              f"{'-' if goal is None else f'{goal:.1f}':>6} {r['bytes_per_step']:9.0f} "
              f"{r['baseline_bytes_per_step']:11.0f} "
              f"{r['moved_pct']:6.1f} {'yes' if r['finite'] else 'NO':>6} "
              f"{'yes' if r['ok'] else 'NO'}")
    if args.plot:
        plot(runs, args.plot)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "lm", "config": a, "results": rows, "runs": runs}, f, indent=1)
    return all(r["ok"] for r in rows)


def check_arguments(args: argparse.Namespace) -> None:
    if not 0 < args.freeze < 1:
        raise ValueError(f"--freeze is a fraction of the steps in (0, 1), got {args.freeze:g}")
    if not 0 <= args.warmup < 1:
        raise ValueError(f"--warmup is a fraction of the steps in [0, 1), got {args.warmup:g}")
    if args.ranks_per_node and args.nproc % args.ranks_per_node:
        raise ValueError(f"--nproc ({args.nproc}) must be a multiple of --ranks-per-node "
                         f"({args.ranks_per_node})")
    if args.shards and args.nproc % args.shards:
        raise ValueError(f"--nproc ({args.nproc}) must be a multiple of --shards ({args.shards})")
    if args.shards and getattr(args, "model", None) == "gpt2":
        raise ValueError("--shards shards TinyGPT's blocks; --model gpt2 runs unsharded")
    if args.shards and any(n in HOOKS for n in args.only):
        raise ValueError(f"--shards does not apply to the DDP hook rows {sorted(HOOKS)}")
    if args.shards and (getattr(args, "inner", "adamw") == "muon"
                        or any(n in ANCHORS for n in args.only)):
        raise ValueError(f"--shards does not apply to --inner muon or the anchor rows {ANCHORS}")
    if args.diloco_warmup and "SparseLoCo" in args.only:
        raise ValueError(f"--diloco-warmup ({args.diloco_warmup:g}) does not apply to SparseLoCo, "
                         "whose rounds start at step 0 as published: run it apart with 0")
    if args.dim % args.heads:
        raise ValueError(f"--dim ({args.dim}) must be a multiple of --heads ({args.heads})")
    if args.backend is not None:
        from onebit.backends import backend_name

        try:
            backend_name(args.backend)
        except ValueError as exc:
            raise ValueError(f"--backend: {exc}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int_arg(1), default=600)
    p.add_argument("--freeze", type=float, default=0.2, help="freeze point, fraction of steps")
    p.add_argument("--nproc", type=int_arg(1), default=4)
    p.add_argument("--seeds", type=int_arg(0), nargs="+", default=[0, 1, 2])
    p.add_argument("--lr", type=float, default=2e-3, help="Adam lr")
    p.add_argument("--schedule", choices=["cosine", "constant"], default="cosine",
                   help="lr schedule: warmup then cosine decay to 10%%, or constant")
    p.add_argument("--warmup", type=float, default=0.1, help="warmup, fraction of steps")
    p.add_argument("--lamb-lr-scale", dest="lamb_lr_scale", type=float, default=10.0,
                   help="LAMB's lr is this times --lr (10: LAMB's best on the default model)")
    p.add_argument("--trust-ratio", dest="trust_ratio", choices=TRUST_RATIOS, default=TRUST_RATIO,
                   help="OnebitLamb's compression-stage trust ratio")
    p.add_argument("--model", choices=["tinygpt", "gpt2"], default="tinygpt",
                   help="TinyGPT over words, or Hugging Face's GPT-2 over characters (--dim, "
                        "--layers, --heads, --context; needs transformers)")
    p.add_argument("--vocab", type=int_arg(1), default=4096, help="words in the vocabulary (+ <unk>)")
    p.add_argument("--dim", type=int_arg(1), default=64)
    p.add_argument("--layers", type=int_arg(1), default=2)
    p.add_argument("--heads", type=int_arg(1), default=4)
    p.add_argument("--context", type=int_arg(1), default=32)
    p.add_argument("--batch", type=int_arg(1), default=16, help="sequences per rank per step")
    p.add_argument("--eval-batch", dest="eval_batch", type=int_arg(1), default=256)
    p.add_argument("--every", type=int_arg(1), default=50, help="held-out loss every N steps")
    p.add_argument("--block-size", dest="block_size", type=int_arg(1), default=DEFAULT_BLOCK_SIZE)
    p.add_argument("--scale-dtype", dest="scale_dtype", default="float32",
                   choices=["float32", "bfloat16"])
    p.add_argument("--only", nargs="+", default=DEFAULT_PAIRS,
                   choices=[p[0] for p in PAIRS], help="run only these pairs")
    p.add_argument("--topk", type=int_arg(1), default=None,
                   help="DiLoCo-sparse: values sent per block (default: one per 64 elements)")
    p.add_argument("--sparse-outer-lr", dest="sparse_outer_lr", type=float, default=None,
                   help="DiLoCo-sparse: a constant outer lr (default: as the 1-bit row's)")
    p.add_argument("--error-decay", dest="error_decay", type=float, default=None,
                   help="DiLoCo-sparse: the share of the error kept into each round "
                        "(SparseLoCo's 0.95; default DiLoCo's, 1)")
    p.add_argument("--sparse-block-size", dest="sparse_block_size", type=int_arg(8),
                   default=None, help="DiLoCo-sparse: elements per block (default: the "
                                      "sparse wire's, 4096)")
    p.add_argument("--sync-every", dest="sync_every", type=int_arg(1), default=16,
                   help="DiLoCo: inner steps per outer round (H)")
    p.add_argument("--outer-lr", dest="outer_lr", type=float, default=1.3)
    p.add_argument("--outer-momentum", dest="outer_momentum", type=float, default=0.0)
    p.add_argument("--nesterov", dest="nesterov", action="store_true",
                   help="DiLoCo: Nesterov momentum in the outer SGD (DiLoCo's published 0.7, 0.9)")
    p.add_argument("--later-outer-lr", dest="later_outer_lr", type=float, default=None,
                   help="DiLoCo-1bit/-2bit/-stream: the outer lr from --later-from of the steps on")
    p.add_argument("--later-outer-lr-full", dest="later_outer_lr_full", type=float, default=None,
                   help="DiLoCo-bf16/-fp32: the outer lr from --later-from of the steps on")
    p.add_argument("--later-from", dest="later_from", type=float, default=LATER_FROM,
                   help="DiLoCo: where the later outer lr starts, fraction of the steps")
    p.add_argument("--diloco-warmup", dest="diloco_warmup", type=float, default=0.0,
                   help="DiLoCo: fp32 gradient averaging before the first round, fraction of steps")
    p.add_argument("--fragments", type=int_arg(1), default=4,
                   help="DiLoCo-stream: fragments synced at staggered inner steps")
    p.add_argument("--overlap-steps", dest="overlap_steps", type=int_arg(0), default=1,
                   help="DiLoCo-stream: inner steps each fragment's exchange runs behind")
    p.add_argument("--keep-local-progress", dest="keep_local_progress", type=float, default=0.0,
                   help="DiLoCo-stream: share of a rank's steps since a fragment's launch that "
                        "its landing keeps (DiLoCo's keep_local_progress)")
    p.add_argument("--fragment-update-alpha", dest="fragment_update_alpha", type=float,
                   default=0.0, help="DiLoCo-stream: share of a rank's params mixed into a "
                                     "landing fragment (DiLoCo's fragment_update_alpha)")
    p.add_argument("--inner", choices=["adamw", "muon"], default="adamw",
                   help="the DiLoCo rows' (and SparseLoCo's) inner optimizer: AdamW, or "
                        "torch.optim.Muon on the hidden matrices and AdamW on the rest")
    p.add_argument("--muon-lr", dest="muon_lr", type=float, default=MUON_LR,
                   help="--inner muon: Muon's lr (torch's adjust_lr_fn 'original')")
    p.add_argument("--sparseloco-lr", dest="sparseloco_lr", type=float, default=1.0,
                   help="SparseLoCo's outer SGD lr (the published 1.0; --outer-lr is DiLoCo's)")
    p.add_argument("--sparseloco-error-decay", dest="sparseloco_error_decay", type=float,
                   default=0.95, help="SparseLoCo: the error buffer's decay each round "
                   "(published 0.95; 1.0 keeps all of it, as onebit's wires do)")
    p.add_argument("--demo-lr", dest="demo_lr", type=float, default=None,
                   help="DeMo's sign-step lr (default: --lr; sweep it)")
    p.add_argument("--powersgd-adamw", dest="powersgd_adamw", action="store_true",
                   help="PowerSGD rows: AdamW (weight decay 0.01) instead of Adam")
    p.add_argument("--backend", default=None,
                   help="the 1-bit optimizers' comm backend (default: the accelerator's)")
    p.add_argument("--ranks-per-node", dest="ranks_per_node", type=int_arg(1), default=None,
                   help="simulate nodes of this many local ranks (for --backend hierarchical)")
    p.add_argument("--shards", type=int_arg(1), default=None,
                   help="FSDP2 shards per node: nproc / shards nodes (see the module doc)")
    p.add_argument("--json")
    p.add_argument("--plot", help="write the held-out loss curves to this PNG")


if __name__ == "__main__":
    import sys

    from onebit.bench.command import main

    sys.exit(main(sys.modules[__name__]))
