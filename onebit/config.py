"""Build an optimizer from a DeepSpeed-style JSON config, so switching to
1-bit Adam is one word:

    {"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 2000}}}

`build_optimizer(params, config)` takes that dict, its inner
`{"type": ..., "params": ...}` part, or a path to a JSON file. Types are
case-insensitive; parameter names are DeepSpeed's, and so is what a type
means: "Adam" is torch's AdamW (decoupled weight decay) unless
`adam_w_mode` is false, as in DeepSpeed.

The rest of a DeepSpeed config is read too (`read_config`), so nothing is
dropped silently: `gradient_clipping` becomes the optimizer's
`max_grad_norm`; `communication_data_type` the dtype of the 1-bit
optimizers' full-precision exchanges (their warmup); `zero_optimization`
with a stage above 0 is an error (the 1-bit optimizers keep whole states
on every rank, as DeepSpeed's did);
`scheduler` becomes a torch lr scheduler with DeepSpeed's formulas
(`build_scheduler`, onebit/lr_schedules.py); `fp16`/`bf16` are reported with
how to get them in plain torch; the batch sizes and the rest are the
training script's own business. `python -m onebit CONFIG.json` prints all
of it.
"""
from __future__ import annotations

import inspect
import json
import os
from typing import Any, Callable, Dict, List, NamedTuple, Tuple, Union

import torch

from .half_precision import communication_dtype_from
from .lr_schedules import SCHEDULES, DeepSpeedLR, schedule_from

def _lamb(params, **kw):
    # Plain LAMB: the same code as OnebitLamb, kept in its warmup forever.
    from .optim import OnebitLamb

    kw.setdefault("freeze_step", 2**62)
    return OnebitLamb(params, **kw)


def _adam(params, adam_w_mode: bool = True, torch_adam: bool = False, **kw):
    # DeepSpeed's "Adam" is AdamW (decoupled weight decay) unless adam_w_mode
    # is false; torch_adam picks torch's implementation, which this always is.
    if not isinstance(adam_w_mode, bool) or not isinstance(torch_adam, bool):
        raise ValueError(f"Adam: adam_w_mode and torch_adam must be true or false, got "
                         f"{adam_w_mode!r} and {torch_adam!r}")
    return (torch.optim.AdamW if adam_w_mode else torch.optim.Adam)(params, **kw)


def _adamw(params, adam_w_mode: bool = True, torch_adam: bool = False, **kw):
    # DeepSpeed's "AdamW" is decoupled whatever adam_w_mode says.
    return _adam(params, True, torch_adam, **kw)


def _registry() -> Dict[str, Callable[..., torch.optim.Optimizer]]:
    from .optim import OnebitAdam, OnebitLamb, ZeroOneAdam

    return {"onebitadam": OnebitAdam, "onebitlamb": OnebitLamb, "zerooneadam": ZeroOneAdam,
            "adam": _adam, "adamw": _adamw, "lamb": _lamb}


# DeepSpeed's names for each optimizer (error messages list these).
TYPE_NAMES = ["OneBitAdam", "OneBitLamb", "ZeroOneAdam", "Adam", "AdamW", "Lamb"]


class ConfigReading(NamedTuple):
    """What a DeepSpeed config means here: the optimizer section, the keyword
    arguments other sections add to it, and one (key, verdict, note) per
    top-level key. Verdicts: "used", "mapped", "advice", "ignored"."""

    section: Dict[str, Any]
    extra_kwargs: Dict[str, Any]
    notes: List[Tuple[str, str, str]]


# Take max_grad_norm and communication_data_type.
_ONEBIT_TYPES = ("onebitadam", "onebitlamb", "zerooneadam", "lamb")
_SCRIPT_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu",
                "gradient_accumulation_steps", "steps_per_print", "wall_clock_breakdown")


def _enabled(value) -> bool:
    return isinstance(value, dict) and bool(value.get("enabled", False))


def read_config(config: Union[str, os.PathLike, Dict[str, Any]]) -> ConfigReading:
    """Read a whole DeepSpeed-style config (see the module doc); ValueError
    for what cannot work (a ZeRO stage above 0, a bad optimizer section)."""
    config = _open(config)
    section = _load(config)
    if "optimizer" not in config:  # the inner {"type", "params"} part alone
        return ConfigReading(section, {}, [("optimizer", "used", str(section["type"]))])
    kind = str(section["type"]).lower().replace("_", "").replace("-", "")
    extra, notes = {}, []
    for key, value in config.items():
        if key == "optimizer":
            notes.append((key, "used", str(section["type"])))
        elif key == "gradient_clipping":
            params = section.get("params") or {}
            if value and params.get("overlap_backward"):
                raise ValueError(f"gradient_clipping={value} with overlap_backward=True: clipping "
                                 "needs every gradient's norm before the exchange starts, which "
                                 "the overlap cannot wait for. Drop one of them (or clip in your "
                                 "script before step())")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"gradient_clipping must be a number (the largest gradient "
                                 f"norm; 0: no clipping), got {value!r}")
            if kind in _ONEBIT_TYPES and "max_grad_norm" not in params:
                extra["max_grad_norm"] = float(value)
                notes.append((key, "mapped", f"max_grad_norm={float(value):g}"))
            elif kind in _ONEBIT_TYPES:
                notes.append((key, "ignored", "the optimizer's own max_grad_norm wins"))
            else:
                notes.append((key, "advice", "call torch.nn.utils.clip_grad_norm_(params, "
                                            f"{value}) before step(): {section['type']} does not clip"))
        elif key == "communication_data_type":
            params = section.get("params") or {}
            communication_dtype_from(value)  # a bad name fails here, naming the key
            if kind in _ONEBIT_TYPES and "communication_data_type" not in params:
                extra["communication_data_type"] = value
                notes.append((key, "mapped", f"communication_data_type={value!r} (the "
                                             "full-precision exchanges)"))
            elif kind in _ONEBIT_TYPES:
                notes.append((key, "ignored", "the optimizer's own communication_data_type wins"))
            else:
                notes.append((key, "advice", "register torch's fp16_compress_hook or "
                                            "bf16_compress_hook on your DDP model"))
        elif key == "zero_optimization":
            stage = value.get("stage", 0) if isinstance(value, dict) else value
            if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage <= 3:
                raise ValueError(f"zero_optimization.stage must be an integer from 0 to 3, got "
                                 f"{stage!r}")
            if stage:
                raise ValueError(
                    f"zero_optimization.stage={stage}: onebit's optimizers keep whole parameters "
                    "and optimizer states on every rank of a data-parallel group (as ZeRO stage "
                    "0; DeepSpeed's 1-bit optimizers refused ZeRO too). Set the stage to 0; to "
                    "shard, use FSDP2 inside a node and pass the mesh's replicate group as the "
                    "optimizer's process_group (docs/sharding.md)")
            notes.append((key, "ignored", "stage 0: plain data parallelism, what onebit does"))
        elif key in ("fp16", "bf16") and _enabled(value):
            dtype = "float16" if key == "fp16" else "bfloat16"
            scaler = (" and onebit.amp.GradScaler('cuda') around step() (onebit skips a step "
                      "whose gradients overflowed on any rank, and its scaler keeps every "
                      "rank's scale the same)") if key == "fp16" else ""
            notes.append((key, "advice", f"train under torch.autocast(device_type, "
                                         f"dtype=torch.{dtype}){scaler}"))
        elif key == "scheduler":
            name = value.get("type") if isinstance(value, dict) else value
            if name in SCHEDULES:
                notes.append((key, "mapped", f"{name}: onebit.build_scheduler(optimizer, config) "
                                             "(DeepSpeed's formulas, a torch scheduler)"))
            else:
                notes.append((key, "advice", f"{name}: not one of DeepSpeed's {sorted(SCHEDULES)}; "
                                             "build the torch.optim.lr_scheduler equivalent"))
        elif key in _SCRIPT_KEYS:
            notes.append((key, "ignored", "the training script's batch and logging settings"))
        else:
            notes.append((key, "ignored", "not an optimizer setting"))
    return ConfigReading(section, extra, notes)


def _open(config: Union[str, os.PathLike, Dict[str, Any]]) -> Dict[str, Any]:
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            config = json.load(f)
    if not isinstance(config, dict):
        raise ValueError(f"config must be a dict or a JSON file path, got {type(config).__name__}")
    return config


def _load(config: Dict[str, Any]) -> Dict[str, Any]:
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
    reading = read_config(config)
    section = reading.section
    registry = _registry()
    kind = str(section["type"])
    factory = registry.get(kind.lower().replace("_", "").replace("-", ""))
    if factory is None:
        raise ValueError(f"unknown optimizer type {kind!r}; valid types: {TYPE_NAMES}")
    kwargs = {**reading.extra_kwargs, **section.get("params", {})}
    from .optim import OnebitLamb

    signature = inspect.signature({_lamb: OnebitLamb, _adam: torch.optim.AdamW,
                                   _adamw: torch.optim.AdamW}.get(factory, factory))
    accepted = {n for n in signature.parameters if n != "params"}
    if factory in (_adam, _adamw):
        accepted |= {"adam_w_mode", "torch_adam"}
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


def build_scheduler(optimizer: torch.optim.Optimizer, config) -> DeepSpeedLR:
    """The torch lr scheduler a DeepSpeed config's "scheduler" section
    describes ({"type": "WarmupLR", "params": {...}}; the whole config, that
    section alone, or a JSON file path), with DeepSpeed's formulas and
    parameter names (onebit/lr_schedules.py). Call its step() after each
    optimizer.step(), as with any torch scheduler."""
    config = _open(config)
    section = config.get("scheduler", config)
    if not isinstance(section, dict) or "type" not in section:
        raise ValueError('config needs {"scheduler": {"type": ..., "params": {...}}} '
                         'or {"type": ..., "params": {...}}')
    params = section.get("params") or {}
    if not isinstance(params, dict):
        raise ValueError(f'"params" must be a JSON object of keyword arguments, got {params!r}')
    return DeepSpeedLR(optimizer, schedule_from(str(section["type"]), params))
