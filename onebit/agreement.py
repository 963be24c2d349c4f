"""Ranks that must agree, and the checks that make them: the construction
fingerprint (shapes, requires_grad, hyper-parameters, backend, wire format),
the per-step agreement on which params train and on skipping a non-finite
step, and the replica divergence guard. Each failure is a ValueError (or
ReplicaDivergenceError) on every rank, raised before anything changed."""
from __future__ import annotations

import operator
from typing import Callable, List, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from . import collectives
from .multi_tensor import list_kernel
from .wire import WIRE_FORMAT_VERSION


BITS_PER_WORD = 62  # flags per int64 of the all-gather, clear of the sign bit


def pack_flags(flags: Sequence[bool]) -> List[int]:
    """`flags` as ints of BITS_PER_WORD bits each (at least one int)."""
    words = [0] * max(1, -(-len(flags) // BITS_PER_WORD))
    for k, f in enumerate(flags):
        if f:
            words[k // BITS_PER_WORD] |= 1 << (k % BITS_PER_WORD)
    return words


def pack_device_flags(flags: torch.Tensor) -> List[torch.Tensor]:
    """A 1-D bool tensor as 0-dim int64 words of BITS_PER_WORD bits each, on
    its device (as pack_flags, with no host read: they join a gather)."""
    out = []
    for start in range(0, flags.numel(), BITS_PER_WORD):
        part = flags[start:start + BITS_PER_WORD].to(torch.int64)
        out.append((part << torch.arange(part.numel(), device=part.device)).sum())
    return out


def flags_on_any_rank(rows: Sequence[Sequence[int]], count: int) -> List[bool]:
    """The first `count` flags that some rank's packed words (`rows`) set."""
    return _combined_flags(rows, count, operator.or_)


def flags_on_every_rank(rows: Sequence[Sequence[int]], count: int) -> List[bool]:
    """The first `count` flags that every rank's packed words (`rows`) set."""
    return _combined_flags(rows, count, operator.and_)


def _combined_flags(rows: Sequence[Sequence[int]], count: int, combine) -> List[bool]:
    words = list(rows[0])
    for row in rows[1:]:
        words = [combine(a, b) for a, b in zip(words, row)]
    return [bool(words[k // BITS_PER_WORD] >> (k % BITS_PER_WORD) & 1) for k in range(count)]


class ReplicaDivergenceError(RuntimeError):
    """The divergence guard found ranks whose parameters or state differ."""


def check_params_served(name: str, param_groups, group) -> None:
    """Every parameter must live where the process group's collectives take
    tensors (an NCCL group takes no host tensors): a ValueError naming the
    first that does not, before any collective, instead of a transport error
    deep inside the first step."""
    served = collectives.served_device_types(group)
    for gi, g in enumerate(param_groups):
        for pi, p in enumerate(g["params"]):
            if p.device.type not in served:
                raise ValueError(
                    f"{name}: param {pi} of group {gi} {tuple(p.shape)} is on {p.device}, but the "
                    f"process group ({dist.get_backend(group)}) takes tensors on "
                    f"{' or '.join(served)} only: move the model there first (model.to(device)) "
                    "or initialise the process group with a backend for that device")


def nonfinite_flag(grads_by_group: List[List[torch.Tensor]], device: torch.device,
                   found_inf=None) -> torch.Tensor:
    """1 (a 0-dim int64 tensor on `device`) where a GradScaler saw inf/NaN
    (`found_inf`) or a gradient holds a NaN or an inf, or values beyond
    ~1.8e19, which count as overflow (their squares are beyond fp32, so an
    Adam variance could not hold them). Decided on the device: no host sync.

    How: on a GPU whose kernels have the one-launch check (CUDA's), one
    kernel over every fp32 gradient tests each element's square; torch's
    _foreach_norm, the way elsewhere, cost 4.3 ms of host time a step at
    2000 tensors on an H200 (per-tensor outputs, then a stack). Elsewhere a
    tensor's 2-norm is NaN or inf iff it holds such a value (or its squares
    sum beyond fp32, which then counts too), in one pass with no
    temporaries, 5x faster on the CPU than the max-norm."""
    flag = torch.zeros((), dtype=torch.int64, device=device)
    # Empty tensors stay out: torch 2.2-2.5's CUDA _foreach_norm gave wrong
    # norms for lists holding them across several launches (pytorch#140066).
    # A step over thousands of small tensors pays for every per-tensor call
    # here, so each attribute is read once, with map.
    tensors = [t for g in grads_by_group for t in g]
    sizes = list(map(torch.Tensor.numel, tensors))
    if 0 in sizes:
        tensors, sizes = [t for t, n in zip(tensors, sizes) if n], [n for n in sizes if n]
    # The usual GPU case first: every gradient on one device whose kernels
    # check them in one launch. list_kernel refuses a list spread over
    # devices, so its yes needs no grouping pass of its own.
    whole = list_kernel("any_nonfinite", tensors) if tensors else None
    if whole is not None:
        by_device = [(tensors, sizes)]
    else:
        # One verdict per device where the gradients live, then one copy of
        # it to `device` (not a copy per tensor: from a GPU to a gloo group's
        # host that was a device-to-host copy per tensor). By index first
        # (get_device: a CPU tensor's is -1), which costs half what building
        # a torch.device per tensor does; the devices themselves only where
        # the indices differ.
        indices = set(map(torch.Tensor.get_device, tensors))
        devices = ({tensors[0].device} if len(indices) == 1 else set(map(_DEVICE, tensors)))
        by_device = ([(tensors, sizes)] if len(devices) == 1 else
                     [([t for t in tensors if t.device == d],
                       [n for t, n in zip(tensors, sizes) if t.device == d]) for d in devices])
    for on_device, their_sizes in by_device:
        here = on_device[0].device
        check = (whole if whole is not None else
                 list_kernel("any_nonfinite", on_device))  # (None: the norms below)
        if check is not None:
            mine = flag if here == flag.device else torch.zeros_like(flag, device=here)
            check(on_device, their_sizes, mine)
            if mine is not flag:
                flag |= mine.to(device)
            continue
        norms = torch.stack(torch._foreach_norm(on_device))
        flag |= (~torch.isfinite(norms).all()).to(device)
    if found_inf is not None:
        # (a GradScaler whose optimizer had no gradient on this rank hands
        # its step the int 0: it found nothing, and has no tensor to say so)
        flag |= (torch.as_tensor(found_inf).to(device) > 0).reshape(())
    return flag


_DEVICE = operator.attrgetter("device")


class StepVerdict(NamedTuple):
    """What the ranks decided together before a step."""

    nonfinite: bool  # some rank has a non-finite gradient (or its GradScaler saw one)
    redo_buckets: bool  # some rank must exchange its backward buckets again (overlap.py)
    nonfinite_everywhere: bool = False  # ... and every rank does
    gradless: tuple = ()  # per param of no_grad: no rank has a gradient for it (untouched.py)
    used: tuple = ()  # per flag of `used`: some rank set it (late.py: a first use)


def tensor_fingerprint(t: torch.Tensor) -> tuple:
    """A setting held as a tensor (exp_avg_mask, a tensor lr), by its shape,
    dtype and a position-weighted sum of its bytes: masks of one shape that
    zero different entries differ here (one host read, at construction)."""
    raw = t.detach().contiguous().view(-1).view(torch.uint8).to(torch.int64)
    weights = torch.arange(raw.numel(), device=raw.device) % 65521 + 1
    return tuple(t.shape), str(t.dtype), int((raw * weights).sum())


def _shape_or_value(t: torch.Tensor):
    """A step's cheap view of a tensor setting: a one-element one by value (a
    step reads its lr as a float anyway), another by shape and dtype."""
    return float(t) if t.numel() == 1 else (tuple(t.shape), str(t.dtype))


def group_settings(param_groups, leave_out: Sequence[str] = (),
                   tensor: Callable[[torch.Tensor], object] = _shape_or_value) -> list:
    """Each group's settings but its params (and `leave_out`), as sorted
    (name, value) pairs that ranks can compare by digest; a tensor setting
    as `tensor` describes it (its repr would name the device, which differs
    between ranks): cheaply at each step, by `tensor_fingerprint` at
    construction."""
    return [sorted((k, tensor(v) if isinstance(v, torch.Tensor) else v)
                   for k, v in g.items() if k != "params" and k not in leave_out)
            for g in param_groups]


def trainable_summary(param_groups) -> str:
    """Which params of each group require grad, in words."""
    return "; ".join(f"group {i}: {sum(p.requires_grad for p in g['params'])} of "
                     f"{len(g['params'])} params" for i, g in enumerate(param_groups))


class RankAgreement:
    """The checks that make every rank of `process_group` do the same thing,
    each one small all-gather bounded by `timeout_s`. `name` (the
    optimizer's) starts every error message."""

    def __init__(self, name: str, process_group, timeout_s: Optional[float]) -> None:
        self.name, self.process_group, self.timeout_s = name, process_group, timeout_s

    @property
    def rank(self) -> int:
        return dist.get_rank(self.process_group)

    def gather(self, phase: str, values: list) -> List[List[int]]:
        """Every rank's `values` (ints, or 0-dim tensors on the communication
        device), one list per rank, in one bounded all-gather."""
        return collectives.gather_numbers(f"{self.name}: {phase}", values, torch.int64,
                                          self.process_group, self.timeout_s)

    def check_construction(self, settings: dict, param_groups, backend_name: str) -> None:
        """Construction-time fingerprint (one small all-gather): every rank
        must build the same optimizer (the param groups' shapes and
        hyper-parameters, the `settings` declared by the optimizer, the
        backend, the wire format), or the collectives would mismatch."""
        fields = {
            "parameter shapes/order/requires_grad": [
                [(tuple(p.shape), str(p.dtype), p.requires_grad) for p in g["params"]]
                for g in param_groups],
            "hyper-parameters": (self.name, sorted(settings.items()),
                                 group_settings(param_groups, tensor=tensor_fingerprint)),
            "compressed backend": backend_name,
            "wire format version": WIRE_FORMAT_VERSION,
        }
        self.check_fields(fields)

    def check_fields(self, fields: dict) -> None:
        """Every rank must hold the same value under each name of `fields`
        (compared by digest, in one all-gather): else a ValueError on every
        rank naming the fields that differ and this rank's values."""
        digest = [collectives.stable_digest(v) for v in fields.values()]
        table = self.gather("construction fingerprint", digest)
        bad = [name for j, name in enumerate(fields) if len({row[j] for row in table}) > 1]
        if bad:
            raise ValueError(f"{self.name}: ranks disagree on {', '.join(bad)}; "
                             f"this rank ({self.rank}) has " + "; ".join(
                                 f"{b} = {fields[b]!r}"[:400] for b in bad))

    def before_step(self, step: int, nonfinite: torch.Tensor, trainable_digest: int,
                    redo_buckets: bool, param_groups,
                    no_grad: Sequence[bool] = (), settings: Optional[dict] = None,
                    used: Optional[torch.Tensor] = None) -> StepVerdict:
        """One all-gather before step `step` changes anything: the ranks must
        train the same params (else the exchanges would not match: gloo
        aborts the process; a ValueError here instead) and hold the same
        `settings` (name -> value: the counters that decide the stage, the
        groups' hyper-parameters; a scheduler stepped on one rank only would
        let the replicas drift apart with no error), and they learn
        whether any rank saw a non-finite gradient (`nonfinite`, a 0-dim
        device flag: it stays on the device until the table comes back),
        must redo its backward buckets, and which params (`no_grad`: this
        rank's flag for every param of every group, so the message has the
        same length on every rank) no rank has a gradient for, and which of
        `used` (a 1-D bool device tensor, as long on every rank) some rank
        set."""
        settings = settings or {}
        digests = [collectives.stable_digest(v) for v in settings.values()]
        head = 3 + len(digests)
        packed = pack_flags(no_grad)
        used_words = pack_device_flags(used) if used is not None else []
        table = self.gather("agreeing on the trainable params and on skipping a non-finite step",
                            [nonfinite, trainable_digest, int(redo_buckets)] + digests
                            + packed + used_words)
        tail = head + len(packed)
        if len({row[1] for row in table}) > 1:
            raise ValueError(
                f"{self.name}: ranks disagree on which parameters require grad at step {step}; "
                f"nothing was updated. This rank ({self.rank}) trains "
                f"{trainable_summary(param_groups)}. Freeze and unfreeze the same parameters on "
                "every rank, at the same step")
        bad = [name for j, name in enumerate(settings) if len({row[3 + j] for row in table}) > 1]
        if bad:
            raise ValueError(
                f"{self.name}: ranks disagree on {', '.join(bad)} at step {step}; nothing was "
                f"updated. This rank ({self.rank}) has " + "; ".join(
                    f"{b} = {settings[b]!r}"[:1500] for b in bad)
                + ". Change them on every rank alike (a scheduler on every rank, one "
                "checkpoint loaded everywhere)")
        return StepVerdict(any(row[0] for row in table), any(row[2] for row in table),
                           all(row[0] for row in table),
                           tuple(flags_on_every_rank([row[head:tail] for row in table],
                                                     len(no_grad))),
                           tuple(flags_on_any_rank([row[tail:] for row in table], used.numel()))
                           if used_words else ())

    def check_replicas(self, step: int, param_groups, state) -> None:
        """Divergence guard: compare a checksum of every parameter and state
        tensor across ranks; raise naming the first that differs."""
        names, sums = [], []
        for gi, group in enumerate(param_groups):
            for pi, p in enumerate(group["params"]):
                tensors = [("value", p.detach())] + sorted(
                    (k, v) for k, v in state.get(p, {}).items() if isinstance(v, torch.Tensor))
                for name, t in tensors:
                    raw = t.contiguous().view(-1).view(torch.uint8)
                    words = raw.view(torch.int32) if raw.numel() % 4 == 0 else raw
                    names.append(f"group {gi} param {pi} {tuple(p.shape)} {name}")
                    sums.append(int(words.sum(dtype=torch.int64)))
        if not sums:
            return
        table = self.gather("replica divergence check", sums)
        for j, name in enumerate(names):
            column = [row[j] for row in table]
            if len(set(column)) > 1:
                odd = [r for r, v in enumerate(column) if v != column[0]]
                raise ReplicaDivergenceError(
                    f"{self.name}: replicas diverged by step {step}: {name} differs "
                    f"on rank(s) {odd} from rank 0")
