"""Two published communication-compressed methods, written from their papers
as anchors for benchmarks.lm (the chunking, DCT, top-k and 2-bit pieces are
benchmarks/chunked.py):

SparseLoCo (Sarfi et al., 2025): DiLoCo whose pseudo-gradient travels as
  the top 1.56% of each 4096-element chunk, 2-bit quantized, with error
  feedback, and a plain SGD outer step (lr 1, no momentum).
DeMo (Peng, Quesnelle and Kingma, 2024): no gradient averaging; each
  worker keeps a momentum with the lr folded in, sends the 32 largest DCT
  coefficients of each chunk of it and keeps the rest, and steps every
  param by the sign of the workers' averaged coefficients.

Both exchange with torch.distributed.all_gather and count the bytes each
rank would send in the published formats (chunked.py): a ring all-gather
passes a rank's payload to each of the p - 1 others, (p - 1) x payload.
Every rank's payload has the same size (the shapes and k fix it), so the
all-gathered tensors need no padding; they carry int64 indices and fp32
values for simplicity, not the packed bits that are counted.
"""
from __future__ import annotations

import math
from typing import Iterable, List, Sequence

import torch
import torch.distributed as dist

from .chunked import (QUANT_BINS, ChunkDCT, chunk_shape, demo_payload_bytes, dequantize_2bit,
                      from_chunks, mean_of_selections, quantize_2bit, scatter,
                      sparseloco_k, sparseloco_payload_bytes, to_chunks, top_k)


def _world(group) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def _gather(flat: torch.Tensor, group, world: int) -> List[torch.Tensor]:
    """Every rank's `flat` (the same size on every rank), rank order."""
    if world == 1:
        return [flat]
    out = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(out, flat, group=group)
    return out


def _split(flat: torch.Tensor, sizes: Sequence[int]) -> List[torch.Tensor]:
    return list(torch.split(flat, list(sizes)))


class SparseLoCo:
    """SparseLoCo's outer loop on `params`, a round every `sync_every`
    steps of `inner_optimizer` (a post-step hook, as onebit.DiLoCo).

    A round, per tensor: pseudo-gradient d = anchor - param; error e <-
    error_decay * e + d; the top sparseloco_k values of each chunk of e,
    2-bit quantized over the tensor (chunked.quantize_2bit); e loses what
    was sent (the dequantized values); every worker's selections are
    averaged (per position, over the workers that chose it); anchor <-
    anchor - outer_lr * average (SGD, no momentum); param <- anchor.
    The params must start equal on every rank.
    """

    def __init__(self, params: Iterable[torch.Tensor], inner_optimizer: torch.optim.Optimizer,
                 sync_every: int, outer_lr: float = 1.0, error_decay: float = 0.95,
                 process_group=None) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.sync_every, self.outer_lr, self.error_decay = sync_every, outer_lr, error_decay
        self.group, self.world = process_group, _world(process_group)
        self.anchors = [p.detach().clone() for p in self.params]
        self.errors = [torch.zeros_like(p) for p in self.params]
        self.payload_bytes = sparseloco_payload_bytes([p.shape for p in self.params])
        self.inner_steps = self.rounds = 0
        self._hook = inner_optimizer.register_step_post_hook(lambda *_: self._inner_step_done())

    def _inner_step_done(self) -> None:
        self.inner_steps += 1
        if self.inner_steps % self.sync_every == 0:
            self.round()

    def _select(self, i: int):
        """Tensor i's (chunk-local indices, codes, mu, table); e loses what they carry."""
        p, e = self.params[i], self.errors[i]
        e.mul_(self.error_decay).add_(self.anchors[i] - p)
        chunks = to_chunks(e)
        idx, vals = top_k(chunks, sparseloco_k(chunks.shape[1]))
        codes, mu, table = quantize_2bit(vals.reshape(-1))
        sent = dequantize_2bit(codes, mu, table).reshape(vals.shape)
        e.sub_(from_chunks(scatter(idx, sent, chunks.shape[1]), e.shape))
        return idx, codes, mu, table

    @torch.no_grad()
    def round(self) -> None:
        picks = [self._select(i) for i in range(len(self.params))]
        # Two gathers: every tensor's (indices, codes) as int64, its (mu, table) as fp32.
        ints = _gather(torch.cat([t.reshape(-1) for idx, codes, _, _ in picks
                                  for t in (idx, codes)]), self.group, self.world)
        stats = [torch.cat([mu.reshape(1), table]) for _, _, mu, table in picks]
        floats = _gather(torch.cat(stats), self.group, self.world)
        int_sizes = [n for idx, _, _, _ in picks for n in (idx.numel(), idx.numel())]
        per_worker = [(_split(i, int_sizes), _split(f, [1 + QUANT_BINS] * len(picks)))
                      for i, f in zip(ints, floats)]
        for t, (p, anchor) in enumerate(zip(self.params, self.anchors)):
            shape, chunk_len = picks[t][0].shape, math.prod(chunk_shape(p.shape))
            idxs, vals = [], []
            for worker_ints, worker_floats in per_worker:
                idx, codes = worker_ints[2 * t].view(shape), worker_ints[2 * t + 1]
                mu, table = worker_floats[t][0], worker_floats[t][1:]
                idxs.append(idx)
                vals.append(dequantize_2bit(codes, mu, table).view(shape).to(p.dtype))
            average = from_chunks(mean_of_selections(idxs, vals, chunk_len), p.shape)
            anchor.sub_(average, alpha=self.outer_lr)
            p.copy_(anchor)
        self.rounds += 1

    def comm_stats(self) -> dict:
        """This rank's traffic, with the keys benchmarks.lm reads from
        onebit.DiLoCo's: total_bytes_sent, warmup_bytes_sent (none here),
        bytes_per_inner_step."""
        total = self.rounds * (self.world - 1) * self.payload_bytes
        return {"total_bytes_sent": total, "warmup_bytes_sent": 0, "rounds": self.rounds,
                "inner_steps": self.inner_steps,
                "bytes_per_inner_step": total / self.inner_steps if self.inner_steps else 0.0}

    def close(self) -> None:
        self._hook.remove()


class DeMo(torch.optim.Optimizer):
    """DeMo: decoupled momentum with DCT top-k exchange, every step.

    Per param: p *= 1 - lr * weight_decay; delta <- momentum_decay * delta
    + lr * grad; the `topk` largest-magnitude DCT-II coefficients of each
    chunk of delta (chunked.ChunkDCT) are sent and taken out of delta;
    every worker's coefficients are averaged (per coefficient, over the
    workers that chose it), inverse-transformed, and p <- p - lr *
    sign(that). No gradient averaging besides. The params must start
    equal on every rank; they then stay equal (every rank applies the same
    average).
    """

    def __init__(self, params, lr: float, momentum_decay: float = 0.999, topk: int = 32,
                 weight_decay: float = 0.0, process_group=None) -> None:
        super().__init__(params, dict(lr=lr, momentum_decay=momentum_decay, topk=topk,
                                      weight_decay=weight_decay))
        self.group, self.world = process_group, _world(process_group)
        self.steps = 0
        self._dct = {}  # chunk shape -> ChunkDCT
        self.params = [p for g in self.param_groups for p in g["params"]]
        self.payload_bytes = sum(demo_payload_bytes([p.shape], g["topk"], p.element_size() * 8)
                                 for g in self.param_groups for p in g["params"])

    def _transform(self, p: torch.Tensor) -> ChunkDCT:
        key = (tuple(p.shape), p.dtype)
        if key not in self._dct:
            self._dct[key] = ChunkDCT(p.shape, p.dtype)
        return self._dct[key]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        sent = []  # (group, param, indices, values), in param order
        for g in self.param_groups:
            for p in g["params"]:
                # A param without a grad still sends (zeros): every rank gathers the same sizes.
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                delta = self.state[p].setdefault("delta", torch.zeros_like(p))
                p.mul_(1 - g["lr"] * g["weight_decay"])
                delta.mul_(g["momentum_decay"]).add_(grad, alpha=g["lr"])
                dct = self._transform(p)
                coeffs = dct.forward(to_chunks(delta))
                idx, vals = top_k(coeffs, g["topk"])
                kept = dct.inverse(scatter(idx, vals, coeffs.shape[1]))
                delta.sub_(from_chunks(kept, p.shape))
                sent.append((g, p, idx, vals))
        # Every param's coefficients in one gather; every rank has the same sizes.
        sizes = [idx.numel() for _, _, idx, _ in sent]
        all_idx = _gather(torch.cat([idx.reshape(-1) for _, _, idx, _ in sent]),
                          self.group, self.world)
        all_vals = _gather(torch.cat([vals.reshape(-1) for _, _, _, vals in sent]),
                           self.group, self.world)
        by_worker = [(_split(i, sizes), _split(v, sizes)) for i, v in zip(all_idx, all_vals)]
        for t, (g, p, idx, _) in enumerate(sent):
            dct = self._transform(p)
            chunk_len = math.prod(dct.chunk)
            average = mean_of_selections([w[0][t].view(idx.shape) for w in by_worker],
                                         [w[1][t].view(idx.shape) for w in by_worker], chunk_len)
            p.add_(from_chunks(dct.inverse(average), p.shape).sign(), alpha=-g["lr"])
        self.steps += 1
        return loss

    def comm_stats(self) -> dict:
        """This rank's traffic (total_bytes_sent, as the onebit optimizers'
        comm_stats) and worker_error_norm: the norm of what the momenta kept
        back (every delta), as their error-feedback residual."""
        kept = [self.state[p]["delta"] for p in self.params if "delta" in self.state[p]]
        norm = math.sqrt(sum(float(d.double().pow(2).sum()) for d in kept))
        return {"total_bytes_sent": self.steps * (self.world - 1) * self.payload_bytes,
                "worker_error_norm": norm, "steps": self.steps}
