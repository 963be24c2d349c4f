"""The optimizers without a process group (world size 1), and their maths."""
import copy
import math

import pytest
import torch

from onebit import OnebitAdam, OnebitLamb, ZeroOneAdam
from onebit.optim import functional as F

OPTIMIZERS = [OnebitAdam, OnebitLamb, ZeroOneAdam]


def model_and_data(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(dtype)
    x, y = torch.randn(64, 6).to(dtype), torch.randint(0, 3, (64,))
    return model, x, y


def train(model, opt, x, y, steps):
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_onebit_adam_warmup_is_torch_adam():
    # Same formula, different rounding order: equal to float32 precision.
    m1, x, y = model_and_data()
    m2 = copy.deepcopy(m1)
    train(m1, OnebitAdam(m1.parameters(), lr=1e-2, freeze_step=1000), x, y, 30)
    train(m2, torch.optim.Adam(m2.parameters(), lr=1e-2), x, y, 30)
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.allclose(a, b, atol=1e-6, rtol=0)


def test_zero_one_adam_with_every_step_a_variance_step_is_torch_adam():
    # var_update_scaler huge: the interval never doubles, so every step is
    # full precision and 0/1 Adam is Adam.
    m1, x, y = model_and_data()
    m2 = copy.deepcopy(m1)
    train(m1, ZeroOneAdam(m1.parameters(), lr=1e-2, var_update_scaler=10**6), x, y, 30)
    train(m2, torch.optim.Adam(m2.parameters(), lr=1e-2), x, y, 30)
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.allclose(a, b, atol=1e-6, rtol=0)


def reference_lamb(params, grads_seq, lr, betas, eps, wd, min_c, max_c):
    """Textbook LAMB with bias correction and clamped trust ratio, per tensor."""
    ps = [p.detach().clone().double() for p in params]
    m = [torch.zeros_like(p) for p in ps]
    v = [torch.zeros_like(p) for p in ps]
    for t, grads in enumerate(grads_seq, 1):
        for i, g in enumerate(grads):
            g = g.double()
            m[i] = betas[0] * m[i] + (1 - betas[0]) * g
            v[i] = betas[1] * v[i] + (1 - betas[1]) * g * g
            u = (m[i] / (1 - betas[0] ** t)) / ((v[i] / (1 - betas[1] ** t)).sqrt() + eps) + wd * ps[i]
            wn, un = ps[i].norm().item(), u.norm().item()
            r = min(max(wn / un, min_c), max_c) if wn > 0 and un > 0 else 1.0
            ps[i] = ps[i] - lr * r * u
    return ps


def test_onebit_lamb_warmup_matches_textbook_lamb():
    torch.manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(5, 4)), torch.nn.Parameter(torch.zeros(3))]
    grads_seq = [[torch.randn(5, 4), torch.randn(3)] for _ in range(12)]
    ref = reference_lamb(params, grads_seq, 1e-2, (0.9, 0.999), 1e-8, 0.01, 0.01, 10.0)
    opt = OnebitLamb(params, lr=1e-2, weight_decay=0.01, freeze_step=100)
    for gs in grads_seq:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()
    for p, r in zip(params, ref):
        assert torch.allclose(p.double(), r, atol=1e-5, rtol=0)


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_compression_stage_runs_at_world_size_one_and_learns(cls):
    def run(freeze):
        model, x, y = model_and_data()
        kw = ({"var_freeze_step": freeze, "local_step_scaler": 3} if cls is ZeroOneAdam
              else {"freeze_step": freeze})
        return train(model, cls(model.parameters(), lr=1e-2, **kw), x, y, 60)

    frozen, never = run(20), run(10**6)
    assert all(math.isfinite(l) for l in frozen)
    assert frozen[-1] < 0.9 * frozen[0]
    assert abs(frozen[-1] - never[-1]) <= 0.05 * never[-1]


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_rejects_bad_hyper_parameters_by_name(cls):
    p = [torch.nn.Parameter(torch.zeros(2))]
    cases = {"lr": -1.0, "eps": -1e-8, "weight_decay": -0.1, "max_grad_norm": -1.0,
             "betas": (0.9, 1.0)}
    for name, bad in cases.items():
        with pytest.raises(ValueError, match=name):
            cls(p, **{name: bad})
    with pytest.raises(ValueError, match="amsgrad"):
        cls(p, amsgrad=True)
    step_name = "var_freeze_step" if cls is ZeroOneAdam else "freeze_step"
    with pytest.raises(ValueError, match=step_name):
        cls(p, **{step_name: -1})


def test_class_specific_checks():
    p = [torch.nn.Parameter(torch.zeros(2))]
    for name in ("var_update_scaler", "local_step_scaler", "local_step_clipper"):
        with pytest.raises(ValueError, match=name):
            ZeroOneAdam(p, **{name: 0})
    for name in ("max_coeff", "min_coeff", "factor_max", "factor_min"):
        with pytest.raises(ValueError, match=name):
            OnebitLamb(p, **{name: 0.0})
    with pytest.raises(ValueError, match="coeff_beta"):
        OnebitLamb(p, coeff_beta=1.5)
    for bad in (1.0, -0.1, math.nan):
        with pytest.raises(ValueError, match="trust_ratio_beta"):
            OnebitLamb(p, trust_ratio_beta=bad)
    OnebitLamb(p, trust_ratio_beta=0.0)  # this step's momentum alone: allowed
    with pytest.raises(ValueError, match=r"trust_ratio must be one of \['fresh', 'frozen'\]"):
        OnebitLamb(p, trust_ratio="DeepSpeed")
    with pytest.raises(ValueError, match="min_coeff"):
        OnebitLamb(p, min_coeff=5.0, max_coeff=1.0)
    for name, bad in (("max_coeff", math.nan), ("factor_max", math.inf), ("min_coeff", math.inf),
                      ("factor_threshold", math.nan), ("coeff_beta", "0.9")):
        with pytest.raises(ValueError, match=name):
            OnebitLamb(p, **{name: bad})


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_rejects_non_finite_values_flags_that_are_not_bools_and_bad_timeouts(cls):
    p = [torch.nn.Parameter(torch.zeros(2))]
    for name, bad in (("lr", math.inf), ("lr", math.nan), ("weight_decay", math.inf),
                      ("eps", math.nan), ("max_grad_norm", math.inf), ("betas", (0.9, math.nan)),
                      ("lr", True), ("lr", "1e-3"), ("lr", torch.tensor(math.inf)),
                      ("lr", torch.tensor([1e-3, 1e-3])),  # (one element of any shape is taken)
                      ("bias_correction", "no"), ("eps_inside_sqrt", 1), ("amsgrad", "False"),
                      ("cuda_aware", None),
                      ("timeout_s", "x"), ("timeout_s", 0), ("timeout_s", -1.0),
                      ("timeout_s", math.inf),
                      # a deadline timedelta cannot hold: refused here, not an
                      # OverflowError at the first collective
                      ("timeout_s", 1e14)):
        with pytest.raises(ValueError, match=name):
            cls(p, **{name: bad})


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_accepts_what_torch_accepts_numpy_floats_and_a_tensor_lr(cls):
    """numpy scalars and a 0-dim tensor lr train exactly like the float."""
    np = pytest.importorskip("numpy")
    torch.manual_seed(0)
    x, y = torch.randn(16, 3), torch.randn(16, 1)
    finals = []
    for lr, wd, beta in ((1e-2, 1e-3, 0.9), (np.float32(1e-2), np.float64(1e-3), np.float32(0.9)),
                         (torch.tensor(1e-2), 1e-3, 0.9)):
        torch.manual_seed(1)
        model = torch.nn.Linear(3, 1)
        opt = cls(model.parameters(), lr=lr, weight_decay=wd, betas=(beta, 0.999))
        for _ in range(5):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        finals.append(torch.cat([q.detach().reshape(-1) for q in model.parameters()]))
    # float32(1e-2) is not 1e-2, so the numpy and tensor runs are close rather than equal.
    for other in finals[1:]:
        assert torch.allclose(finals[0], other, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_edge_cases_empty_params_no_grad_and_groups(cls):
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(3))
    empty, unused = torch.nn.Parameter(torch.zeros(0)), torch.nn.Parameter(torch.randn(2))
    frozen = torch.nn.Parameter(torch.randn(2), requires_grad=False)
    kw = {"var_freeze_step": 3} if cls is ZeroOneAdam else {"freeze_step": 3}
    opt = cls([{"params": [a, empty, frozen], "lr": 1e-2}, {"params": [b, unused], "lr": 1e-1}], **kw)
    a0, b0, u0, f0 = a.detach().clone(), b.detach().clone(), unused.detach().clone(), frozen.detach().clone()
    for _ in range(8):
        a.grad, b.grad, empty.grad = torch.ones(4), torch.ones(3), torch.zeros(0)
        opt.step()
    for t in (a, b, empty, unused):
        assert torch.isfinite(t).all()
    assert torch.equal(frozen, f0) and torch.equal(unused, u0)  # zero grad, no decay: stays
    # A 10x larger lr moves the second group further.
    assert (b0 - b).abs().mean() > 5 * (a0 - a).abs().mean()


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_gradients_of_every_kind_step_as_their_fp32_values(cls):
    """What step() reads as a gradient: one that autograd still holds
    (backward with create_graph) as its value, outside autograd, and a
    missing one as zeros: the same steps as plain gradients. A sparse one
    is refused by name, before anything moves. (fp16 gradients come with
    fp16 params: test_low_precision_params_keep_fp32_state.)"""
    torch.manual_seed(1)
    start = [torch.randn(5), torch.randn(3), torch.randn(4)]
    kw = {"var_freeze_step": 2} if cls is ZeroOneAdam else {"freeze_step": 2}
    odd = [torch.nn.Parameter(t.clone()) for t in start]
    plain = [torch.nn.Parameter(t.clone()) for t in start]
    opts = cls(odd, lr=1e-2, **kw), cls(plain, lr=1e-2, **kw)
    for step in range(5):
        g = [torch.randn(5), torch.randn(3)]
        held = g[1].clone().requires_grad_() * 1.0  # has a grad_fn, as after create_graph
        odd[0].grad, odd[1].grad, odd[2].grad = g[0].clone(), held, None
        plain[0].grad, plain[1].grad, plain[2].grad = g[0].clone(), g[1].clone(), torch.zeros(4)
        for opt in opts:
            opt.step()
        assert odd[1].grad is held and held.grad_fn is not None
        for a, b in zip(odd, plain):
            assert torch.equal(a, b), step
    sparse = torch.nn.Parameter(torch.randn(4))
    sparse.grad = torch.randn(4).to_sparse()
    before = sparse.detach().clone()
    with pytest.raises(ValueError, match="does not support sparse gradients"):
        cls([sparse], lr=1e-2, **kw).step()
    assert torch.equal(sparse, before)


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_a_parameter_listed_twice_is_refused_by_name(cls):
    # torch.optim warns and updates such a parameter twice per step; here it
    # would be exchanged twice too (it diverged, silently).
    w, b = torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(2))
    with pytest.raises(ValueError, match=r"param 2 \(3, 2\) is the same tensor as param 0"):
        cls([w, b, w])
    opt = cls([w])
    with pytest.raises(ValueError, match="same tensor as param 0"):
        opt.add_param_group({"params": [b, b]})
    assert len(opt.param_groups) == 1  # nothing was added
    tied = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    tied[1].weight = tied[0].weight
    assert len(cls(tied.parameters()).param_groups[0]["params"]) == 1  # a tied weight is fine


@pytest.mark.parametrize("cls", OPTIMIZERS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_params_keep_fp32_state(cls, dtype):
    model, x, y = model_and_data(dtype=dtype)
    kw = {"var_freeze_step": 4} if cls is ZeroOneAdam else {"freeze_step": 4}
    opt = cls(model.parameters(), lr=1e-2, **kw)
    losses = train(model, opt, x, y, 20)
    assert losses[-1] < losses[0]
    for p in model.parameters():
        assert p.dtype == dtype
        assert opt.state[p]["exp_avg"].dtype == torch.float32
        assert opt.state[p]["exp_avg_sq"].dtype == torch.float32


def test_adam_step_rounds_each_tensor_by_its_own_dtype():
    """A group that mixes fp32 and bf16 params, stepped whole and one tensor
    at a time (as overlap_backward's buckets step it), gives the same bits,
    and each tensor matches the update written out in float64."""
    from onebit.optim import functional as F

    g = torch.Generator().manual_seed(0)
    dtypes = [torch.float32, torch.bfloat16, torch.float32]
    params = [torch.randn(7, generator=g).to(d) for d in dtypes]
    m = [torch.randn(7, generator=g) for _ in dtypes]
    denom = [torch.rand(7, generator=g) + 0.5 for _ in dtypes]
    lr, wd, bc1 = 0.1, 0.01, 0.5
    whole = [p.clone() for p in params]
    F.adam_step_(whole, m, denom, lr, wd, bc1)
    for p, mi, di, w in zip(params, m, denom, whole):
        one = p.clone()
        F.adam_step_([one], [mi], [di], lr, wd, bc1)
        assert torch.equal(one, w)
        exact = p.double() - lr * ((mi.double() / bc1) / di.double() + wd * p.double())
        tol = 1e-6 if p.dtype == torch.float32 else 1e-2
        assert torch.allclose(w.double(), exact.to(p.dtype).double(), rtol=tol, atol=tol)


def test_nan_gradient_raises_and_changes_nothing():
    model, x, y = model_and_data()
    opt = OnebitAdam(model.parameters(), freeze_step=2)
    train(model, opt, x, y, 3)
    before = copy.deepcopy(opt.state_dict())
    params = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    next(model.parameters()).grad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf gradient"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    assert opt.state_dict()["param_groups"][0]["onebit"] == before["param_groups"][0]["onebit"]


def test_lamb_frozen_factor_clamps():
    assert F.lamb_frozen_factor(2.0, 1, 1, 0.0, 1.0, 0.5, 4.0, 0.1) == pytest.approx(1.1)
    assert F.lamb_frozen_factor(2.0, 1, 1, 0.0, 2.0, 0.5, 4.0, 0.1) == pytest.approx(2.0)
    assert F.lamb_frozen_factor(20.0, 1, 1, 0.0, 3.9, 0.5, 4.0, 0.5) == pytest.approx(4.0)
    assert F.lamb_frozen_factor(0.2, 1, 1, 0.0, 0.5, 0.5, 4.0, 0.9) == pytest.approx(0.5)
    # the weight-decay share of the update pulls the factor toward 1
    assert F.lamb_frozen_factor(3.0, 1, 2, 0.01, 2.0, 0.5, 4.0, 0.5) == pytest.approx(2.0)


def test_max_ratios_matches_per_tensor_max():
    a = [torch.tensor([2.0, -1.0]), torch.zeros(0), torch.tensor([[1.0, 6.0], [3.0, 0.5]])]
    b = [torch.tensor([1.0, 1.0]), torch.zeros(0), torch.tensor([[1.0, 2.0], [1.0, 1.0]])]
    assert F.max_ratios_(a, b) == [2.0, 1.0, 3.0]


def test_grad_scaler_skips_inf_step_and_leaves_state_untouched():
    model, x, y = model_and_data()
    opt = OnebitAdam(model.parameters(), lr=1e-2, freeze_step=2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    for i in range(5):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        if i == 3:
            next(model.parameters()).grad[0, 0] = float("inf")
            state = copy.deepcopy(opt.state_dict())
            params = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        if i == 3:
            assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
            after = opt.state_dict()
            assert after["param_groups"][0]["onebit"] == state["param_groups"][0]["onebit"]
            for k in state["state"]:
                if k != "onebit":
                    for name, t in state["state"][k].items():
                        got = after["state"][k][name]
                        assert torch.equal(t, got) if torch.is_tensor(t) else t == got
    assert opt.counters["step"] == 4  # 5 calls, one skipped


@pytest.mark.parametrize("variable", ["WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE",
                                      "PMIX_SIZE"])
@pytest.mark.parametrize("name", ["OnebitAdam", "OnebitLamb", "ZeroOneAdam", "DiLoCo"])
def test_a_job_launched_with_ranks_but_no_process_group_is_refused(name, variable, monkeypatch):
    """2 ranks said by a launcher (torchrun's WORLD_SIZE, or Open MPI's,
    MPICH's or PMIx's size under mpirun), no process group: each rank would
    train its own model and exit 0. A ValueError naming the fix, as DDP
    raises; the documented variable runs one process alone anyway."""
    import torch.distributed as dist

    import onebit

    assert not dist.is_initialized()
    for other in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"):
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(variable, "2")
    monkeypatch.delenv("ONEBIT_ALLOW_NO_PROCESS_GROUP", raising=False)

    def build():
        model = torch.nn.Linear(3, 2)
        if name == "DiLoCo":
            return onebit.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=4)
        return getattr(onebit, name)(model.parameters())

    with pytest.raises(ValueError) as err:
        build()
    message = str(err.value)
    assert f"{variable}=2" in message and "init_process_group" in message, message
    assert "onebit.launch.init_distributed()" in message, message
    assert "ONEBIT_ALLOW_NO_PROCESS_GROUP=1" in message, message
    monkeypatch.setenv("ONEBIT_ALLOW_NO_PROCESS_GROUP", "1")
    built = build()
    assert built.world_size == 1
    monkeypatch.setenv(variable, "1")
    monkeypatch.delenv("ONEBIT_ALLOW_NO_PROCESS_GROUP")
    assert build().world_size == 1


def test_communication_options_are_keyword_only_and_documented_once():
    """Issue 45: the options after `*`, the same in every optimizer, and the
    shared fragment in each docstring; a positional call past them is a
    TypeError, never a value landing in another parameter."""
    import inspect

    import onebit
    from onebit.optim.options import COMM_OPTIONS_DOC, CommOptions

    names = [f for f in CommOptions.__dataclass_fields__]
    for cls in (onebit.OnebitAdam, onebit.OnebitLamb, onebit.ZeroOneAdam):
        params = inspect.signature(cls).parameters
        keyword_only = [n for n, p in params.items() if p.kind is p.KEYWORD_ONLY]
        assert sorted(keyword_only) == sorted(names), cls.__name__
        assert all(params[n].default == CommOptions.__dataclass_fields__[n].default
                   for n in names), cls.__name__
        assert COMM_OPTIONS_DOC.strip() in cls.__doc__
    p = [torch.nn.Parameter(torch.zeros(3))]
    positional = [1e-3, 10, True, (0.9, 0.999), 1e-8, False, 0.0, 0.0]
    with pytest.raises(TypeError):
        onebit.OnebitAdam(p, *positional, False, True)  # amsgrad, then cuda_aware
    with pytest.raises(TypeError):
        onebit.DiLoCo(p, torch.optim.SGD(p, lr=0.1), 4, 1.0, 0.0, False, "1bit", 0, 1, 0, None)
    assert onebit.OnebitAdam(p, *positional, False, block_size=64).block_size == 64


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_clipping_gradients_whose_norm_overflows_fp32_scales_them_instead_of_zeroing_them(cls):
    """Two finite gradients of 1.5e19: each tensor's norm is finite (so no
    check refuses them), their total is beyond fp32. Clipped to norm 1 by
    the float64 total, each becomes +-1/sqrt(2), and the first momentum is
    (1 - beta1) times that (a coefficient of 0 gave a momentum of 0)."""
    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    freeze = {"var_freeze_step": 10} if cls is ZeroOneAdam else {"freeze_step": 10}
    opt = cls([a, b], lr=1e-3, max_grad_norm=1.0, **freeze)
    a.grad, b.grad = torch.tensor([1.5e19]), torch.tensor([-1.5e19])
    opt.step()
    coef = 1.0 / (math.sqrt(2) * 1.5e19 + 1e-6)
    want = (1 - 0.9) * float(torch.tensor([1.5e19]) * coef)
    assert opt.state[a]["exp_avg"].item() == pytest.approx(want, rel=1e-6)
    assert opt.state[b]["exp_avg"].item() == pytest.approx(-want, rel=1e-6)
    assert torch.isfinite(a).all() and torch.isfinite(b).all() and a.item() != 0.0


def _freeze_after(grads_at_freeze, var_freeze_step=3):
    """A ZeroOneAdam whose variance saw `grads_at_freeze` (one tensor) at
    every step up to var_freeze_step; the warnings of the steps through the freeze."""
    import warnings

    p = torch.nn.Parameter(torch.zeros(grads_at_freeze.numel()))
    opt = ZeroOneAdam([p], lr=1e-3, var_freeze_step=var_freeze_step)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(var_freeze_step + 2):
            p.grad = grads_at_freeze.clone()
            opt.step()
    return [str(w.message) for w in caught if "var_freeze_step" in str(w.message)]


def test_zero_one_adam_warns_when_the_variance_freezes_before_it_settled():
    """A variance frozen while some coordinates' gradients are still near
    zero gives them steps far past the lr once their gradients grow (on
    GPT-2: attention's query and key weights, a divergence). 1% of the
    coordinates at 1e-6 of the others' gradient (v 1e-12 of theirs) at the
    freeze warn, once; 0.05% does not (the limit is 0.1%, freeze_check.py)."""
    g = torch.ones(2000)
    g[:20] = 1e-6  # 20 of 2000 coordinates: 1%
    said = _freeze_after(g)
    assert len(said) == 1, said
    assert "after step 3 (var_freeze_step=3)" in said[0] and "1.00%" in said[0], said[0]
    g = torch.ones(2000)
    g[:1] = 1e-6  # 1 of 2000: 0.05%
    assert _freeze_after(g) == []
    assert _freeze_after(torch.linspace(0.5, 2.0, 2000)) == []  # a settled variance
