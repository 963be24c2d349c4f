"""DiLoCo's inner optimizer in benchmarks.lm (--inner): AdamW, or Muon on the
hidden weight matrices with AdamW on the rest.

Muon (torch.optim.Muon) orthogonalizes each 2-D update; its own docs say
it is for the hidden layers' matrices, embeddings and 1-D params going to
AdamW. Here Muon takes every 2-D param that is no nn.Embedding's weight
(the token embedding is also TinyGPT's tied output head), at --muon-lr
(0.02, the lr of torch's Muon example and of Muon's author; torch's
default adjust_lr_fn, "original": the step scaled by sqrt(max(1, rows /
cols))), momentum 0.95 Nesterov (its defaults), weight decay 0 (torch's
default is 0.1; 0 as the inner AdamW's). AdamW takes the rest at --lr,
weight decay 0.

onebit.DiLoCo and SparseLoCo hang off one optimizer's step hooks, so the
two are one MuonWithAdamW: a torch.optim.Optimizer whose param_groups are
the two optimizers' own group dicts (a LambdaLR on it scales both lrs by
the same factor, each from its own initial lr) and whose step() steps both.
"""
from __future__ import annotations

import torch

MUON_LR = 0.02


def muon_params(model: torch.nn.Module):
    """(Muon's params, AdamW's params) of `model`, in model.parameters() order."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    muon, rest = [], []
    for p in model.parameters():
        if p.requires_grad:
            (muon if p.ndim == 2 and id(p) not in embeddings else rest).append(p)
    return muon, rest


class MuonWithAdamW(torch.optim.Optimizer):
    """One optimizer over `muon` (torch.optim.Muon) and `rest` (AdamW)."""

    def __init__(self, muon, rest, muon_lr: float, adamw_lr: float) -> None:
        if not muon:
            raise ValueError("MuonWithAdamW: no 2-D hidden weight matrix for Muon")
        self.optimizers = [torch.optim.Muon(muon, lr=muon_lr, weight_decay=0.0)]
        if rest:
            self.optimizers.append(torch.optim.AdamW(rest, lr=adamw_lr, weight_decay=0.0))
        # The children's own group dicts: an lr set here is the one they read.
        super().__init__([g for o in self.optimizers for g in o.param_groups], {})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for o in self.optimizers:
            o.step()
        return loss


def inner_optimizer(model: torch.nn.Module, kind: str, lr: float,
                    muon_lr: float = MUON_LR) -> torch.optim.Optimizer:
    """DiLoCo's inner optimizer of `kind` ("adamw" or "muon") over model's params."""
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    if kind == "muon":
        return MuonWithAdamW(*muon_params(model), muon_lr=muon_lr, adamw_lr=lr)
    raise ValueError(f"inner_optimizer: kind must be 'adamw' or 'muon', got {kind!r}")
