"""devinterp 2.0.1 drop-in: SGNHT under ``devinterp_compat``, Metrics' shapes and methods,
LLC scaling, error texts.

Default tests compare against float64 or hand-derived references; the side-by-side
comparisons with devinterp itself are marked ``bench``.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from gradsketch.sampling import (
    SGMCMC,
    DevinterpSGNHTNoise,
    Metrics,
    NoseHooverThermostat,
    estimate_learning_coeff_with_summary,
)
from gradsketch.sketch import CountSketch, SketchBuffer

FIELDS = (*Metrics.NORM_FIELDS, *Metrics.DOT_FIELDS)


def linear_444(dtype: torch.dtype) -> torch.nn.Module:
    """The issue's 4 -> 4 -> 4 linear model."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)).to(dtype)


def batches(steps: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    return [
        (
            torch.randn(8, 4, generator=gen, dtype=dtype),
            torch.randn(8, 4, generator=gen, dtype=dtype),
        )
        for _ in range(steps)
    ]


def set_mse_grads(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    model.zero_grad()
    x, y = batch
    torch.nn.functional.mse_loss(model(x), y).backward()


def devinterp_sgnht_by_hand(
    model: torch.nn.Module, data: list, *, lr: float, diffusion_factor: float, nbeta: float
) -> None:
    """devinterp 2.0.1's ``SGMCMC.sgnht`` step written out in float64.

    Per parameter, in order, from the global generator: one ``randn_like(p)``
    (the default of devinterp's ``state.get("momentum", ...)``, drawn at every
    step and dropped), then the noise ``xi ~ N(0, 1)``;
    ``w <- w - (eps/2) nbeta grad L + sqrt(eps) c xi`` with ``c = sqrt(2 a)``
    rounded to float32 (devinterp builds it with ``torch.tensor``).
    """
    c = float(torch.tensor(2.0 * diffusion_factor, dtype=torch.float32).sqrt())
    for batch in data:
        set_mse_grads(model, batch)
        with torch.no_grad():
            for p in model.parameters():
                torch.randn_like(p)
                xi = torch.normal(0.0, 1.0, size=p.shape, dtype=p.dtype)
                p.copy_(p - lr / 2 * nbeta * p.grad + math.sqrt(lr) * c * xi)


def run_ours(model: torch.nn.Module, data: list, **kwargs) -> SGMCMC:
    opt = SGMCMC.sgnht(model.parameters(), **kwargs)
    for batch in data:
        set_mse_grads(model, batch)
        opt.step()
    return opt


@pytest.mark.parametrize(("steps", "lr"), [(1, 0.01), (10, 0.1)], ids=["one-step", "ten-steps"])
@pytest.mark.parametrize("diffusion_factor", [0.01, 0.0])
def test_sgnht_devinterp_compat_equals_devinterps_step_by_hand(steps, lr, diffusion_factor):
    """``devinterp_compat=True``: one and ten steps equal devinterp's step written out in
    float64 from the same global-generator noise (``torch.manual_seed(42)`` before the loop,
    as a devinterp script does); ``diffusion_factor=0`` is accepted and injects no noise."""
    data = batches(steps, torch.float64)
    ours, ref = linear_444(torch.float64), linear_444(torch.float64)
    kw = dict(lr=lr, diffusion_factor=diffusion_factor, nbeta=1.0)
    torch.manual_seed(42)
    opt = run_ours(ours, data, **kw, devinterp_compat=True)
    after_ours = torch.rand(3)  # the global stream is left where devinterp leaves it
    torch.manual_seed(42)
    devinterp_sgnht_by_hand(ref, data, **kw)
    after_ref = torch.rand(3)
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    assert torch.equal(after_ours, after_ref)
    assert isinstance(opt.param_groups[0]["preconditioner"], DevinterpSGNHTNoise)
    assert opt.thermostats == []  # devinterp's thermostat never acts


def test_sgnht_default_is_dings_thermostat_step_not_devinterps():
    """The default keeps SGNHT (Ding et al. 2014, see ``SGMCMC.sgnht``): one step by hand is
    ``v = sqrt(eps) N``, ``v <- (1 - a) v - eps grad L + sqrt(2 a eps) xi``, ``w <- w + v``,
    ``a <- a + |v|^2 / n - eps``; devinterp's step is another trajectory."""
    data = batches(1, torch.float64)
    lr, a = 0.01, 0.01
    ours, ref, dev = (linear_444(torch.float64) for _ in range(3))
    opt = SGMCMC.sgnht(ours.parameters(), lr=lr, diffusion_factor=a, nbeta=1.0)
    set_mse_grads(ours, data[0])
    opt.step(noise_generator=torch.Generator().manual_seed(3))
    set_mse_grads(ref, data[0])
    gen = torch.Generator().manual_seed(3)
    energy, n = 0.0, 0
    with torch.no_grad():
        for p in ref.parameters():
            v = math.sqrt(lr) * torch.normal(0.0, 1.0, size=p.shape, generator=gen, dtype=p.dtype)
            xi = torch.normal(0.0, 1.0, size=p.shape, generator=gen, dtype=p.dtype)
            v = (1 - a) * v - lr * p.grad + math.sqrt(2 * a * lr) * xi
            p.add_(v)
            energy += float(v.square().sum())
            n += p.numel()
    for p, q in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)
    assert opt.thermostats[0] == pytest.approx(a + energy / n - lr, rel=1e-12)
    torch.manual_seed(3)
    devinterp_sgnht_by_hand(dev, data, lr=lr, diffusion_factor=a, nbeta=1.0)
    gap = max(
        float((p - q).detach().abs().max()) for p, q in zip(ours.parameters(), dev.parameters())
    )
    assert gap > 1e-3  # a deliberate difference (docs/compatibility.md)


def test_sgnht_zero_diffusion_is_deterministic_thermostat_dynamics():
    """``diffusion_factor=0``: no injected noise; only the initial momentum is random."""
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0], dtype=torch.float64))
    opt = SGMCMC.sgnht([w], lr=0.01, diffusion_factor=0.0, nbeta=2.0)
    assert isinstance(opt.param_groups[0]["preconditioner"], NoseHooverThermostat)
    w.grad = torch.tensor([0.5, 0.25], dtype=torch.float64)
    opt.step(noise_generator=torch.Generator().manual_seed(0))
    v0 = 0.1 * torch.normal(
        0.0, 1.0, size=(2,), generator=torch.Generator().manual_seed(0), dtype=torch.float64
    )
    want = torch.tensor([1.0, -2.0], dtype=torch.float64) + v0 - 0.01 * 2.0 * w.grad
    torch.testing.assert_close(w.detach(), want, rtol=0, atol=1e-15)


@pytest.mark.parametrize("bad", [-0.1, float("nan"), "0.01"])
def test_sgnht_diffusion_factor_errors(bad):
    for compat in (False, True):
        with pytest.raises(ValueError, match=r"`diffusion_factor` must be a non-negative"):
            SGMCMC.sgnht(
                [torch.nn.Parameter(torch.zeros(2))], diffusion_factor=bad, devinterp_compat=compat
            )


# ----------------------------------------------------------------------- Metrics
def test_get_metrics_fields_are_float32_of_shape_1_rounded_once_from_float64():
    """devinterp's shapes and dtypes; each value is the float64 value rounded once."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    opt = SGMCMC.sgld(
        model.parameters(),
        lr=1e-3,
        nbeta=10.0,
        localization=3.0,
        weight_decay=0.1,
        save_metrics=True,
    )
    before = opt.get_metrics()
    assert all(getattr(before, f).shape == (1,) and float(getattr(before, f)) == 0 for f in FIELDS)
    model(torch.randn(4, 5)).square().sum().backward()
    opt.step(noise_generator=torch.Generator().manual_seed(0))
    m, exact = opt.get_metrics(), opt.get_metrics(dtype=torch.float64)
    for f in FIELDS:
        got = getattr(m, f)
        assert got.dtype == torch.float32 and got.shape == (1,) and got.device.type == "cpu", f
        assert torch.equal(got, getattr(exact, f).float()), f
        assert getattr(exact, f).dtype == torch.float64 and getattr(exact, f).shape == (1,)
    stacked = torch.cat([getattr(m, f) for f in FIELDS])  # raised on 0-d fields before
    assert stacked.shape == (len(FIELDS),)
    assert m.numel == sum(p.numel() for p in model.parameters())
    m.zero_()  # a copy: the sampler's record is untouched
    assert float(opt.get_metrics().noise) > 0


def _components(seed: int, n: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f: torch.randn(n, generator=gen, dtype=torch.float64) for f in Metrics.NORM_FIELDS}


def _accumulate(parts: list[dict[str, torch.Tensor]]) -> Metrics:
    m = Metrics()
    m.zero_()
    for c in parts:
        m.add_sum_squared_(*(c[f] for f in Metrics.NORM_FIELDS))
        m.add_dot_products_(c["scaled_grad"], c["localization"] + c["weight_decay"], c["noise"])
        m.numel += c["noise"].numel()
    m.sqrt_norms_()
    return m


def _exact(parts: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Norms and dot products of the concatenated components, in float64."""
    cat = {f: torch.cat([c[f] for c in parts]) for f in Metrics.NORM_FIELDS}
    prior = cat["localization"] + cat["weight_decay"]
    out = {f: float(cat[f].norm()) for f in Metrics.NORM_FIELDS}
    out["dot_grad_prior"] = float(cat["scaled_grad"] @ prior)
    out["dot_grad_noise"] = float(cat["scaled_grad"] @ cat["noise"])
    out["dot_prior_noise"] = float(prior @ cat["noise"])
    return out


def _close_to_float32_of(m: Metrics, exact: dict[str, float]) -> None:
    # float64 sums rounded to float32 at each add (one add per part) and at sqrt:
    # within 4 float32 half-ulps of the exact value.
    for f, want in exact.items():
        got = getattr(m, f)
        assert got.dtype == torch.float32 and got.shape == (1,), f
        assert float(got) == pytest.approx(want, rel=4 * 2.0**-24, abs=1e-30), f


def test_metrics_accumulators_equal_the_float64_norms_of_the_concatenation():
    """zero_ / add_sum_squared_ / add_dot_products_ / sqrt_norms_ over two parameters equal the
    norms and dot products of the concatenated components (float64), rounded to float32."""
    parts = [_components(1, 30), _components(2, 7)]
    m = _accumulate(parts)
    _close_to_float32_of(m, _exact(parts))
    assert m.numel == 37
    m.zero_()
    assert m.numel == 0 and all(float(getattr(m, f)) == 0 for f in FIELDS)


def test_metrics_aggregate_combines_disjoint_groups():
    """aggregate([groups]) == the metrics of all their coordinates together; hand values too."""
    parts = [_components(3, 11), _components(4, 5), _components(5, 9)]
    combined = Metrics.aggregate(_accumulate([p]) for p in parts)
    _close_to_float32_of(combined, _exact(parts))
    assert combined.numel == 25
    a = Metrics.from_gram(torch.eye(6, dtype=torch.float64) * 9.0, numel=2)
    b = Metrics.from_gram(torch.eye(6, dtype=torch.float64) * 16.0, numel=3)
    ab = Metrics.aggregate([a, b])
    assert float(ab.noise) == 5.0 and float(ab.dot_grad_noise) == 0.0 and ab.numel == 5
    empty = Metrics.aggregate([])
    assert empty.numel == 0 and all(getattr(empty, f).shape == (1,) for f in FIELDS)


def test_metrics_of_two_param_groups_equal_the_sum_of_their_groups():
    """Groups are combined as ``Metrics.aggregate`` combines them."""
    torch.manual_seed(0)
    w1 = torch.nn.Parameter(torch.randn(6, dtype=torch.float64))
    w2 = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))
    opt = SGMCMC.sgld(
        [{"params": [w1]}, {"params": [w2], "lr": 1e-2}],
        lr=1e-3,
        nbeta=4.0,
        localization=2.0,
        save_metrics=True,
    )
    w1.grad, w2.grad = torch.ones_like(w1), -torch.ones_like(w2)
    opt.step(noise_generator=torch.Generator().manual_seed(0))
    m = opt.get_metrics(dtype=torch.float64)
    # unscaled_grad = (eps/2) nbeta grad per group: sqrt(6 (5e-4 * 4)^2 + 4 (5e-3 * 4)^2).
    assert float(m.unscaled_grad) == pytest.approx(
        math.sqrt(6 * (5e-4 * 4) ** 2 + 4 * (5e-3 * 4) ** 2), rel=1e-14
    )
    assert m.numel == 10


# ---------------------------------------------------------------- LLC scaling
def test_llc_of_scaled_loss_and_nbeta_is_bit_equal():
    """``llc(2 L, nbeta / 2) == llc(L, nbeta)`` exactly, chains, online trace and mean alike:
    the chain sees ``(nbeta / 2) (2 grad L)``, the same numbers as ``nbeta grad L`` (scaling
    by 2 is exact in binary floating point), and the estimate is ``nbeta (mean L - L0)``
    computed once, in the same order, so the factor 2 cancels exactly (also with
    gradient accumulation, which divides each loss by the step count)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, generator=gen)
    y = x @ torch.randn(3, 2, generator=gen) + 0.1 * torch.randn(64, 2, generator=gen)
    w_star = torch.linalg.lstsq(x, y).solution  # start at the optimum: a sane, positive LLC
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)

    def run(scale: float, nbeta: float, accum: int) -> dict:
        model = torch.nn.Linear(3, 2, bias=False)
        with torch.no_grad():
            model.weight.copy_(w_star.T)

        def evaluate(m, batch):
            return scale * torch.nn.functional.mse_loss(m(batch[0]), batch[1])

        return estimate_learning_coeff_with_summary(
            model,
            loader,
            evaluate=evaluate,
            sampling_method=SGMCMC.sgld,
            optimizer_kwargs=dict(lr=1e-3, nbeta=nbeta, localization=10.0),
            num_chains=2,
            num_draws=12,
            seed=4,
            grad_accum_steps=accum,
            online=True,
            verbose=False,
        )

    for accum in (1, 3):
        a, b = run(1.0, 7.3, accum), run(2.0, 7.3 / 2, accum)
        assert a["llc/mean"] > 0
        for key in ("llc/mean", "llc/std", "llc-chain/0", "llc-chain/1"):
            assert a[key] == b[key], (accum, key)
        assert (a["llc/trace"] == b["llc/trace"]).all()
        assert (2 * a["loss/trace"] == b["loss/trace"]).all()


# ------------------------------------------------------------------ error texts
def test_rmsprop_grad_correction_error_leads_with_devinterps_text():
    w = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(
        NotImplementedError,
        match=r"^Gradient correction not yet implemented for "
        r"RMSprop: `add_grad_correction=True`",
    ):
        SGMCMC.rmsprop_sgld([w], add_grad_correction=True)
    with pytest.raises(NotImplementedError, match=r"Gradient correction not yet implemented"):
        SGMCMC([w], preconditioner="rmsprop", preconditioner_kwargs={"add_grad_correction": 1})
    # devinterp's rmsprop_sgld passes add_grad_correction=False to the preconditioner.
    opt = SGMCMC(
        [w],
        preconditioner="rmsprop",
        preconditioner_kwargs={"alpha": 0.9, "eps": 0.2, "add_grad_correction": False},
    )
    assert (
        repr(opt.param_groups[0]["preconditioner"]) == "RMSpropPreconditioner(alpha=0.9, eps=0.2)"
    )


def test_metrics_not_enabled_error_has_devinterps_text():
    with pytest.raises(RuntimeError, match=r"^Metrics not enabled\. Set save_metrics=True"):
        SGMCMC.sgld([torch.nn.Parameter(torch.zeros(2))], nbeta=2.0).get_metrics()


# ------------------------------------------------------------------ bench: devinterp
def _devinterp():
    return pytest.importorskip("devinterp.optim")


@pytest.mark.bench
@pytest.mark.parametrize(("steps", "lr"), [(1, 0.01), (10, 0.1)], ids=["one-step", "ten-steps"])
@pytest.mark.parametrize("diffusion_factor", [0.01, 0.0])
def test_bench_sgnht_devinterp_compat_follows_devinterp(steps, lr, diffusion_factor):
    """The issue's case side by side: float32 4->4->4 linear model on MSE, global generator
    seeded with 42 before the loop; with the switch, the same trajectory (to float32
    rounding of the differently ordered products) and the same global stream afterwards."""
    dev = _devinterp()
    data = batches(steps, torch.float32)
    ours, theirs = linear_444(torch.float32), linear_444(torch.float32)
    kw = dict(lr=lr, diffusion_factor=diffusion_factor, nbeta=1.0)
    torch.manual_seed(42)
    run_ours(ours, data, **kw, devinterp_compat=True)
    after_ours = torch.rand(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # devinterp warns about nbeta=1
        opt = dev.SGMCMC.sgnht(theirs.parameters(), **kw)
    torch.manual_seed(42)
    for batch in data:
        set_mse_grads(theirs, batch)
        opt.step()
    after_theirs = torch.rand(3)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert torch.equal(after_ours, after_theirs)


@pytest.mark.bench
def test_bench_metrics_shapes_dtypes_and_values_match_devinterp():
    dev = _devinterp()
    a, b = linear_444(torch.float32), linear_444(torch.float32)
    kw = dict(lr=1e-3, nbeta=10.0, localization=3.0, weight_decay=0.1, save_metrics=True)
    ours = SGMCMC.rmsprop_sgld(a.parameters(), **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = dev.SGMCMC.rmsprop_sgld(b.parameters(), **kw)
    for step, batch in enumerate(batches(3, torch.float32)):
        set_mse_grads(a, batch)
        set_mse_grads(b, batch)
        ours.step(noise_generator=torch.Generator().manual_seed(step))
        theirs.step(noise_generator=torch.Generator().manual_seed(step))
        mo, mt = ours.get_metrics(), theirs.get_metrics()
        for f in FIELDS:
            got, want = getattr(mo, f), getattr(mt, f)
            assert (got.dtype, got.shape, got.device) == (want.dtype, want.shape, want.device), f
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
        assert mo.numel == mt.numel
        torch.cat([getattr(mo, f) for f in FIELDS])


@pytest.mark.bench
def test_bench_metrics_methods_match_devinterp():
    from devinterp.optim.metrics import Metrics as DevMetrics

    parts = [
        {f: v.float() for f, v in _components(seed, n).items()} for seed, n in ((1, 30), (2, 7))
    ]
    for cls in (Metrics, DevMetrics):
        assert all(
            callable(getattr(cls, name, None))
            for name in (
                "zero_",
                "add_sum_squared_",
                "add_dot_products_",
                "sqrt_norms_",
                "aggregate",
            )
        )
    results = []
    for cls in (Metrics, DevMetrics):
        groups = []
        for c in parts:
            m = cls()
            m.zero_()
            m.add_sum_squared_(*(c[f] for f in Metrics.NORM_FIELDS))
            m.add_dot_products_(c["scaled_grad"], c["localization"] + c["weight_decay"], c["noise"])
            m.numel += 3
            m.sqrt_norms_()
            groups.append(m)
        results.append((groups[0], cls.aggregate(groups)))
    (ours_one, ours_all), (dev_one, dev_all) = results
    for f in FIELDS:
        for o, d in ((ours_one, dev_one), (ours_all, dev_all)):
            got, want = getattr(o, f), getattr(d, f)
            assert (got.dtype, got.shape) == (want.dtype, want.shape), f
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert ours_all.numel == dev_all.numel == 6


def test_sampler_config_refusal_has_devinterps_phrase(tmp_path):
    """Users grep devinterp's "has a different sampler config"; both refusals say it, with
    every differing field and both values."""
    import zarr

    from gradsketch.slt import OutputPathMismatchError, _schema, _writing

    ours = zarr.open_group(str(tmp_path / "ours"), mode="w")
    ours.attrs[_schema.SETTINGS_ATTR] = {"lr": 0.1}
    with pytest.raises(
        OutputPathMismatchError,
        match=r"has a different sampler config \(samples made with other settings\):\n"
        r"  lr: stored 0\.1, requested 0\.2",
    ):
        _writing.check_existing(tmp_path / "ours", {"lr": 0.2}, {})
    theirs = zarr.open_group(str(tmp_path / "theirs"), mode="w")
    theirs.attrs["metadata"] = {"config": {"sampler": {"n_beta": 1.0}}}
    theirs.attrs["completed"] = 1
    with pytest.raises(
        OutputPathMismatchError,
        match=r"holds devinterp samples; the store has a different sampler config:\n"
        r"  n_beta: stored 1\.0, requested 2\.0",
    ):
        _writing.check_existing(tmp_path / "theirs", {}, {"n_beta": 2.0})


def test_inconsistent_devices_lead_with_devinterps_text():
    """devinterp raises RuntimeError("Inconsistent devices ...") from `SketchBuffer.device` and
    `CountSketch.device`; so do we (the meta device stands in for a second one), and the
    sampler says it for parameters on several devices when it sketches."""
    buf = SketchBuffer.create(4)
    buf.noise = buf.noise.to("meta")
    with pytest.raises(RuntimeError, match=r"^Inconsistent devices across buffers: .*meta"):
        _ = buf.device
    cs = CountSketch.create(10, 4, seed=0)
    cs.hash_signs = cs.hash_signs.to("meta")
    with pytest.raises(
        RuntimeError, match=r"^Inconsistent devices: hash_indices on cpu, hash_signs on meta"
    ):
        _ = cs.device
    with pytest.raises(RuntimeError, match=r"^Inconsistent devices"):
        cs.scatter_into_(torch.zeros(4), torch.ones(3), 0)
    assert cs.to("meta").device == torch.device("meta")  # moving the whole sketch is fine
    a = torch.nn.Parameter(torch.zeros(3))
    b = torch.nn.Parameter(torch.zeros(2, device="meta"))
    with pytest.raises(RuntimeError, match=r"^Inconsistent devices: the parameters are on"):
        SGMCMC.sgld([a, b], lr=0.1, sketch_dim=4)


def test_hash_signs_setter_takes_the_sketchs_own_signs_only():
    """devinterp's `hash_signs` is an attribute; ours has a setter that keeps the map the
    fingerprint names: the same signs (any device) are taken, others refused."""
    cs = CountSketch.create(10, 4, seed=0)
    signs = cs.hash_signs
    cs.hash_signs = signs.clone()
    assert cs.device == torch.device("cpu") and torch.equal(cs.hash_signs, signs)
    v = torch.arange(10.0)
    assert torch.equal(cs.sketch(v), CountSketch.create(10, 4, seed=0).sketch(v))
    with pytest.raises(ValueError, match=r"`hash_signs` differ from this sketch's signs"):
        cs.hash_signs = -signs
    with pytest.raises(ValueError, match=r"must be a tensor of shape \(10,\), got a tensor"):
        cs.hash_signs = torch.ones(3)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param({"rmsprop_eps": 0.1}, r"^rmsprop_eps can only be set", id="eps-not-rmsprop"),
        pytest.param(
            {"rmsprop_alpha": 0.9}, r"^rmsprop_alpha can only be set", id="alpha-not-rmsprop"
        ),
        pytest.param(
            {"sampling_method": "rmsprop_sgld", "rmsprop_eps": 0.1},
            r"^specify only one of rmsprop_eps",
            id="eps-twice",
        ),
        pytest.param(
            {"sampling_method": "rmsprop_sgld", "rmsprop_alpha": 0.9},
            r"^specify only one of rmsprop_alpha",
            id="alpha-twice",
        ),
    ],
)
def test_rmsprop_argument_errors_lead_with_devinterps_text(kwargs, match):
    """devinterp's `sample` refuses rmsprop_eps / rmsprop_alpha for another sampler ("can only
    be set") and given twice ("specify only one"); both come before any model call."""
    from gradsketch.slt import sample

    if kwargs.get("sampling_method") == "rmsprop_sgld":
        short = next(k for k in kwargs if k.startswith("rmsprop_")).removeprefix("rmsprop_")
        kwargs = {**kwargs, "sampling_method_kwargs": {short: 0.5}}
    ids = torch.zeros(4, 8, dtype=torch.long)
    with pytest.raises(ValueError, match=match):
        sample(torch.nn.Linear(2, 2), ids, {}, lr=1e-3, n_beta=1.0, **kwargs)


# -- sketches in devinterp's order of rounding ------------------------------------------
def test_sketch_matches_manual_scatter():
    """devinterp 2.0.1's own test: the optimizer's sketch == manual scatter at the offsets.

    Exact (atol=0, rtol=0): see :func:`test_every_sketch_equals_devinterps_scatter_bit_for_bit`.
    """
    torch.manual_seed(42)
    w1 = torch.nn.Parameter(torch.randn(80, dtype=torch.float64))
    w2 = torch.nn.Parameter(torch.randn(40, dtype=torch.float64))
    w3 = torch.nn.Parameter(torch.randn(80, dtype=torch.float64))
    opt = SGMCMC.sgld([w1, w2, w3], lr=0.5, nbeta=2.0, noise_level=0.0, sketch_dim=64)
    w1.grad = torch.randn_like(w1)
    # w2.grad is intentionally left as None (the default).
    w3.grad = torch.randn_like(w3)
    # scaled_grad = (lr/2) * grad * nbeta = 0.25 * grad * 2.0 = 0.5 * grad
    sg1 = (0.5 * w1.grad).float()
    sg3 = (0.5 * w3.grad).float()
    expected = torch.zeros(64, dtype=torch.float32)
    assert opt._sketch is not None
    opt._sketch.scatter_into_(expected, sg1, offset=0)
    opt._sketch.scatter_into_(expected, sg3, offset=80 + 40)
    opt.step(noise_generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(opt.get_sketches().scaled_grad, expected, atol=0, rtol=0)


def _devinterp_components(
    method: str, params: list, grads: list, states: list, gen: torch.Generator, hyper: dict
) -> dict[str, list[torch.Tensor]]:
    """Each parameter's five components as devinterp 2.0.1 computes them (``_decompose_update``).

    The same float32 operations in the same order: ``grad_coef * grad.mul(nbeta)``, then
    ``_half_lr * (overall * ...)``; priors as ``zeros + localization * (w - w0)`` and
    ``weight_decay * w`` times ``_half_lr * prior_coef * overall``; noise drawn per
    parameter in order, times ``lr ** 0.5 * noise_coef``. ``states`` hold RMSprop's
    square averages (updated here as devinterp updates them).
    """
    lr, nbeta, sigma = hyper["lr"], hyper["nbeta"], hyper["noise_level"]
    gamma, lam = hyper["localization"], hyper["weight_decay"]
    half = 0.5 * lr
    out: dict[str, list[torch.Tensor]] = {q: [] for q in SketchBuffer.QUANTITIES}
    for p, g, state in zip(params, grads, states):
        if method == "rmsprop_sgld":
            state["square_avg"].mul_(hyper["alpha"]).addcmul_(g, g, value=1 - hyper["alpha"])
            pre = 1.0 / (torch.sqrt(state["square_avg"]) + hyper["eps"])
            grad_coef, prior_coef, noise_coef = pre, pre, torch.sqrt(pre)
        else:
            grad_coef, prior_coef, noise_coef = 1.0, 1.0, 1.0
        overall = 1.0
        loc_grad = torch.zeros_like(p)
        loc_grad += gamma * (p - state["initial"])
        wd_grad = torch.zeros_like(p)
        wd_grad += lam * p
        grad_pre = grad_coef * g.mul(nbeta)
        prior_scale = half * prior_coef * overall
        # devinterp draws in torch's default dtype (float32 for float64 weights too);
        # gradsketch draws in the weights' dtype: the same stream for float32 weights.
        noise = overall * torch.normal(
            mean=0.0, std=sigma, size=p.size(), device=p.device, generator=gen, dtype=p.dtype
        )
        out["scaled_grad"].append(half * (overall * grad_pre))
        out["unscaled_grad"].append(half * g.mul(nbeta))
        out["localization"].append(prior_scale * loc_grad)
        out["weight_decay"].append(prior_scale * wd_grad)
        out["noise"].append((lr**0.5) * noise_coef * noise)
    return out


@pytest.mark.parametrize("method", ["sgld", "rmsprop_sgld"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_sketch_equals_devinterps_scatter_bit_for_bit(method, dtype):
    """Each component's float32 sketch equals devinterp's scatter, bit for bit, every step.

    devinterp scatters each parameter's component, converted to float32, with
    ``result.scatter_add_(0, idx, signs * v_flat)`` in parameter order. The
    sampler computes every element with the same float32 (or float64) operations
    in the same order (the scaling folded into its one pass over the rows) and
    adds it, times its sign, into its bucket in the same order; torch's CPU
    ``scatter_add_`` sums each bucket sequentially too. Same operations, same
    order, IEEE rounding: equal on every CPU whatever its vector width (the
    sums are sequential, the products elementwise, no FMA contraction).
    """
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(13, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 3),
    ).to(dtype)
    params = list(model.parameters())
    hyper = dict(lr=3e-3, nbeta=37.0, noise_level=0.7, localization=11.0, weight_decay=0.3)
    extra = dict(alpha=0.9, eps=0.05) if method == "rmsprop_sgld" else {}
    k = 61
    opt = SGMCMC.get_method(method)(params, **hyper, **extra, sketch_dim=k, sketch_seed=5)
    cs = CountSketch.create(sum(p.numel() for p in params), k, seed=5)
    idx_all, signs_all = cs.hash_indices, cs.hash_signs
    states = [{"initial": p.detach().clone(), "square_avg": torch.zeros_like(p)} for p in params]
    gen, mirror = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    x = torch.randn(64, 13, dtype=dtype)
    for _ in range(4):
        model.zero_grad()
        model(x).square().mean().backward()
        before = [p.detach().clone() for p in params]
        grads = [p.grad.detach().clone() for p in params]
        comps = _devinterp_components(method, before, grads, states, mirror, {**hyper, **extra})
        opt.step(noise_generator=gen)
        got = opt.get_sketches()
        for q in SketchBuffer.QUANTITIES:
            want = torch.zeros(k, dtype=torch.float32)
            offset = 0
            for c in comps[q]:
                n = c.numel()
                idx, signs = idx_all[offset : offset + n], signs_all[offset : offset + n]
                want.scatter_add_(0, idx, signs * c.detach().reshape(-1).float())
                offset += n
            torch.testing.assert_close(getattr(got, q), want, atol=0, rtol=0, msg=q)
