"""Shard inside a node, 1 bit between nodes: the optimizers on FSDP2-sharded
params, on real gloo ranks laid out as (replicate = nodes) x (shard = ranks
per node) meshes, 2x2 and 3x2.

What is compared against what:
- 1-bit Adam's shards against a float64 simulation written here from
  docs/design.md ("Sharded training"), with the compressed exchange of
  tests/reference.py: FSDP2 averages a shard's gradient over its node, then
  each shard is an independent 1-bit Adam over the nodes, its tensors laid
  out on blocks of their own;
- warmup on shards against the same optimizer on whole params over all
  ranks, in the same job (LAMB's trust ratio needs whole-param norms);
- every shard against its copies on the other nodes, bit for bit, after
  every step.
"""
import math

import numpy as np
import pytest
import torch

from tests.distributed import run_workers
from tests.reference import placement, reference_round, sparse

BLOCK = 256  # the optimizers' default block_size

# 7 rows: shards of 4+3 (2 per node) or 3+3+1 (3); 1 row: an empty shard;
# 600 elements: several blocks. Gradient scales six orders of magnitude apart.
SHAPES = [(7, 5), (13,), (1, 3), (4, 3, 2), (600,)]
GRAD_SCALES = [1.0, 1e-3, 10.0, 1.0, 1e-2]
PARAM_SCALE = 0.05  # keeps LAMB's ||p|| / ||u|| inside its default clamp [0.01, 10]


def synthetic_grad(rank, step, i):
    g = torch.Generator().manual_seed(7919 * step + 31 * rank + i + 1)
    return torch.randn(SHAPES[i], generator=g) * (1 + rank) * GRAD_SCALES[i]


def initial_params():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g) * PARAM_SCALE for s in SHAPES]


class Synthetic(torch.nn.Module):
    """loss = sum_i <p_i, w_i>: the gradient of p_i is w_i, exactly, on each
    rank. `unused` params take no part (no rank has a gradient for them)."""

    def __init__(self, unused=()):
        super().__init__()
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(p.clone()) for p in initial_params()])
        self.unused = set(unused)

    def forward(self, weights):
        return sum((p * w).sum() for i, (p, w) in enumerate(zip(self.ps, weights))
                   if i not in self.unused)


def weights(rank, step):
    return [synthetic_grad(rank, step, i) for i in range(len(SHAPES))]


def sharded(world, nodes, unused=(), device="cpu"):
    """A Synthetic model under fully_shard on the shard dim of a (nodes,
    world // nodes) mesh, and the replicate group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device, (nodes, world // nodes), mesh_dim_names=("replicate", "shard"))
    model = Synthetic(unused).to(device)
    fully_shard(model, mesh=mesh["shard"])
    return model, mesh


def local_flat(model):
    return [p.to_local().detach().reshape(-1).clone() for p in model.parameters()]


def assert_replicas_identical(model, group, where):
    import torch.distributed as dist

    for i, t in enumerate(local_flat(model)):
        copies = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(copies, t, group=group)
        for r, c in enumerate(copies[1:], 1):
            assert torch.equal(copies[0].view(torch.int32), c.view(torch.int32)), \
                f"param {i}'s shard differs on replica {r} {where}"


def make(cls_name, params, **kw):
    import onebit

    return getattr(onebit, cls_name)(params, **kw)


CONFIGS = {
    "OnebitAdam": dict(freeze_step=4, lr=1e-2),
    "OnebitLamb": dict(freeze_step=4, lr=1e-2, weight_decay=0.01),
    "ZeroOneAdam": dict(var_freeze_step=4, var_update_scaler=2, local_step_scaler=4,
                        local_step_clipper=2, lr=1e-2, weight_decay=0.01),
}


# ------------------------------------------------- the float64 reference --
def shard_rows(rows, s, shards):
    """The rows FSDP2 gives shard s of `shards` (torch.chunk on dim 0)."""
    chunk = -(-rows // shards)
    return slice(min(s * chunk, rows), min((s + 1) * chunk, rows))


def simulate_sharded_onebit_adam(nodes, per_node, steps, freeze, lr, betas=(0.9, 0.999),
                                 eps=1e-8, groups=None, masks=None):
    """1-bit Adam on shards in float64: for each shard s, the tensors are the
    s-th row runs of every param; node n's gradient is the mean over its
    ranks of their gradients' rows (FSDP2's reduce-scatter); then the paper's
    1-bit Adam over the nodes (warmup: Adam on the exact mean; after the
    freeze: each node's momentum through reference.py's compressed
    exchange, one exchange per param group). `masks` {param: whole-shaped
    0/1 array}: DeepSpeed's exp_avg_mask, multiplied into the averaged
    momentum after each exchange. Returns {(s, i): final flat values of
    param i's shard s}."""
    p0 = [p.double().numpy() for p in initial_params()]
    groups = groups or [list(range(len(p0)))]
    masks = masks or {}
    out = {}
    for s in range(per_node):
        rows = [shard_rows(p.shape[0], s, per_node) for p in p0]
        params = [p[r].reshape(-1).copy() for p, r in zip(p0, rows)]
        cut = {i: mask[rows[i]].reshape(-1) for i, mask in masks.items()}
        m = [np.zeros(len(x)) for x in params]
        v = [np.zeros(len(x)) for x in params]
        errors = []
        for group in groups:
            _, n, _ = placement([len(params[i]) for i in group], BLOCK, nodes)
            errors.append(([np.zeros(n) for _ in range(nodes)], [np.zeros(n // nodes)] * nodes))

        def node_grads(node, t):
            ranks = range(node * per_node, (node + 1) * per_node)
            return [np.mean([synthetic_grad(r, t, i).double().numpy()[rows[i]].reshape(-1)
                             for r in ranks], axis=0) for i in range(len(p0))]

        for t in range(1, steps + 1):
            grads = [node_grads(node, t) for node in range(nodes)]
            if t <= freeze:
                g = [np.mean([gs[i] for gs in grads], axis=0) for i in range(len(p0))]
                m = [betas[0] * mi + (1 - betas[0]) * gi for mi, gi in zip(m, g)]
                v = [betas[1] * vi + (1 - betas[1]) * gi * gi for vi, gi in zip(v, g)]
            else:
                local = [[betas[0] * mi + (1 - betas[0]) * gi for mi, gi in zip(m, gs)]
                         for gs in grads]
                if nodes == 1:  # one replica: nothing to exchange, the momentum as it is
                    m = local[0]
                for k, group in enumerate(groups):
                    if nodes > 1:
                        avg, werrs, serrs, _ = reference_round(
                            [[node_m[i] for i in group] for node_m in local], *errors[k], BLOCK)
                        errors[k] = (werrs, serrs)
                        for i, mi in zip(group, avg):
                            m[i] = mi
                for i, mask in cut.items():
                    m[i] = m[i] * mask
            bc1, bc2 = 1 - betas[0] ** t, 1 - betas[1] ** min(t, freeze)
            params = [p - lr * (mi / bc1) / (np.sqrt(vi / bc2) + eps)
                      for p, mi, vi in zip(params, m, v)]
        for i, p in enumerate(params):
            out[(s, i)] = p
    return out


def _sharded_adam(rank, world, nodes, steps, kw, device="cpu", masks=None):
    model, mesh = sharded(world, nodes, device=device)
    params = model.parameters()
    if masks:  # a group per masked param, then the rest (MASK_GROUPS)
        ps = list(model.parameters())
        params = [{"params": [ps[i]], "exp_avg_mask": torch.tensor(mask).to(device)}
                  for i, mask in masks.items()]
        params.append({"params": [p for i, p in enumerate(ps) if i not in masks]})
    opt = make("OnebitAdam", params, process_group=mesh.get_group("replicate"), **kw)
    for t in range(1, steps + 1):
        model([w.to(device) for w in weights(rank, t)]).backward()
        opt.step()
        opt.zero_grad()
        assert_replicas_identical(model, mesh.get_group("replicate"), f"after step {t}")
    return mesh["shard"].get_local_rank(), [t.double().cpu().numpy() for t in local_flat(model)]


ON_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                               reason="no CUDA device here")]


def ranks_on(device):
    """How a test's ranks start: gloo on the host, or the GPU tier's NCCL
    ranks (tests/nccl_ranks.py: a GPU per rank, or ranks sharing one)."""
    if device == "cuda":
        from tests.nccl_ranks import run_gpu_ranks

        return run_gpu_ranks
    return run_workers


@pytest.mark.slow
@pytest.mark.parametrize("nodes,per_node,device", [
    (2, 2, "cpu"), (3, 2, "cpu"), (1, 3, "cpu"), pytest.param(2, 2, "cuda", marks=ON_CUDA)])
def test_onebit_adam_on_shards_matches_the_float64_simulation(nodes, per_node, device):
    """On CUDA over NCCL: a GPU per rank, or ranks sharing one GPU through
    tests/nccl_ranks.py."""
    steps, freeze, lr = 10, 4, 1e-2
    got = ranks_on(device)(_sharded_adam, nodes * per_node, nodes, steps,
                           dict(freeze_step=freeze, lr=lr), device, timeout=180)
    expected = simulate_sharded_onebit_adam(nodes, per_node, steps, freeze, lr)
    start = [p.double().numpy() for p in initial_params()]
    for shard, values in got:
        for i, v in enumerate(values):
            want = expected[(shard, i)]
            rows = shard_rows(SHAPES[i][0], shard, per_node)
            moved = np.abs(want - start[i][rows].reshape(-1))
            assert want.size == 0 or moved.mean() > 1e-3, "the comparison must not stand still"
            np.testing.assert_allclose(v, want, rtol=0, atol=2e-4,
                                       err_msg=f"param {i}, shard {shard}")


def whole_masks():
    """exp_avg_mask for param 0 (7x5, whole-shaped: rows 1 and 5 off, one on
    each shard of 2, and one element of row 3) and param 3 (4x3x2, a 3x2
    mask that broadcasts along the sharded dim)."""
    rows = np.ones(SHAPES[0])
    rows[[1, 5]] = 0
    rows[3, 2] = 0
    plane = np.ones(SHAPES[3][1:])
    plane[1, 0] = 0
    return {0: rows, 3: plane}


@pytest.mark.slow
def test_exp_avg_mask_on_shards_matches_the_float64_simulation():
    """Each shard takes its rows of a whole-shaped mask; a mask that
    broadcasts along dim 0 applies to every shard as it is."""
    steps, freeze, lr = 8, 3, 1e-2
    masks = whole_masks()
    got = run_workers(_sharded_adam, 4, 2, steps, dict(freeze_step=freeze, lr=lr), "cpu",
                      masks, timeout=180)
    whole = {0: masks[0], 3: np.broadcast_to(masks[3], SHAPES[3])}
    expected = simulate_sharded_onebit_adam(2, 2, steps, freeze, lr, groups=[[0], [3], [1, 2, 4]],
                                            masks=whole)
    unmasked = simulate_sharded_onebit_adam(2, 2, steps, freeze, lr, groups=[[0], [3], [1, 2, 4]])
    for shard, values in got:
        for i, v in enumerate(values):
            np.testing.assert_allclose(v, expected[(shard, i)], rtol=0, atol=2e-4,
                                       err_msg=f"param {i}, shard {shard}")
        for i in (0, 3):  # the masks changed what these shards did
            assert np.abs(expected[(shard, i)] - unmasked[(shard, i)]).max() > 1e-3


# ------------------------------------------- identical replicas, 3 nodes --
def _replicas_through_both_stages(rank, world, nodes, cls_name):
    model, mesh = sharded(world, nodes)
    opt = make(cls_name, model.parameters(), process_group=mesh.get_group("replicate"),
               **CONFIGS[cls_name])
    start = local_flat(model)
    for t in range(1, 13):
        model(weights(rank, t)).backward()
        opt.step()
        opt.zero_grad()
        # 0/1 Adam's local steps differ between syncs by design; its syncs
        # (and every other optimizer's steps) leave the replicas identical.
        if cls_name != "ZeroOneAdam" or opt.last_stage.name != "local step":
            assert_replicas_identical(model, mesh.get_group("replicate"), f"after step {t}")
    moved = [float((a - b).abs().max()) for a, b in zip(local_flat(model), start) if a.numel()]
    return opt.counters["step"], moved, [str(opt.last_stage.name)]


@pytest.mark.slow
@pytest.mark.parametrize("cls_name", sorted(CONFIGS))
def test_every_shard_is_bitwise_identical_on_every_replica(cls_name):
    for step, moved, _ in run_workers(_replicas_through_both_stages, 6, 3, cls_name, timeout=180):
        assert step == 12
        assert all(math.isfinite(x) for x in moved) and max(moved) > 1e-4


# --------------------------------------- warmup = whole params over all ranks --
def _warmup_against_whole_params(rank, world, nodes, cls_name):
    import torch.distributed as dist

    model, mesh = sharded(world, nodes)
    # 0/1 Adam: every step a variance update (full precision) until 100.
    kw = dict(CONFIGS[cls_name], **({"var_freeze_step": 100, "var_update_scaler": 100}
                                    if cls_name == "ZeroOneAdam" else {"freeze_step": 100}))
    opt = make(cls_name, model.parameters(), process_group=mesh.get_group("replicate"), **kw)
    whole = Synthetic()
    whole_opt = make(cls_name, whole.parameters(), **kw)  # the world: every rank a replica
    coeffs = []
    for t in range(1, 6):
        model(weights(rank, t)).backward()
        whole(weights(rank, t)).backward()
        opt.step()
        whole_opt.step()
        opt.zero_grad()
        whole_opt.zero_grad()
        coeffs += getattr(opt, "lamb_coeffs", [])
    gaps = [float((p.detach().full_tensor() - q.detach()).abs().max() / q.detach().abs().max())
            for p, q in zip(model.parameters(), whole.parameters())]
    moved = [float((q.detach() - p0).abs().max()) for q, p0 in zip(whole.parameters(), initial_params())]

    def state_numel(o):
        return sum(v.to_local().numel() if hasattr(v, "to_local") else v.numel()
                   for st in o.state_dict()["state"].values() for v in st.values()
                   if isinstance(v, torch.Tensor))
    return gaps, moved, coeffs, state_numel(opt) / state_numel(whole_opt), dist.get_rank()


@pytest.mark.slow
@pytest.mark.parametrize("cls_name", sorted(CONFIGS))
def test_warmup_on_shards_equals_the_optimizer_on_whole_params(cls_name):
    """In warmup (0/1 Adam: before var_freeze_step) the shards average in
    full precision over the replicas what FSDP2 averaged over the node: the
    mean over all ranks, as the same optimizer on whole params computes it,
    to fp32 rounding. LAMB's trust ratios must use whole-param norms for
    this to hold (they stay inside the clamp here, and ||p|| of a shard
    is about 0.7 of the whole's). The optimizer state on
    each rank is that of its shard: about half at 2 shards."""
    for gaps, moved, coeffs, state_share, rank in run_workers(
            _warmup_against_whole_params, 4, 2, cls_name, timeout=180):
        assert min(moved) > 1e-3, moved
        assert max(gaps) < 1e-5, gaps
        if cls_name == "OnebitLamb":
            assert coeffs and all(0.01 < c < 10.0 for c in coeffs), coeffs  # the clamp
        assert 0.2 < state_share <= 0.6, state_share


# ------------------------------------------------------- bad gradients --
def _inf_on_one_rank(rank, world, nodes):
    model, mesh = sharded(world, nodes)
    opt = make("OnebitAdam", model.parameters(), process_group=mesh.get_group("replicate"),
               freeze_step=2, lr=1e-2)
    for t in range(1, 4):
        model(weights(rank, t)).backward()
        opt.step()
        opt.zero_grad()
    before = local_flat(model)
    w = weights(rank, 4)
    if rank == 0:
        w[0][0, 0] = math.inf  # row 0: only shard 0 of node 0 sees it after FSDP2's mean
    model(w).backward()
    seen = bool(torch.isfinite(model.ps[0].grad.to_local()).all())
    with pytest.raises(ValueError, match="NaN or Inf gradient at step 4"):
        opt.step()
    unchanged = all(torch.equal(a, b) for a, b in zip(before, local_flat(model)))
    return seen, unchanged, opt.counters["step"]


@pytest.mark.slow
def test_an_inf_on_one_rank_stops_the_step_on_every_shard_and_replica():
    results = run_workers(_inf_on_one_rank, 4, 2, timeout=120)
    assert [seen for seen, _, _ in results].count(False) == 1  # one shard saw the inf
    for _, unchanged, step in results:
        assert unchanged and step == 3


def _unused_param(rank, world, nodes):
    model, mesh = sharded(world, nodes, unused=(3,))
    opt = make("OnebitAdam", model.parameters(), process_group=mesh.get_group("replicate"),
               freeze_step=2, lr=1e-2, weight_decay=0.1)
    start = local_flat(model)
    for t in range(1, 6):
        model(weights(rank, t)).backward()
        opt.step()
        opt.zero_grad()
    now = local_flat(model)
    return [torch.equal(a, b) for a, b in zip(start, now)]


@pytest.mark.slow
def test_a_param_no_rank_has_a_gradient_for_stays_untouched():
    for same in run_workers(_unused_param, 4, 2, timeout=120):
        assert same[3] and not same[0] and not same[4], same


def _first_used_after_the_freeze(rank, world, nodes):
    """Param 3 unused by every rank through the warmup (freeze 2) and used
    from step 6: a late joiner from step 7 (late.py), on every shard alike
    (whether its v is 0 is decided for the whole param)."""
    model, mesh = sharded(world, nodes, unused=(3,))
    opt = make("OnebitAdam", model.parameters(), process_group=mesh.get_group("replicate"),
               freeze_step=2, lr=1e-2, weight_decay=0.1)
    moved = []
    for t in range(1, 11):
        if t == 6:
            model.unused = set()
        before = local_flat(model)[3]
        model(weights(rank, t)).backward()
        opt.step()
        opt.zero_grad()
        moved.append(not torch.equal(before, local_flat(model)[3]))
    assert_replicas_identical(model, mesh.get_group("replicate"), "after step 10")
    return moved


@pytest.mark.slow
def test_a_param_first_used_after_the_freeze_trains_on_every_shard():
    for moved in run_workers(_first_used_after_the_freeze, 4, 2, timeout=120):
        assert moved == [False] * 6 + [True] * 4, moved


# --------------------------------------------------------- checkpoints --
def _dcp_save_or_resume(rank, world, nodes, path, resume):
    """Straight: 10 steps, saving at step 6 (1 bit since step 5). Resumed: a
    fresh model and optimizer (other initial values) load the checkpoint
    with DCP and take steps 7 to 10."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict,
                                                         set_model_state_dict,
                                                         set_optimizer_state_dict)

    model, mesh = sharded(world, nodes)
    if resume:
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().fill_(3.0)
    opt = make("OnebitAdam", model.parameters(), process_group=mesh.get_group("replicate"),
               freeze_step=4, lr=1e-2)
    errors = opt.error_feedback_key()

    def state():
        return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt),
                errors: opt.error_feedback_state_dict()}
    first = 1
    restored = None
    if resume:
        sd = state()
        dcp.load(sd, checkpoint_id=path)
        set_model_state_dict(model, sd["model"])
        set_optimizer_state_dict(model, opt, sd["optim"])
        restored = opt.load_error_feedback_state_dict(sd[errors])
        first = opt.counters["step"] + 1
    for t in range(first, 11):
        model(weights(rank, t)).backward()
        opt.step()
        opt.zero_grad()
        if t == 6 and not resume:
            dcp.save(state(), checkpoint_id=path)
    return restored, first, [t.tolist() for t in local_flat(model)]


@pytest.mark.slow
def test_dcp_resume_on_the_same_mesh_is_bitwise_identical(tmp_path):
    path = str(tmp_path / "dcp")
    straight = run_workers(_dcp_save_or_resume, 4, 2, path, False, timeout=120)
    resumed = run_workers(_dcp_save_or_resume, 4, 2, path, True, timeout=120)
    for (_, _, want), (restored, first, got) in zip(straight, resumed):
        assert restored is True and first == 7
        assert got == want


# ----------------------------------------------------------- layouts --
def _refusals(rank, world):
    import onebit
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    messages = {}

    def refused(key, build):
        with pytest.raises(ValueError) as err:
            build()
        messages[key] = str(err.value)

    model = Synthetic()
    fully_shard(model, mesh=mesh["shard"])
    # No process_group: the world, which holds the shard group too.
    refused("world", lambda: make("OnebitAdam", model.parameters()))
    refused("mixed", lambda: make("OnebitAdam", list(model.parameters()) + [
        torch.nn.Parameter(torch.zeros(3))], process_group=mesh.get_group("replicate")))
    opt = make("OnebitAdam", model.parameters(), process_group=mesh.get_group("replicate"))
    refused("added", lambda: opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]}))
    messages["groups after"] = len(opt.param_groups)
    refused("overlap", lambda: make("OnebitAdam", model.parameters(), overlap_backward=True,
                                    process_group=mesh.get_group("replicate")))
    import torch.distributed as dist

    crossed = [dist.new_group([0, 3]), dist.new_group([1, 2])]  # shard 0 with shard 1
    refused("crossed", lambda: make("OnebitAdam", model.parameters(),
                                    process_group=crossed[rank in (1, 2)]))
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    refused("crossed diloco", lambda: onebit.DiLoCo(model, inner, sync_every=2,
                                                    process_group=crossed[rank in (1, 2)]))
    refused("backend", lambda: make("OnebitAdam", model.parameters(),
                                    comm_backend_name="hierarchical",
                                    process_group=mesh.get_group("replicate")))
    # A multi-node launch (2 ranks on each of 2 nodes) defaults to the
    # hierarchical backend; over the replicate group shards get the flat one.
    import os

    from onebit.accelerator import get_accelerator
    os.environ["ONEBIT_RANKS_PER_NODE"] = "2"
    default = get_accelerator().onebit_backend()
    chosen = make("OnebitAdam", model.parameters(),
                  process_group=mesh.get_group("replicate")).comm_backend_name
    messages["defaults"] = f"{default} {chosen}"
    hsdp = Synthetic()
    fully_shard(hsdp, mesh=mesh)  # HSDP: FSDP2 all-reduces across replicas itself
    refused("hsdp", lambda: make("OnebitLamb", hsdp.parameters(),
                                 process_group=mesh.get_group("replicate")))
    other_dim = torch.nn.Linear(4, 6)
    fully_shard(other_dim, mesh=mesh["shard"], shard_placement_fn=lambda p: Shard(p.dim() - 1))
    refused("dim", lambda: make("ZeroOneAdam", other_dim.parameters(),
                                process_group=mesh.get_group("replicate")))
    return messages


def test_unsupported_layouts_are_refused_naming_what_is_supported():
    for messages in run_workers(_refusals, 4, timeout=120):
        assert "mesh.get_group('replicate')" in messages["world"], messages["world"]
        assert "shares 2 ranks" in messages["world"], messages["world"]
        assert "plain tensor among FSDP2-sharded" in messages["mixed"], messages["mixed"]
        assert "added to an optimizer" not in messages["added"]
        assert "plain tensor among" in messages["added"], messages["added"]
        assert "overlap_backward" in messages["overlap"], messages["overlap"]
        assert "'hierarchical'" in messages["backend"] and "'compressed'" in messages["backend"]
        for key in ("crossed", "crossed diloco"):
            assert "disagree on the shard each rank of process_group holds" in messages[key], \
                messages[key]
        assert messages.pop("defaults") == "hierarchical compressed"
        assert "2-D mesh" in messages["hsdp"] and "HSDP" in messages["hsdp"], messages["hsdp"]
        assert "Shard(dim=1)" in messages["dim"] and "Shard(dim=0)" in messages["dim"], \
            messages["dim"]
        assert messages.pop("groups after") == 1  # the refused group was not added
        for m in messages.values():
            assert "probably died" not in m


# -------------------------------------------------------------- DiLoCo --
INNER_LR, H, ROUNDS, OUTER_LR = 0.1, 3, 3, 1.3


def simulate_sharded_diloco(nodes, per_node, compression):
    """DiLoCo on shards in float64: each node takes SGD steps on its ranks'
    mean gradient (FSDP2 averages inside the node); every H steps each
    shard's pseudo-gradients (anchor - params) are averaged over the nodes,
    in 1 bit (or the sparse 2-bit code) through reference.py with errors
    carried between rounds (or exactly), and the anchors take plain SGD at OUTER_LR; every node then
    continues from the anchors. Returns {(s, i): final flat values}."""
    p0 = [p.double().numpy() for p in initial_params()]
    out = {}
    for s in range(per_node):
        rows = [shard_rows(p.shape[0], s, per_node) for p in p0]
        anchor = [p[r].reshape(-1).copy() for p, r in zip(p0, rows)]
        params = [[a.copy() for a in anchor] for _ in range(nodes)]
        _, n, _ = placement([a.size for a in anchor], BLOCK, nodes)
        werrs, serrs = [np.zeros(n) for _ in range(nodes)], [np.zeros(n // nodes)] * nodes
        for t in range(1, H * ROUNDS + 1):
            for node in range(nodes):
                ranks = range(node * per_node, (node + 1) * per_node)
                for i in range(len(p0)):
                    g = np.mean([synthetic_grad(r, t, i).double().numpy()[rows[i]].reshape(-1)
                                 for r in ranks], axis=0)
                    params[node][i] = params[node][i] - INNER_LR * g
            if t % H:
                continue
            deltas = [[a - p for a, p in zip(anchor, params[node])] for node in range(nodes)]
            if compression == "1bit":
                avg, werrs, serrs, _ = reference_round(deltas, werrs, serrs, BLOCK)
            elif compression == "sparse2bit":  # topk 4 of each block of 256
                avg, werrs, serrs, _ = reference_round(deltas, werrs, serrs, BLOCK,
                                                       quantize=sparse)
            else:
                avg = [np.mean([d[i] for d in deltas], axis=0) for i in range(len(p0))]
            anchor = [a - OUTER_LR * g for a, g in zip(anchor, avg)]
            params = [[a.copy() for a in anchor] for _ in range(nodes)]
        for i, a in enumerate(anchor):
            out[(s, i)] = a
    return out


def _sharded_diloco(rank, world, nodes, compression, fragments=1, overlap=0, device="cpu"):
    import onebit

    model, mesh = sharded(world, nodes, device=device)
    inner = torch.optim.SGD(model.parameters(), lr=INNER_LR)
    sparse = {"block_size": BLOCK, "topk": 4} if compression == "sparse2bit" else {}
    diloco = onebit.DiLoCo(model, inner, sync_every=H, outer_lr=OUTER_LR, compression=compression,
                           fragments=fragments, overlap_steps=overlap,
                           process_group=mesh.get_group("replicate"), **sparse)
    rounds = []
    for t in range(1, H * ROUNDS + 1):
        model([w.to(device) for w in weights(rank, t)]).backward()
        inner.step()
        inner.zero_grad()
        rounds.append(diloco.rounds)
    if fragments > 1:
        diloco.sync()  # every fragment on a synced point
    diloco.close()
    assert_replicas_identical(model, mesh.get_group("replicate"), "after the last round")
    return (mesh["shard"].get_local_rank(), [t.double().cpu().numpy() for t in local_flat(model)],
            rounds, len(diloco.anchors[0]) == model.ps[0].to_local().shape[0])


def _diloco_inf_on_one_shard(rank, world, nodes):
    import math

    import onebit

    model, mesh = sharded(world, nodes)
    inner = torch.optim.SGD(model.parameters(), lr=INNER_LR)
    diloco = onebit.DiLoCo(model, inner, sync_every=3, outer_lr=0.7, compression="none",
                           process_group=mesh.get_group("replicate"))
    per_node = world // nodes
    for t in range(1, 7):
        w = weights(rank // per_node, t)
        if t == 2:
            w[0][0, 0] = math.inf  # row 0 of param 0: the first shard's rows only
        model(w).backward()
        inner.step()
        inner.zero_grad()
    diloco.close()
    return diloco.rounds, bool(torch.isfinite(model.ps[0].to_local()).all())


@pytest.mark.parametrize("nodes", [2, 1], ids=["2 x 2 mesh", "1 x 2 mesh"])
def test_diloco_skips_a_round_on_every_shard_when_one_shard_saw_an_inf(nodes):
    """With one replica of shards (a 1 x N mesh) each shard decided alone:
    the shard that saw the inf skipped round 1 and the other took it, half
    a parameter stepped. Every shard now skips it, as on a 2 x N mesh."""
    out = run_workers(_diloco_inf_on_one_shard, 2 * nodes, nodes, timeout=120)
    assert [rounds for rounds, _ in out] == [1] * len(out), out  # round 2 landed, round 1 skipped
    assert all(finite for _, finite in out), out


@pytest.mark.slow
@pytest.mark.parametrize("compression,nodes,device", [
    ("1bit", 2, "cpu"), ("1bit", 3, "cpu"), ("none", 2, "cpu"), ("sparse2bit", 2, "cpu"),
    ("sparse2bit", 3, "cpu"), pytest.param("1bit", 2, "cuda", marks=ON_CUDA)])
def test_diloco_on_shards_matches_the_float64_simulation(compression, nodes, device):
    per_node = 2
    got = ranks_on(device)(_sharded_diloco, nodes * per_node, nodes, compression, 1, 0, device,
                           timeout=180)
    expected = simulate_sharded_diloco(nodes, per_node, compression)
    start = [p.double().numpy() for p in initial_params()]
    for shard, values, rounds, shard_sized in got:
        assert rounds[-1] == ROUNDS and shard_sized  # anchors are the shard's, not the param's
        for i, v in enumerate(values):
            want = expected[(shard, i)]
            rows = shard_rows(SHAPES[i][0], shard, per_node)
            assert want.size == 0 or np.abs(want - start[i][rows].reshape(-1)).max() > 1e-5
            np.testing.assert_allclose(v, want, rtol=1e-4, atol=1e-5 * np.abs(want).max(initial=1),
                                       err_msg=f"param {i}, shard {shard}")


@pytest.mark.slow
def test_streaming_diloco_on_shards_syncs_every_shard_at_the_same_steps():
    """Two fragments, their exchanges one inner step behind, on 3 nodes of 2
    shards: every rank lands the same rounds at the same inner steps (the
    fragments are cut by whole-param sizes), and each shard is identical on
    every replica once the last round is synced."""
    results = run_workers(_sharded_diloco, 6, 3, "1bit", 2, 1, timeout=180)
    assert len({tuple(rounds) for _, _, rounds, _ in results}) == 1
    assert results[0][2][-1] >= 2 * (ROUNDS - 1)
    for _, values, _, _ in results:
        assert all(np.isfinite(v).all() for v in values)


# ---------------------------------------------------------- GradScaler --
def _scaler_with_an_inf_on_one_rank(rank, world, nodes):
    """onebit.amp.GradScaler (the world's agreement) with an inf on rank 0
    at step 5 (compression stage), in a row only shard 0 of node 0 sees:
    every rank skips that step and keeps the same scale."""
    import torch.distributed as dist

    import onebit

    model, mesh = sharded(world, nodes)
    opt = make("OnebitAdam", model.parameters(), process_group=mesh.get_group("replicate"),
               freeze_step=2, lr=1e-2)
    scaler = onebit.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    scales, skipped = [], []
    for t in range(1, 8):
        w = weights(rank, t)
        if t == 5 and rank == 0:
            w[0][0, 0] = math.inf
        before = local_flat(model)
        scaler.scale(model(w)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        skipped.append(all(torch.equal(a, b) for a, b in zip(before, local_flat(model))))
        scales.append(float(scaler.get_scale()))
        assert_replicas_identical(model, mesh.get_group("replicate"), f"after step {t}")
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, scales)
    return skipped, scales, all(s == scales for s in every), opt.comm_stats()["skipped_steps"]


@pytest.mark.slow
def test_grad_scaler_skips_an_inf_seen_by_one_shard_on_every_rank():
    for skipped, scales, agreed, count in run_workers(_scaler_with_an_inf_on_one_rank, 4, 2,
                                                      timeout=120):
        assert skipped == [False] * 4 + [True] + [False] * 2, skipped
        assert agreed and scales[4] == scales[3] / 2, scales
        assert count == 1


# ------------------------------------------- checkpoints on another mesh --
def _dcp_other_mesh(rank, world, nodes, path, two_loads=False):
    """Load the 2x2 checkpoint of _dcp_save_or_resume (step 6) on `nodes`
    nodes of world / nodes: the state comes back resharded, the error
    buffers restart from zero (their entries are for another replica count),
    and it trains on. `two_loads`: docs/checkpoints.md's resume, the error
    buffers in a second load into a dict built on the loaded optimizer
    (with docs/sharding.md's allow_partial_load, it finds no entry there)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict,
                                                         set_model_state_dict,
                                                         set_optimizer_state_dict)

    model, mesh = sharded(world, nodes)
    opt = make("OnebitAdam", model.parameters(), process_group=mesh.get_group("replicate"),
               freeze_step=4, lr=1e-2)
    errors = opt.error_feedback_key()

    def load(sd):
        dcp.load(sd, checkpoint_id=path, planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    if not two_loads:
        sd[errors] = opt.error_feedback_state_dict()
    load(sd)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])
    if two_loads:
        sd[errors] = opt.error_feedback_state_dict()
        load({errors: sd[errors]})
    restored = opt.load_error_feedback_state_dict(sd[errors])
    exp_avg_sq = [st["exp_avg_sq"].full_tensor().tolist()
                  for st in opt.state_dict()["state"].values()]
    step = opt.counters["step"]
    for t in range(step + 1, 11):
        model(weights(rank, t)).backward()
        opt.step()
        opt.zero_grad()
    assert_replicas_identical(model, mesh.get_group("replicate"), "after resuming")
    return restored, step, exp_avg_sq


def _exp_avg_sq_at_6(rank, world, nodes, path):
    """The full exp_avg_sq of every param in the 2x2 checkpoint's run."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model, mesh = sharded(world, nodes)
    opt = make("OnebitAdam", model.parameters(), process_group=mesh.get_group("replicate"),
               freeze_step=4, lr=1e-2)
    for t in range(1, 7):
        model(weights(rank, t)).backward()
        opt.step()
        opt.zero_grad()
    sd = get_optimizer_state_dict(model, opt)
    return [v["exp_avg_sq"].full_tensor().tolist() for v in sd["state"].values()]


# 2x2 -> 3x2 in one load; 2x2 -> 2x1 through the documented two loads (issue
# 70: the second load found no entry, and took the untouched dict for the
# saved buffers: it returned True before 45a3547).
@pytest.mark.slow
@pytest.mark.parametrize("world,nodes,two_loads", [(6, 3, False), (2, 2, True)])
def test_dcp_checkpoint_loads_on_another_replica_count_with_errors_from_zero(
        tmp_path, world, nodes, two_loads):
    path = str(tmp_path / "dcp")
    run_workers(_dcp_save_or_resume, 4, 2, path, False, timeout=120)
    want = run_workers(_exp_avg_sq_at_6, 4, 2, path, timeout=120)[0]
    for restored, step, exp_avg_sq in run_workers(_dcp_other_mesh, world, nodes, path,
                                                  two_loads, timeout=180):
        assert restored is False and step == 6
        # the frozen variance, resharded from 2 shards of 2 nodes onto 2 of 3
        got = [torch.tensor(x) for x in exp_avg_sq]
        assert all(torch.equal(g.reshape(-1), torch.tensor(w).reshape(-1))
                   for g, w in zip(got, want))


def _diloco_dcp(rank, world, nodes, path, resume):
    """Streaming DiLoCo (2 fragments, 1 step behind) on shards: straight, 9
    inner steps, saving after step 4 (fragment 0's exchange in flight);
    resumed, a fresh model (other values) loads with DCP and takes 5 to 9."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    import onebit

    model, mesh = sharded(world, nodes)
    if resume:
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().fill_(3.0)
    inner = torch.optim.SGD(model.parameters(), lr=INNER_LR)
    diloco = onebit.DiLoCo(model, inner, sync_every=H, fragments=2, overlap_steps=1,
                           process_group=mesh.get_group("replicate"))
    errors = diloco.error_feedback_key()  # names the replicate rank and the shard
    assert errors.startswith(f"onebit_diloco_errors.world{nodes}.rank") and ".shard" in errors

    def state():
        return {"model": get_model_state_dict(model), "diloco": diloco.state_dict(),
                errors: diloco.error_feedback_state_dict()}
    first, restored, in_flight = 1, None, None
    if resume:
        sd = state()
        dcp.load(sd, checkpoint_id=path)
        set_model_state_dict(model, sd["model"])
        diloco.load_state_dict(sd["diloco"])
        restored = diloco.load_error_feedback_state_dict(sd[errors])
        first, in_flight = diloco.inner_steps + 1, diloco.exchanges_in_flight
    for t in range(first, 10):
        model(weights(rank, t)).backward()
        inner.step()
        inner.zero_grad()
        if t == 4 and not resume:
            dcp.save(state(), checkpoint_id=path)
    diloco.close()
    return restored, first, in_flight, [t.tolist() for t in local_flat(model)]


@pytest.mark.slow
def test_streaming_diloco_on_shards_resumes_bitwise_with_dcp(tmp_path):
    path = str(tmp_path / "dcp")
    straight = run_workers(_diloco_dcp, 4, 2, path, False, timeout=120)
    resumed = run_workers(_diloco_dcp, 4, 2, path, True, timeout=120)
    for (_, _, _, want), (restored, first, in_flight, got) in zip(straight, resumed):
        assert restored is True and first == 5 and in_flight == 1
        assert got == want


def _state_dict_midway(rank, world, nodes, cls_name, save_after):
    """The same run twice on shards, once with opt.state_dict() taken after
    step `save_after` (a checkpoint, or get_optimizer_state_dict for DCP)."""
    runs = []
    for save in (False, True):
        torch.manual_seed(0)
        model, mesh = sharded(world, nodes)
        opt = make(cls_name, model.parameters(), process_group=mesh.get_group("replicate"),
                   **CONFIGS[cls_name])
        for t in range(1, 17):  # (0/1 Adam: local steps from step 13 on)
            model(weights(rank, t)).backward()
            opt.step()
            opt.zero_grad()
            if save and t == save_after:
                opt.state_dict()
        runs.append([a.tolist() for a in local_flat(model)])
    return runs[0] == runs[1]


@pytest.mark.slow
@pytest.mark.parametrize("cls_name", sorted(CONFIGS))
def test_a_state_dict_taken_midway_changes_nothing_on_shards(cls_name):
    """state_dict() has no side effects: it wrote the placeholders of state
    a later stage makes (0/1 Adam's sync point) into the optimizer's own
    per-param dicts, on shards as DTensors, and 0/1 Adam's next local step
    failed copying into one ('mixed torch.Tensor and DTensor')."""
    assert run_workers(_state_dict_midway, 4, 2, cls_name, 2, timeout=180) == [True] * 4


def test_state_dict_leaves_the_live_state_as_it_was():
    import onebit

    p = [torch.nn.Parameter(torch.ones(4))]
    opt = onebit.ZeroOneAdam(p, var_freeze_step=3)
    p[0].grad = torch.ones(4)
    opt.step()
    before = set(opt.state[p[0]])
    sd = opt.state_dict()
    assert set(opt.state[p[0]]) == before
    assert "sync_point" in sd["state"][0]  # the placeholder is in the saved dict only

