"""Build an optimizer from a DeepSpeed-style JSON config, so switching to
1-bit Adam is one word:

    {"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 2000}}}

`build_optimizer(params, config)` takes that dict, its inner
`{"type": ..., "params": ...}` part, or a path to a JSON file. Types are
case-insensitive; parameter names are DeepSpeed's.
"""
from __future__ import annotations

import inspect
import json
import os
from typing import Any, Callable, Dict, Union

import torch


def _lamb(params, **kw):
    # Plain LAMB: the same code as OnebitLamb, kept in its warmup forever.
    from .optim import OnebitLamb

    kw.setdefault("freeze_step", 2**62)
    return OnebitLamb(params, **kw)


def _registry() -> Dict[str, Callable[..., torch.optim.Optimizer]]:
    from .optim import OnebitAdam, OnebitLamb, ZeroOneAdam

    return {"onebitadam": OnebitAdam, "onebitlamb": OnebitLamb, "zerooneadam": ZeroOneAdam,
            "adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "lamb": _lamb}


# DeepSpeed's names for each optimizer (error messages list these).
TYPE_NAMES = ["OneBitAdam", "OneBitLamb", "ZeroOneAdam", "Adam", "AdamW", "Lamb"]


def _load(config: Union[str, os.PathLike, Dict[str, Any]]) -> Dict[str, Any]:
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            config = json.load(f)
    if not isinstance(config, dict):
        raise ValueError(f"config must be a dict or a JSON file path, got {type(config).__name__}")
    # Beside "optimizer" a DeepSpeed config has other sections (batch sizes,
    # fp16, ...) that are not ours to check; inside it, every key is ours.
    section = config.get("optimizer", config)
    if not isinstance(section, dict) or "type" not in section:
        raise ValueError('config needs {"optimizer": {"type": ..., "params": {...}}} '
                         'or {"type": ..., "params": {...}}')
    unknown = sorted(set(section) - {"type", "params"})
    if unknown:
        hint = ' (did you mean "params"?)' if any(_close(k, "params") for k in unknown) else ""
        raise ValueError(f"unknown key(s) {unknown} in the optimizer section{hint}; it takes "
                         '"type" and "params" only, so these settings would be ignored')
    if not isinstance(section.get("params", {}), dict):
        raise ValueError(f'"params" must be a JSON object of keyword arguments, got '
                         f'{section["params"]!r}')
    return section


def _close(a: str, b: str) -> bool:
    import difflib

    return difflib.SequenceMatcher(None, a.lower(), b).ratio() >= 0.7


def build_optimizer(params, config) -> torch.optim.Optimizer:
    """The optimizer a DeepSpeed-style config describes (see module doc)."""
    section = _load(config)
    registry = _registry()
    kind = str(section["type"])
    factory = registry.get(kind.lower().replace("_", "").replace("-", ""))
    if factory is None:
        raise ValueError(f"unknown optimizer type {kind!r}; valid types: {TYPE_NAMES}")
    kwargs = dict(section.get("params", {}))
    from .optim import OnebitLamb

    signature = inspect.signature(OnebitLamb if factory is _lamb else factory)
    accepted = {n for n in signature.parameters if n != "params"}
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        raise ValueError(f"{kind}: unknown parameter(s) {unknown}; valid: {sorted(accepted)}")
    if "betas" in kwargs:
        betas = kwargs["betas"]
        if not isinstance(betas, (list, tuple)) or len(betas) != 2:
            raise ValueError(f"{kind}: betas must be a list of two numbers, e.g. [0.9, 0.999], "
                             f"got {betas!r}")
        kwargs["betas"] = tuple(betas)
    try:
        return factory(params, **kwargs)
    except TypeError as exc:  # torch's own optimizers check types with TypeError
        raise ValueError(f"{kind}: {exc}") from exc
