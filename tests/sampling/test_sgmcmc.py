"""SGMCMC vs a slow float64 reference; exact sketch identities; errors; devinterp parity."""

from __future__ import annotations

import copy
import inspect
import math
import warnings

import pytest
import torch

from gradsketch.sampling import (
    PRECONDITIONERS,
    SGLD,
    SGMCMC,
    AdamPreconditioner,
    IdentityPreconditioner,
    Metrics,
    NoseHooverThermostat,
    Preconditioner,
    PreconditionerCoefs,
    RMSpropPreconditioner,
    register_preconditioner,
)
from gradsketch.sampling import _sgmcmc as sgmcmc_module
from gradsketch.sampling import _workspace as workspace_module
from gradsketch.sketch import CountSketch
from gradsketch.sketch import _countsketch as countsketch_module
from gradsketch.sketch import _native as native_module
from gradsketch.sketch import _reduce as reduce_module

# Each test runs with the native scatter kernels and with torch's scatter.
pytestmark = pytest.mark.usefixtures("scatter_backend")

QUANTITIES = ("scaled_grad", "unscaled_grad", "localization", "weight_decay", "noise")


def small_model(dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).to(
        dtype
    )


def set_grads(model: torch.nn.Module, step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(16, 5, generator=gen, dtype=next(model.parameters()).dtype)
    y = torch.randint(0, 3, (16,), generator=gen)
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()


class Reference:
    """Obviously-correct float64 loop over parameters, straight from the documented update."""

    def __init__(
        self,
        params,
        *,
        lr,
        nbeta,
        noise_level=1.0,
        localization=0.0,
        weight_decay=0.0,
        precond="identity",
        alpha=0.99,
        eps=0.1,
        betas=(0.9, 0.999),
        masks=None,
        box=None,
        diffusion_factor=0.01,
    ):
        self.params = list(params)
        self.lr, self.nbeta, self.sigma = lr, nbeta, noise_level
        self.gamma, self.lam = localization, weight_decay
        self.precond, self.alpha, self.eps, self.betas = precond, alpha, eps, betas
        self.masks = masks
        self.box = box
        self.A = diffusion_factor
        self.w0 = [p.detach().clone() for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]
        self.m = [torch.zeros_like(p) for p in self.params]
        self.t = 0
        self.momentum = None
        self.thermostat = diffusion_factor

    def step(self, gen):
        self.t += 1
        comps = {q: [] for q in (*QUANTITIES, "distance")}
        nh = self.precond == "nht"
        half = self.lr if nh else self.lr / 2
        energy, total = 0.0, 0
        for i, p in enumerate(self.params):
            if p.grad is None:
                for q in comps:
                    comps[q].append(None)
                continue
            g = p.grad.detach().double()
            w = p.detach().double()
            drive = g
            if self.precond in ("rmsprop", "adam"):
                if self.precond == "rmsprop":
                    self.v[i] = self.alpha * self.v[i] + (1 - self.alpha) * g * g
                    v_hat = self.v[i]
                else:
                    b1, b2 = self.betas
                    self.m[i] = b1 * self.m[i] + (1 - b1) * g
                    self.v[i] = b2 * self.v[i] + (1 - b2) * g * g
                    v_hat = self.v[i] / (1 - b2**self.t)
                    drive = self.m[i] / (1 - b1**self.t)
                G = 1.0 / (v_hat.sqrt() + self.eps)
                gc, pc, nc = G, G, G.sqrt()
            else:
                gc = pc = 1.0
                nc = math.sqrt(2 * self.A) if nh else 1.0
            o = self.masks[i].double() if self.masks is not None else 1.0
            if nh and self.momentum is None:
                self.momentum = [None] * len(self.params)
            if nh and self.momentum[i] is None:
                self.momentum[i] = (
                    math.sqrt(self.lr)
                    * torch.normal(0.0, 1.0, size=p.shape, generator=gen, dtype=p.dtype).double()
                )
            xi = torch.normal(0.0, self.sigma, size=p.shape, generator=gen, dtype=p.dtype).double()
            c = {
                "scaled_grad": half * o * gc * self.nbeta * drive,
                "unscaled_grad": half * self.nbeta * g,
                "localization": half * pc * o * self.gamma * (w - self.w0[i]),
                "weight_decay": half * pc * o * self.lam * w,
                "noise": math.sqrt(self.lr) * nc * o * xi,
                "distance": w - self.w0[i],
            }
            for q, value in c.items():
                comps[q].append(value * torch.ones_like(w))
            drift = c["scaled_grad"] + c["localization"] + c["weight_decay"]
            if nh:
                self.momentum[i] = (1 - self.thermostat) * self.momentum[i] - drift + c["noise"]
                new = w + self.momentum[i]
                energy += float((self.momentum[i] ** 2).sum())
            else:
                new = w - drift + c["noise"]
            total += p.numel()
            if self.box is not None:
                new = torch.minimum(
                    torch.maximum(new, self.w0[i] - self.box), self.w0[i] + self.box
                )
            with torch.no_grad():
                p.copy_(new)
        if nh:
            self.thermostat += energy / sum(p.numel() for p in self.params) - self.lr
        return comps

    @staticmethod
    def metrics(comps) -> dict[str, float]:
        def cat(q):
            return torch.cat([c.flatten() for c in comps[q] if c is not None])

        out = {q: float(cat(q).norm()) for q in (*QUANTITIES, "distance")}
        prior = cat("localization") + cat("weight_decay")
        out["dot_grad_prior"] = float(cat("scaled_grad") @ prior)
        out["dot_grad_noise"] = float(cat("scaled_grad") @ cat("noise"))
        out["dot_prior_noise"] = float(prior @ cat("noise"))
        return out


CASES = [
    pytest.param("sgld", dict(localization=3.0, weight_decay=0.1), {}, id="sgld-loc-wd"),
    pytest.param("sgld", dict(localization=0.0), {}, id="sgld-plain"),
    pytest.param(
        "sgld", dict(localization=3.0, bounding_box_size=2e-3), dict(box=2e-3), id="sgld-box"
    ),
    pytest.param(
        "rmsprop_sgld",
        dict(localization=3.0, weight_decay=0.1, alpha=0.9, eps=0.2),
        dict(precond="rmsprop", alpha=0.9, eps=0.2),
        id="rmsprop",
    ),
    pytest.param(
        "adam_sgld",
        dict(localization=3.0, betas=(0.8, 0.99)),
        dict(precond="adam", betas=(0.8, 0.99)),
        id="adam",
    ),
    pytest.param(
        "sgnht", dict(diffusion_factor=0.05), dict(precond="nht", diffusion_factor=0.05), id="sgnht"
    ),
    pytest.param(
        "sgld",
        dict(localization=3.0, weight_decay=0.1, mask="half"),
        dict(masks="half"),
        id="sgld-mask",
    ),
    pytest.param(
        "rmsprop_sgld",
        dict(localization=3.0, mask="half"),
        dict(precond="rmsprop", masks="half"),
        id="rmsprop-mask",
    ),
]


def half_masks(model):
    gen = torch.Generator().manual_seed(7)
    return [torch.rand(p.shape, generator=gen) < 0.5 for p in model.parameters()]


def ref_kwargs_for(method, kwargs):
    out = {k: v for k, v in kwargs.items() if k in ("localization", "weight_decay")}
    return out


@pytest.fixture(
    params=[(reduce_module.REDUCE_TILE, None), (7, None), (reduce_module.REDUCE_TILE, 3)],
    ids=["one-tile", "tiles-of-7", "scatter-split-in-3"],
)
def tile(request, monkeypatch):
    """The Gram/sketch pass at its real tile size and at 7 columns, so that Gram tiles
    and the widened tiles of a narrow table (see the narrow-table test) fall inside
    parameters and between them (the small model has 59 coordinates); and with the
    sketch scatter split into 3 column ranges (19 + 19 + 19 + a tail of 2), which
    the small model is too small to get by default."""
    size, parts = request.param
    monkeypatch.setattr(reduce_module, "REDUCE_TILE", size)
    if parts is not None:
        monkeypatch.setattr(countsketch_module, "split_parts", lambda rows, n: parts)
    return size


def ours_and_reference(method, kwargs, ref_extra, **recording):
    """Our sampler and the reference loop on two copies of the small float64 model."""
    ours_model, ref_model = small_model(), small_model()
    kwargs = dict(kwargs)
    ref_extra = dict(ref_extra)
    if kwargs.get("mask") == "half":
        kwargs["mask"] = half_masks(ours_model)
        ref_extra["masks"] = half_masks(ref_model)
    opt = SGMCMC.get_method(method)(
        ours_model.parameters(), lr=1e-3, nbeta=10.0, **recording, **kwargs
    )
    ref = Reference(
        ref_model.parameters(), lr=1e-3, nbeta=10.0, **ref_kwargs_for(method, kwargs), **ref_extra
    )
    return ours_model, ref_model, opt, ref, ref_extra


@pytest.mark.parametrize(("method", "kwargs", "ref_extra"), CASES)
def test_matches_float64_reference(method, kwargs, ref_extra, tile):
    """Trajectory, metrics and numel equal the reference loop (float64, same noise stream)."""
    ours_model, ref_model, opt, ref, ref_extra = ours_and_reference(
        method, kwargs, ref_extra, save_metrics=True
    )
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    for step in range(6):
        set_grads(ours_model, step)
        set_grads(ref_model, step)
        opt.step(noise_generator=g1)
        comps = ref.step(g2)
        for a, b in zip(ours_model.parameters(), ref_model.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        got, want = opt.get_metrics(dtype=torch.float64), Reference.metrics(comps)
        for name, value in want.items():
            assert float(getattr(got, name)) == pytest.approx(value, rel=1e-10, abs=1e-14), name
        masks = ref_extra.get("masks")
        total = sum(p.numel() for p in ours_model.parameters())
        assert got.numel == (sum(int(m.sum()) for m in masks) if masks else total)
    if method == "sgnht":
        assert opt.thermostats[0] == pytest.approx(ref.thermostat, rel=1e-10)
        assert opt.thermostats[0] != pytest.approx(0.05)  # the thermostat moved


@pytest.mark.parametrize(("method", "kwargs", "ref_extra"), CASES)
def test_unrecorded_step_matches_float64_reference(method, kwargs, ref_extra):
    """Without recording, every preconditioner, mask and the thermostat update in place with
    two reused buffers: the trajectory equals the reference loop's (float64)."""
    ours_model, ref_model, opt, ref, _ = ours_and_reference(method, kwargs, ref_extra)
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    for step in range(6):
        set_grads(ours_model, step)
        set_grads(ref_model, step)
        opt.step(noise_generator=g1)
        ref.step(g2)
        for a, b in zip(ours_model.parameters(), ref_model.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert opt._plans[0].step_scratch is not None  # the buffers were used
    if method == "sgnht":
        assert opt.thermostats[0] == pytest.approx(ref.thermostat, rel=1e-10)


@pytest.mark.parametrize(("method", "kwargs", "ref_extra"), CASES)
def test_sketch_of_each_component_equals_scatter_into(method, kwargs, ref_extra, tile):
    """Exact identity: sketch(component) == CountSketch.scatter_into_ at each parameter's offset.

    Under a mask the sketch runs over the selected coordinates only, in order.
    """
    ours_model, ref_model = small_model(), small_model()
    kwargs, ref_extra = dict(kwargs), dict(ref_extra)
    masks = None
    if kwargs.get("mask") == "half":
        kwargs["mask"] = half_masks(ours_model)
        ref_extra["masks"] = masks = half_masks(ref_model)
    opt = SGMCMC.get_method(method)(
        ours_model.parameters(), lr=1e-3, nbeta=10.0, sketch_dim=8, sketch_seed=3, **kwargs
    )
    ref = Reference(
        ref_model.parameters(), lr=1e-3, nbeta=10.0, **ref_kwargs_for(method, kwargs), **ref_extra
    )
    total = (
        sum(int(m.sum()) for m in masks)
        if masks
        else sum(p.numel() for p in ref_model.parameters())
    )
    cs = CountSketch.create(total, 8, seed=3)
    assert opt.sketch.fingerprint == cs.fingerprint
    assert (opt.get_sketches().fingerprint.mask is not None) == (masks is not None)
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    for step in range(3):
        set_grads(ours_model, step)
        set_grads(ref_model, step)
        opt.step(noise_generator=g1)
        comps = ref.step(g2)
        got = opt.get_sketches()
        for q in QUANTITIES:
            want = torch.zeros(8, dtype=torch.float64)
            offset = 0
            for i, c in enumerate(comps[q]):
                sel = masks[i].flatten() if masks else slice(None)
                part = c.flatten()[sel]
                cs.scatter_into_(want, part, offset)
                offset += part.numel()
            scale = max(float(want.abs().max()), 1e-30)
            # float32 buffer: relative error ~ a few float32 ulps of the largest bucket.
            torch.testing.assert_close(got.as_dict()[q].double(), want, rtol=0, atol=1e-6 * scale)


def test_changed_hyperparameters_between_steps_are_recorded():
    """The coefficient matrix is cached per group; changing lr, nbeta or the prior
    strength between steps (a schedule) must rebuild it: metrics and sketches keep
    matching the float64 reference and scatter_into_ after every change."""
    ours_model, ref_model = small_model(), small_model()
    params = list(ours_model.parameters())
    opt = SGMCMC.sgld(
        params, lr=1e-3, nbeta=10.0, localization=3.0, save_metrics=True, sketch_dim=8
    )
    ref = Reference(ref_model.parameters(), lr=1e-3, nbeta=10.0, localization=3.0)
    cs = CountSketch.create(sum(p.numel() for p in params), 8)
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    schedule = [{}, {"lr": 2e-3}, {"nbeta": 4.0}, {"localization": 0.5, "weight_decay": 0.2}]
    for step, change in enumerate(schedule):
        opt.param_groups[0].update(change)
        for name, value in change.items():
            setattr(ref, {"localization": "gamma", "weight_decay": "lam"}.get(name, name), value)
        set_grads(ours_model, step)
        set_grads(ref_model, step)
        opt.step(noise_generator=g1)
        comps = ref.step(g2)
        got, want = opt.get_metrics(dtype=torch.float64), Reference.metrics(comps)
        for name, value in want.items():
            assert float(getattr(got, name)) == pytest.approx(value, rel=1e-10, abs=1e-14), name
        for q in QUANTITIES:
            exact = torch.zeros(8, dtype=torch.float64)
            cs.scatter_into_(exact, torch.cat([c.flatten() for c in comps[q]]), 0)
            scale = max(float(exact.abs().max()), 1e-30)
            torch.testing.assert_close(
                opt.get_sketches().as_dict()[q].double(), exact, rtol=0, atol=1e-6 * scale
            )


def test_parameter_without_grad_advances_offset_and_buffer_is_zeroed():
    model = small_model()
    params = list(model.parameters())
    opt = SGMCMC.sgld(params, lr=1e-3, nbeta=10.0, localization=1.0, sketch_dim=16)
    cs = CountSketch.create(sum(p.numel() for p in params), 16, seed=0)
    set_grads(model, 0)
    params[0].grad = None  # the first weight has no gradient: later offsets must not shift
    gen = torch.Generator().manual_seed(0)
    before = [p.detach().clone() for p in params]
    opt.step(noise_generator=gen)
    gen2 = torch.Generator().manual_seed(0)
    want = torch.zeros(16, dtype=torch.float64)
    offset = params[0].numel()
    for p in params[1:]:
        xi = torch.normal(0.0, 1.0, size=p.shape, generator=gen2, dtype=p.dtype)
        cs.scatter_into_(want, math.sqrt(1e-3) * xi, offset)
        offset += p.numel()
    torch.testing.assert_close(opt.get_sketches().noise.double(), want, rtol=0, atol=1e-6)
    assert torch.equal(params[0], before[0])
    model.zero_grad(set_to_none=True)
    opt.step(noise_generator=gen)
    assert all(float(v.abs().sum()) == 0.0 for v in opt.get_sketches().as_dict().values())


def test_parameter_groups_share_one_sketch_in_order():
    model = small_model()
    params = list(model.parameters())
    groups = [{"params": params[:2]}, {"params": params[2:], "lr": 2e-3}]
    opt = SGMCMC(groups, lr=1e-3, nbeta=5.0, noise_level=0.0, sketch_dim=8, save_metrics=True)
    set_grads(model, 0)
    grads = [p.grad.clone() for p in params]
    opt.step()
    cs = CountSketch.create(sum(p.numel() for p in params), 8)
    want = torch.zeros(8, dtype=torch.float64)
    offset = 0
    for p, g, lr in zip(params, grads, [1e-3, 1e-3, 2e-3, 2e-3]):
        cs.scatter_into_(want, lr / 2 * 5.0 * g, offset)
        offset += p.numel()
    torch.testing.assert_close(opt.get_sketches().unscaled_grad.double(), want, rtol=0, atol=1e-7)
    exact = math.sqrt(
        sum(
            float(((lr / 2 * 5.0) * g).pow(2).sum())
            for g, lr in zip(grads, [1e-3, 1e-3, 2e-3, 2e-3])
        )
    )
    assert float(opt.get_metrics(dtype=torch.float64).unscaled_grad) == pytest.approx(
        exact, rel=1e-10
    )


def test_get_sketches_is_a_float32_cpu_copy():
    model = small_model(torch.float32)
    opt = SGMCMC.sgld(model.parameters(), lr=1e-3, nbeta=2.0, sketch_dim=4)
    set_grads(model, 0)
    opt.step(noise_generator=torch.Generator().manual_seed(0))
    snap = opt.get_sketches()
    assert snap.noise.dtype == torch.float32 and snap.noise.device.type == "cpu"
    snap.noise.zero_()
    assert float(opt.get_sketches().noise.abs().sum()) > 0


def test_same_noise_generator_seed_same_trajectory():
    runs = []
    for _ in range(2):
        model = small_model(torch.float32)
        opt = SGMCMC.rmsprop_sgld(model.parameters(), lr=1e-3, nbeta=2.0, localization=1.0)
        gen = torch.Generator().manual_seed(5)
        for step in range(3):
            set_grads(model, step)
            opt.step(noise_generator=gen)
        runs.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(runs[0], runs[1])


def test_unrecorded_step_reuses_its_buffers_and_equals_the_recorded_step():
    """The plain identity step draws noise and ``w - c`` into two reused buffers (no fresh
    temporaries per step); its trajectory is bit for bit the recording step's and the
    float64 reference's."""
    models = [small_model(torch.float32) for _ in range(3)]
    kw = dict(lr=1e-3, nbeta=10.0, localization=2.0)
    plain = SGMCMC.sgld(models[0].parameters(), **kw)
    recorded = SGMCMC.sgld(models[1].parameters(), save_metrics=True, sketch_dim=8, **kw)
    ref = Reference(models[2].parameters(), lr=1e-3, nbeta=10.0, localization=2.0)
    gens = [torch.Generator().manual_seed(3) for _ in range(3)]
    buffers = set()
    for step in range(4):
        for model in models:
            set_grads(model, step)
        plain.step(noise_generator=gens[0])
        recorded.step(noise_generator=gens[1])
        ref.step(gens[2])
        scratch = plain._plans[0].step_scratch
        assert scratch is not None and scratch.shape == (2, 7 * 5)  # the largest parameter
        buffers.add(scratch.data_ptr())
        for a, b, c in zip(*(m.parameters() for m in models)):
            assert torch.equal(a, b)
            torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)
    assert len(buffers) == 1


def test_closure_is_evaluated_with_grad_and_returned():
    model = small_model()

    def closure():
        set_grads(model, 0)
        return torch.tensor(1.5)

    opt = SGMCMC.sgld(model.parameters(), lr=1e-3, nbeta=2.0)
    assert float(opt.step(closure)) == 1.5


def test_legacy_sgld_warns_and_equals_factory():
    a, b = small_model(), small_model()
    with pytest.warns(DeprecationWarning, match="use SGMCMC.sgld"):
        legacy = SGLD(a.parameters(), lr=1e-3, nbeta=4.0, localization=2.0, weight_decay=0.1)
    new = SGMCMC.sgld(b.parameters(), lr=1e-3, nbeta=4.0, localization=2.0, weight_decay=0.1)
    for model, opt in ((a, legacy), (b, new)):
        set_grads(model, 0)
        opt.step(noise_generator=torch.Generator().manual_seed(0))
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_state_dict_round_trip_keeps_preconditioner_state():
    model = small_model()
    opt = SGMCMC.rmsprop_sgld(model.parameters(), lr=1e-3, nbeta=2.0)
    set_grads(model, 0)
    opt.step(noise_generator=torch.Generator().manual_seed(0))
    clone_model = copy.deepcopy(model)
    clone = SGMCMC.rmsprop_sgld(clone_model.parameters(), lr=1e-3, nbeta=2.0)
    clone.load_state_dict(copy.deepcopy(opt.state_dict()))  # as if saved to disk
    for model_, opt_ in ((model, opt), (clone_model, clone)):
        set_grads(model_, 1)
        opt_.step(noise_generator=torch.Generator().manual_seed(1))
    for p, q in zip(model.parameters(), clone_model.parameters()):
        assert torch.equal(p, q)


def test_metrics_cosine_and_prior():
    gram = torch.zeros(6, 6, dtype=torch.float64)
    gram[0, 0], gram[4, 4], gram[0, 4] = 4.0, 9.0, 3.0
    gram[2, 2], gram[3, 3] = 9.0, 16.0
    m = Metrics.from_gram(gram, 3)
    assert m.cosine("scaled_grad", "noise") == pytest.approx(0.5)
    assert float(m.prior) == pytest.approx(5.0)
    with pytest.raises(ValueError, match=r"`a`, `b` must be two different names"):
        m.cosine("noise", "noise")


# ----------------------------------------------------------------- errors
def _p():
    return [torch.nn.Parameter(torch.zeros(3))]


ERRORS = [
    pytest.param(lambda: SGMCMC(_p(), lr=-1.0), ValueError, r"`lr` must be a positive", id="lr"),
    pytest.param(
        lambda: SGMCMC(_p(), noise_level=-1.0),
        ValueError,
        r"`noise_level` must be a non-negative",
        id="noise",
    ),
    pytest.param(
        lambda: SGMCMC(_p(), preconditioner="bogus"),
        ValueError,
        r"`preconditioner` must be one of \['adam', 'identity', 'nht', 'rmsprop'\]",
        id="precond",
    ),
    pytest.param(
        lambda: SGMCMC(_p(), preconditioner="rmsprop", preconditioner_kwargs={"beta": 1}),
        ValueError,
        r"`preconditioner_kwargs` .* do not fit",
        id="precond-kwargs",
    ),
    pytest.param(
        lambda: SGMCMC(_p(), mask=[torch.ones(2, dtype=torch.bool)]),
        ValueError,
        r"`mask\[0\]` has shape \(2,\)",
        id="mask-shape",
    ),
    pytest.param(
        lambda: SGMCMC(_p(), mask=[None, None]), ValueError, r"`mask` has 2 entries", id="mask-len"
    ),
    pytest.param(
        lambda: SGMCMC(_p(), mask="all"), ValueError, r"`mask` must be a list", id="mask-type"
    ),
    pytest.param(
        lambda: SGMCMC(_p(), prior="final"), ValueError, r"`prior` must be one of", id="prior-str"
    ),
    pytest.param(
        lambda: SGMCMC(_p(), prior=[torch.zeros(4)]),
        ValueError,
        r"`prior` centres must match",
        id="prior-centres",
    ),
    pytest.param(
        lambda: SGMCMC(_p(), sketch_dim=0),
        ValueError,
        r"`sketch_dim` must be a positive integer",
        id="sketch-dim",
    ),
    pytest.param(
        lambda: SGMCMC(_p(), sketch_seed=1.5), TypeError, r"`sketch_seed` must be an int", id="seed"
    ),
    pytest.param(
        lambda: SGMCMC(_p(), sketch_dim=4, mask=[torch.zeros(3, dtype=torch.bool)]),
        ValueError,
        r"no coordinate is selected",
        id="empty-mask-sketch",
    ),
    pytest.param(
        lambda: SGMCMC.get_method("hmc"),
        ValueError,
        r"`method` must be one of \['sgld', 'rmsprop_sgld', 'adam_sgld', 'sgnht'\]",
        id="method",
    ),
    pytest.param(
        lambda: SGMCMC.rmsprop_sgld(_p(), add_grad_correction=True),
        NotImplementedError,
        r"add_grad_correction",
        id="grad-correction",
    ),
    pytest.param(
        lambda: SGMCMC.rmsprop_sgld(_p(), alpha=1.5), ValueError, r"`alpha` must be in", id="alpha"
    ),
    pytest.param(
        lambda: SGMCMC(_p(), preconditioner="nht", mask=[None]),
        ValueError,
        r"`mask` is not supported with the Nose-Hoover",
        id="nht-mask",
    ),
    pytest.param(
        lambda: SGMCMC(_p()).get_metrics(), RuntimeError, r"Metrics not enabled", id="metrics-off"
    ),
    pytest.param(
        lambda: SGMCMC(_p()).get_sketches(), RuntimeError, r"Sketches not enabled", id="sketch-off"
    ),
    pytest.param(
        lambda: SGMCMC(_p()).sketch, RuntimeError, r"Sketches not enabled", id="sketch-prop"
    ),
]


@pytest.mark.parametrize(("make", "exc", "match"), ERRORS)
def test_errors(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_preconditioner_registry_lists_names():
    """The registry holds exactly the four built-in preconditioners, in order, by class."""
    assert list(PRECONDITIONERS.items()) == [
        ("identity", IdentityPreconditioner),
        ("rmsprop", RMSpropPreconditioner),
        ("adam", AdamPreconditioner),
        ("nht", NoseHooverThermostat),
    ]


def test_registering_a_taken_name_is_refused_and_a_new_one_resolves():
    with pytest.raises(
        ValueError, match=r"name 'adam' is already registered to AdamPreconditioner"
    ):
        register_preconditioner("adam")(IdentityPreconditioner)

    @register_preconditioner("test-half")
    class Half(Preconditioner):
        def coefficients(self, param, grad, state):
            return PreconditionerCoefs(grad_coef=0.5)

    try:
        opt = SGMCMC(_p(), preconditioner="test-half")
        assert isinstance(opt.param_groups[0]["preconditioner"], Half)
    finally:
        del PRECONDITIONERS["test-half"]
    assert list(PRECONDITIONERS) == ["identity", "rmsprop", "adam", "nht"]


#: The factories exactly as users see them (``help``, ``inspect``, positional calls).
_TAIL = (
    "bounding_box_size: 'float | None' = None, "
    "mask: 'MaskLike | Sequence[torch.Tensor | None] | torch.Tensor | None' = None, "
    "save_metrics: 'bool' = False, sketch_dim: 'int | None' = None, sketch_seed: 'int' = 0"
)
_HEAD = (
    "params: 'Iterable[Any]', lr: 'float' = 0.01, noise_level: 'float' = 1.0, "
    "weight_decay: 'float' = 0.0, localization: 'float' = 0.0, nbeta: 'float' = 1.0"
)
FACTORY_SIGNATURES = {
    "sgld": f"({_HEAD}, {_TAIL}) -> 'SGMCMC'",
    "rmsprop_sgld": (
        f"({_HEAD}, alpha: 'float' = 0.99, eps: 'float' = 0.1, "
        f"add_grad_correction: 'bool' = False, {_TAIL}) -> 'SGMCMC'"
    ),
    "adam_sgld": (
        f"({_HEAD}, betas: 'tuple[float, float]' = (0.9, 0.999), eps: 'float' = 0.1, "
        f"{_TAIL}) -> 'SGMCMC'"
    ),
    "sgnht": (
        "(params: 'Iterable[Any]', lr: 'float' = 0.01, diffusion_factor: 'float' = 0.01, "
        "nbeta: 'float' = 1.0, bounding_box_size: 'float | None' = None, "
        "save_metrics: 'bool' = False, sketch_dim: 'int | None' = None, "
        "sketch_seed: 'int' = 0, localization: 'float' = 0.0, "
        "weight_decay: 'float' = 0.0, devinterp_compat: 'bool' = False) -> 'SGMCMC'"
    ),
}
_SGNHT_DOC = sgmcmc_module._SGNHT_DOC
assert _SGNHT_DOC.startswith(
    "SGNHT (Ding et al. 2014), thermostat applied (see :class:`NoseHooverThermostat`).\n\n"
    "        ``devinterp_compat=True`` takes devinterp 2.0.1's ``SGMCMC.sgnht`` step"
)
FACTORY_DOCS = {
    "sgld": (
        "SGLD with localization (Lau et al. 2023): identity preconditioner.\n\n"
        "        ``w <- w - (eps/2)(nbeta grad L + gamma (w - w0) + lambda w) "
        "+ N(0, eps sigma^2)``.\n        "
    ),
    "rmsprop_sgld": "RMSprop-preconditioned SGLD (Li et al. 2016): coefs ``(G, G, sqrt(G), 1)``.",
    "adam_sgld": (
        "Adam-preconditioned SGLD with adaptive drift (see :class:`AdamPreconditioner`)."
    ),
    "sgnht": _SGNHT_DOC,
}


@pytest.mark.parametrize("method", list(FACTORY_SIGNATURES))
def test_factory_signature_and_docstring_are_unchanged(method):
    factory = SGMCMC.get_method(method)
    assert str(inspect.signature(factory)) == FACTORY_SIGNATURES[method]
    assert factory.__doc__ == FACTORY_DOCS[method]
    assert factory.__name__ == method
    assert SGMCMC.METHODS == tuple(FACTORY_SIGNATURES)


def test_legacy_sgld_signature_is_keyword_only_sgld():
    expected = FACTORY_SIGNATURES["sgld"].replace("lr:", "*, lr:").replace(" -> 'SGMCMC'", "")
    assert str(inspect.signature(SGLD)) == expected + " -> 'None'"


@pytest.mark.parametrize("method", list(FACTORY_SIGNATURES))
def test_factories_take_positional_arguments_in_order(method):
    """Positional calls still land on the documented keywords (the order is API)."""
    names = list(inspect.signature(SGMCMC.get_method(method)).parameters)[1:]
    values = {"lr": 0.02, "nbeta": 3.0, "localization": 2.0, "weight_decay": 0.5}
    args = [
        values.get(n, inspect.signature(SGMCMC.get_method(method)).parameters[n].default)
        for n in names
    ]
    group = SGMCMC.get_method(method)(_p(), *args).param_groups[0]
    for name, value in values.items():
        assert group[name] == value, name


def test_a_registered_preconditioner_steps_by_name():
    """A registered preconditioner is usable by name, listed in the error, and steps as
    its coefficients say; a name cannot be registered twice."""

    @register_preconditioner("half_test")
    class Half(Preconditioner):
        def coefficients(self, param, grad, state):
            return PreconditionerCoefs(grad_coef=0.5)

    try:
        assert PRECONDITIONERS["half_test"] is Half
        with pytest.raises(ValueError, match=r"'half_test' is already registered to Half"):
            register_preconditioner("half_test")(IdentityPreconditioner)
        with pytest.raises(ValueError, match=r"must be one of \[.*'half_test'.*\]"):
            SGMCMC(_p(), lr=0.1, preconditioner="no_such")
        # Half the gradient coefficient at nbeta=2 is the identity step at nbeta=1.
        steps = []
        for name, nbeta in (("half_test", 2.0), ("identity", 1.0)):
            w = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64))
            opt = SGMCMC(
                [w], lr=0.1, noise_level=0.0, localization=0.0, nbeta=nbeta, preconditioner=name
            )
            w.grad = torch.tensor([0.3, 0.1, -0.7], dtype=torch.float64)
            opt.step()
            steps.append(w.detach().clone())
        torch.testing.assert_close(steps[0], steps[1], rtol=0, atol=1e-15)
        assert not torch.equal(steps[1], torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64))
    finally:
        del PRECONDITIONERS["half_test"]


# ------------------------------------------------------------ devinterp parity
@pytest.mark.bench
@pytest.mark.parametrize("method", ["sgld", "rmsprop_sgld"])
@pytest.mark.parametrize("noise_level", [0.0, 1.0])
@pytest.mark.parametrize("record", [True, False], ids=["recorded", "unrecorded"])
def test_matches_devinterp_2_0_1(method, noise_level, record):
    """With noise_level=0 (and, since the noise stream is shared, also 1) trajectories and
    metrics match devinterp 2.0.1's SGMCMC to 1e-6, whether or not we record."""
    dev = pytest.importorskip("devinterp.optim")
    a, b = small_model(torch.float32), small_model(torch.float32)
    kw = dict(
        lr=1e-3,
        nbeta=10.0,
        noise_level=noise_level,
        localization=3.0,
        weight_decay=0.1,
        save_metrics=True,
        sketch_dim=16,
    )
    ours_kw = kw if record else {**kw, "save_metrics": False, "sketch_dim": None}
    ours = SGMCMC.get_method(method)(a.parameters(), **ours_kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = dev.SGMCMC.get_method(method)(b.parameters(), **kw)
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    for step in range(20):
        set_grads(a, step)
        set_grads(b, step)
        ours.step(noise_generator=g1)
        theirs.step(noise_generator=g2)
        for p, q in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
        if not record:
            continue
        mo, mt = ours.get_metrics(), theirs.get_metrics()
        for name in Metrics.NORM_FIELDS + Metrics.DOT_FIELDS:
            want = float(getattr(mt, name))
            assert float(getattr(mo, name)) == pytest.approx(want, rel=1e-5, abs=1e-6), name
        assert mo.numel == mt.numel


def test_param_mask_equals_tensor_masks_and_names_the_sketch():
    masked = pytest.importorskip("gradsketch.masked")
    a, b = small_model(), small_model()
    pm = masked.ParamMask.random(a, 0.5, seed=0)
    tensors = [pm[name] for name, _ in b.named_parameters()]
    opt_a = SGMCMC.sgld(
        a.parameters(), lr=1e-3, nbeta=5.0, mask=pm, sketch_dim=8, save_metrics=True
    )
    opt_b = SGMCMC.sgld(b.parameters(), lr=1e-3, nbeta=5.0, mask=tensors, sketch_dim=8)
    for model, opt in ((a, opt_a), (b, opt_b)):
        set_grads(model, 0)
        opt.step(noise_generator=torch.Generator().manual_seed(0))
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    assert opt_a.sketch_fingerprint.mask == pm.fingerprint
    assert opt_a.sketch.input_dim == pm.numel == opt_a.get_metrics().numel
    torch.testing.assert_close(opt_a.get_sketches().noise, opt_b.get_sketches().noise)


@pytest.mark.parametrize("masked", [False, True], ids=["all", "masked"])
def test_narrow_table_sketches_equal_the_int64_table(masked, monkeypatch):
    """Groups above WIDE_TABLE_MAX keep an int16 table widened tile by tile: same sketches."""

    def run():
        model = small_model()
        masks = half_masks(model) if masked else None
        opt = SGMCMC.sgld(model.parameters(), lr=1e-3, nbeta=5.0, mask=masks, sketch_dim=8)
        set_grads(model, 0)
        opt.step(noise_generator=torch.Generator().manual_seed(0))
        return opt.get_sketches()

    monkeypatch.setattr(reduce_module, "REDUCE_TILE", 7)
    wide = run()
    monkeypatch.setattr(workspace_module, "WIDE_TABLE_MAX", 0)
    narrow = run()
    for name in wide.QUANTITIES:
        # Exact: the scatter adds in column order whatever the table's integer width.
        assert torch.equal(getattr(wide, name), getattr(narrow, name)), name


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "refused"])
def test_gradients_read_in_place_equal_the_copied_workspace(layout, monkeypatch):
    """The native pass reading each ``p.grad`` in place == the pass over a copied workspace.

    Same trajectory (bit for bit: the update does not depend on the reduction),
    the same sketches up to float32 summation order and the same metrics. A
    gradient that is not contiguous cannot be read in place: the sampler then
    copies it (and says so through ``_direct_grads``). ``refused``: the kernel
    declines the segments after all, and the sampler assembles them itself.
    """
    if layout == "refused":
        monkeypatch.setattr(native_module, "reduce_rows_", lambda *args, **kwargs: False)
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.Linear(200, 10))
    unused = torch.nn.Parameter(torch.zeros(7))  # no gradient: a zero segment
    models = [copy.deepcopy(base) for _ in range(2)]
    extras = [copy.deepcopy(unused) for _ in range(2)]
    opts = [
        SGMCMC.sgld(
            [*m.parameters(), e],
            lr=1e-4,
            nbeta=30.0,
            localization=10.0,
            save_metrics=True,
            sketch_dim=64,
        )
        for m, e in zip(models, extras)
    ]
    x = torch.randn(16, 300)
    gens = [torch.Generator().manual_seed(2) for _ in range(2)]
    in_place = native_module.available(torch.device("cpu")) and layout != "transposed"
    for _ in range(3):
        results = []
        for i, (m, opt) in enumerate(zip(models, opts)):
            opt.zero_grad()
            m(x).square().mean().backward()
            if layout == "transposed":
                w = m[0].weight
                w.grad = w.grad.t().contiguous().t()  # same values, column-major
            params = opt.param_groups[0]["params"]
            assert SGMCMC._direct_grads(params) == in_place
            with monkeypatch.context() as mp:
                if i == 1:  # the second sampler always copies
                    mp.setattr(SGMCMC, "_direct_grads", staticmethod(lambda params: False))
                opt.step(noise_generator=gens[i])
            results.append((opt.get_metrics(dtype=torch.float64), opt.get_sketches()))
        for a, b in zip(models[0].parameters(), models[1].parameters()):
            assert torch.equal(a, b)
        (m0, s0), (m1, s1) = results
        for q in QUANTITIES:
            torch.testing.assert_close(getattr(s0, q), getattr(s1, q), rtol=1e-5, atol=1e-9)
        for field in ("scaled_grad", "noise", "distance", "dot_grad_noise", "dot_grad_prior"):
            torch.testing.assert_close(
                torch.as_tensor(getattr(m0, field)),
                torch.as_tensor(getattr(m1, field)),
                rtol=1e-5,
                atol=1e-12,
            )
