"""FSDP2-sharded parameters, seen by the optimizers as their local shards.

Shard inside a node, 1 bit between nodes. Under
`fully_shard(module, mesh=mesh["shard"])` every parameter is a DTensor with
one `Shard(0)` placement on a 1-D mesh: this rank holds a run of its rows,
and after backward its `.grad` holds the mean of those rows' gradients over
the shard group (FSDP2's reduce-scatter, in full precision, on the links
inside a node). The same rows live on one rank of every other node: the
ranks of the optimizer's `process_group` (the mesh's "replicate" dim). They
are the replicas of this shard, and the optimizer averages over them exactly
as it averages whole parameters under DDP: in full precision in warmup, in
1 bit after the freeze. Every optimizer step is elementwise, so its maths
runs unchanged on the local tensors; only these need the shard group:

- a decision every shard of a parameter must share: skipping a non-finite
  step, which params have no gradient anywhere (`mesh_group`: the ranks of
  the replicate and shard dims together);
- a norm of a whole parameter (LAMB's trust ratio, gradient clipping):
  the shards' squared norms summed over the shard group (`whole_norms`).

The optimizer's state stays keyed by the parameters themselves (what
torch.optim, DCP and FSDP2's tooling expect), holding local tensors in
memory; `to_dtensors` and `from_dtensors` turn them into DTensors of the
parameter's placement and back at `state_dict` / `load_state_dict`, so that
torch.distributed.checkpoint saves and reshards them as it does the params.
"""
from __future__ import annotations

import sys
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from .backends import backend_name

SUPPORTED = ("FSDP2 on a 1-D mesh of the GPUs (or processes) of one node: "
             "fully_shard(module, mesh=mesh['shard']) with the optimizer's "
             "process_group=mesh.get_group('replicate')")


def _dtensor_api():
    """torch.distributed.tensor once something has imported it, else None.
    A DTensor exists only then, and importing it here would cost every
    process about 1 s (it pulls in sympy), sharded or not. What below needs
    more of it runs on DTensors only, so it is loaded by then."""
    return sys.modules.get("torch.distributed.tensor")


def is_sharded(p: torch.Tensor) -> bool:
    api = _dtensor_api()
    return api is not None and isinstance(p, api.DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds of `t` (a DTensor), or `t` itself. In place
    changes to it change the parameter: it is a view of FSDP2's shard."""
    return t.to_local() if is_sharded(t) else t


def placed_like(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """`t`, a tensor shaped like the local shard of param `p`, as a DTensor
    of `p`'s placement (what DCP saves and reshards); else `t` itself."""
    if not is_sharded(p) or is_sharded(t) or t.shape != p.to_local().shape:
        return t
    return _dtensor_api().DTensor.from_local(t, p.device_mesh, p.placements, run_check=False,
                                             shape=p.shape, stride=p.stride())


class ShardedParams:
    """The params of an optimizer as local shards, or, when none is a
    DTensor, as themselves (then every method is the identity, and costs a
    dict lookup at most).

    `name` (the optimizer's) starts every error message; `process_group`
    is the group the optimizer averages over (the replicate dim)."""

    def __init__(self, name: str, param_groups, process_group) -> None:
        self.name, self.process_group = name, process_group
        self.sharded = any(is_sharded(p) for g in param_groups for p in g["params"])
        self.shard_group = self.mesh_group = None
        self.shard_rank, self.shard_count = 0, 1
        self._owners: Dict[int, torch.Tensor] = {}  # id(local view) -> its parameter
        self._cut_masks: Dict[int, tuple] = {}  # id(group's first param) -> (mask, its cut)
        if self.sharded:
            self._check_layout(param_groups)

    # ------------------------------------------------------------ layout --
    def _check_layout(self, param_groups) -> None:
        """A ValueError naming what is supported for any layout that would
        average the wrong things together (the module docstring's)."""
        params = [p for g in param_groups for p in g["params"]]
        mesh = None
        for i, p in enumerate(params):
            where = f"{self.name}: param {i} {tuple(p.shape)}"
            if not is_sharded(p):
                raise ValueError(f"{where} is a plain tensor among FSDP2-sharded DTensors: shard "
                                 f"every parameter the optimizer trains ({SUPPORTED})")
            if p.device_mesh.ndim != 1:
                raise ValueError(
                    f"{where} lives on a {p.device_mesh.ndim}-D mesh "
                    f"{p.device_mesh.mesh_dim_names}: HSDP (fully_shard on the whole 2-D mesh) "
                    "would all-reduce the gradients across replicas itself, in full precision, "
                    "and onebit would average them again; a tensor-parallel dim is not "
                    f"supported. Use {SUPPORTED}")
            if tuple(p.placements) != (_dtensor_api().Shard(0),):
                raise ValueError(f"{where} has placements {tuple(p.placements)}; supported: "
                                 f"(Shard(dim=0),), FSDP2's default ({SUPPORTED})")
            if mesh is None:
                mesh = p.device_mesh
            elif p.device_mesh != mesh:
                raise ValueError(f"{where} is sharded on another mesh ({p.device_mesh}) than "
                                 f"param 0 ({mesh}): one shard mesh for every param ({SUPPORTED})")
        self.shard_group = mesh.get_group()
        self.shard_rank, self.shard_count = mesh.get_local_rank(), mesh.size()
        self._check_groups()

    def _check_groups(self) -> None:
        """The replicate group must hold exactly one rank of each node's
        shard group, and the two together must be the whole world (the
        decisions every shard shares are all-gathered over it)."""
        shard_ranks = set(dist.get_process_group_ranks(self.shard_group))
        replicate_ranks = set(dist.get_process_group_ranks(
            self.process_group if self.process_group is not None else dist.group.WORLD))
        if len(shard_ranks & replicate_ranks) != 1:
            raise ValueError(
                f"{self.name}: process_group (ranks {sorted(replicate_ranks)}) shares "
                f"{len(shard_ranks & replicate_ranks)} ranks with the params' shard group (ranks "
                f"{sorted(shard_ranks)}); it must be the replicate dim of the mesh, one rank per "
                f"shard group, or different shards would be averaged together ({SUPPORTED})")
        world = dist.get_world_size()
        if len(shard_ranks) * len(replicate_ranks) != world:
            raise ValueError(
                f"{self.name}: {len(replicate_ranks)} replicas x {len(shard_ranks)} shards is not "
                f"the world ({world} ranks): a mesh with a dim besides replicate and shard "
                f"(pipeline or tensor parallelism) is not supported ({SUPPORTED})")
        self.mesh_group = dist.group.WORLD

    def comm_backend(self, name: Optional[str]) -> Optional[str]:
        """The compressed backend to use, from the one asked for (None: the
        default). Sharded, only the flat torch.distributed one fits: the
        replicate group holds one rank per node already (the hierarchical
        default of a multi-node launch would regroup it by node), and MPI's
        communicator is the world, shards and all."""
        if not self.sharded:
            return name
        if name is None:
            return "compressed"
        if backend_name(name) != "compressed":
            raise ValueError(f"{self.name}: comm_backend_name={name!r} with FSDP2-sharded params; "
                             "supported: 'compressed' (the default here), over process_group")
        return name

    def check_added(self, param_groups) -> None:
        """A group added later (add_param_group) keeps the layout: sharded
        like the rest, or plain like the rest."""
        if self.sharded:
            self._check_layout(param_groups)
        elif any(is_sharded(p) for g in param_groups for p in g["params"]):
            raise ValueError(f"{self.name}: a group of FSDP2-sharded params added to an "
                             f"optimizer of whole params; build it with the sharded params "
                             f"from the start ({SUPPORTED})")

    def replica_fields(self) -> dict:
        """What every rank of process_group must share (compared in one
        all-gather at construction): which shard of the mesh it holds. A
        group that crosses shards (rank 0's shard 0 with rank 3's shard 1)
        shares one rank with each shard group, as the replicate dim does."""
        return {"the shard each rank of process_group holds (process_group must be the mesh's "
                "replicate dim)": (self.shard_rank, self.shard_count)}

    def identity(self) -> dict:
        """What error buffers saved on this rank are valid for, besides the
        replicate rank: the shard they belong to (empty when not sharded)."""
        return {"shard": self.shard_rank, "shards": self.shard_count} if self.sharded else {}

    # ------------------------------------------------------ local views --
    def locals(self, params: List[torch.Tensor]) -> List[torch.Tensor]:
        """The local shards of `params`, remembered for `owner` until the next
        call. FSDP2 rebinds a parameter's local tensor (at lazy init, after a
        load), so the views are taken afresh at every step."""
        if not self.sharded:
            return params
        views = [p.to_local() for p in params]
        self._owners.update((id(v), p) for v, p in zip(views, params))
        return views

    def forget_views(self) -> None:
        """Drop the views of the last step (their ids may be reused)."""
        self._owners.clear()

    def owner(self, t: torch.Tensor) -> torch.Tensor:
        """The parameter whose local shard `t` is (from `locals`), or `t`."""
        # Called per param several times a step: no lookup when nothing is sharded.
        return self._owners.get(id(t), t) if self._owners else t

    def owners(self, ts: List[torch.Tensor]) -> List[torch.Tensor]:
        """`owner` of each of `ts`, in one pass."""
        if not self._owners:
            return ts
        get = self._owners.get
        return [get(id(t), t) for t in ts]

    def grad(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        """The local shard of the gradient of the parameter `t` stands for."""
        if not self._owners:
            return t.grad
        g = self.owner(t).grad
        return local(g) if g is not None else None

    def grads(self, ts: List[torch.Tensor]) -> List[Optional[torch.Tensor]]:
        """`grad` of each of `ts`, in one pass."""
        if not self._owners:
            return [t.grad for t in ts]
        return [self.grad(t) for t in ts]

    def local_mask(self, mask: torch.Tensor, group_params: List[torch.Tensor]) -> torch.Tensor:
        """The part of a group's `exp_avg_mask` this rank's shards take. A
        mask of the whole param's shape is cut as FSDP2 cuts the params
        (Shard(0)); one that broadcasts along dim 0 (fewer dims, or one row)
        applies to every shard as it is. The cut is kept while the group
        holds the same mask."""
        whole = group_params[0]
        if not self.sharded or mask.dim() < whole.dim() or mask.shape[0] == 1:
            return mask
        kept = self._cut_masks.get(id(whole))
        if kept is not None and kept[0] is mask:
            return kept[1]
        if tuple(mask.shape) != tuple(whole.shape):
            raise ValueError(f"{self.name}: exp_avg_mask of shape {tuple(mask.shape)} neither has "
                             f"the group's params' shape {tuple(whole.shape)} nor broadcasts "
                             "along their sharded dim 0")
        # src_data_rank=None: every rank holds the whole mask; no collective.
        cut = _dtensor_api().distribute_tensor(mask, whole.device_mesh, whole.placements,
                                               src_data_rank=None).to_local()
        self._cut_masks[id(whole)] = (mask, cut)  # holding `mask` keeps its id unique
        return cut

    def state_view(self, state):
        """`state` (keyed by parameters) indexed by local shards as well."""
        return _StateByShard(state, self) if self.sharded else state

    # --------------------------------------------------- whole parameters --
    def whole_norms(self, norms: torch.Tensor) -> torch.Tensor:
        """The 2-norms of whole parameters from their shards' (a 1-D tensor,
        one per param, the same order on every shard): one all-reduce of the
        squares over the shard group."""
        if not self.sharded or self.shard_count == 1:
            return norms
        squares = norms.double().square()
        dist.all_reduce(squares, group=self.shard_group)
        return squares.sqrt().to(norms.dtype)

    def whole_sums(self, counts: torch.Tensor) -> torch.Tensor:
        """Per-param sums over the shards (a 1-D tensor, one per param)."""
        if self.shard_count == 1:
            return counts
        counts = counts.clone()
        dist.all_reduce(counts, group=self.shard_group)
        return counts

    def whole_maxima(self, values: torch.Tensor) -> torch.Tensor:
        """Per-param maxima over the shards (a 1-D tensor, one per param)."""
        if not self.sharded or self.shard_count == 1:
            return values
        values = values.clone()
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.shard_group)
        return values

    # ------------------------------------------------------- checkpoints --
    def to_dtensors(self, state_dict: dict, params: List[torch.Tensor]) -> None:
        """In `state_dict["state"]` (keyed by index into `params`), every
        tensor shaped like its param's local shard becomes a DTensor of the
        param's placement, which DCP saves and reshards as it does params."""
        if not self.sharded:
            return
        for index, st in state_dict["state"].items():
            if not isinstance(index, int):  # (an entry that is no param's, kept as it is)
                continue
            # A new dict: torch's state_dict shares the live per-param dicts.
            state_dict["state"][index] = {
                k: placed_like(v, params[index]) if isinstance(v, torch.Tensor) else v
                for k, v in st.items()}

    def from_dtensors(self, state) -> None:
        """The reverse, in a loaded optimizer's `state`: local tensors."""
        if not self.sharded:
            return
        for key, st in state.items():
            if not isinstance(key, torch.Tensor):  # (an entry that is no param's)
                continue
            for k, v in st.items():
                st[k] = local(v) if isinstance(v, torch.Tensor) else v


class _StateByShard:
    """An optimizer's `state` that a local shard indexes as its parameter."""

    def __init__(self, state, shards: ShardedParams) -> None:
        self._state, self._shards = state, shards

    def __getitem__(self, t):
        return self._state[self._shards.owner(t)]

    def get(self, t, default=None):
        return self._state.get(self._shards.owner(t), default)

    def __contains__(self, t) -> bool:
        return self._shards.owner(t) in self._state

    def values(self):
        return self._state.values()
