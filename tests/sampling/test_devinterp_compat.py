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

    from gradsketch.slt import OutputPathMismatchError
    from gradsketch.slt import _sample as sample_module

    ours = zarr.open_group(str(tmp_path / "ours"), mode="w")
    ours.attrs[sample_module.SETTINGS_ATTR] = {"lr": 0.1}
    with pytest.raises(
        OutputPathMismatchError,
        match=r"has a different sampler config \(samples made with other settings\):\n"
        r"  lr: stored 0\.1, requested 0\.2",
    ):
        sample_module._check_existing(tmp_path / "ours", {"lr": 0.2}, {})
    theirs = zarr.open_group(str(tmp_path / "theirs"), mode="w")
    theirs.attrs["metadata"] = {"config": {"sampler": {"n_beta": 1.0}}}
    theirs.attrs["completed"] = 1
    with pytest.raises(
        OutputPathMismatchError,
        match=r"holds devinterp samples; the store has a different sampler config:\n"
        r"  n_beta: stored 1\.0, requested 2\.0",
    ):
        sample_module._check_existing(tmp_path / "theirs", {}, {"n_beta": 2.0})
