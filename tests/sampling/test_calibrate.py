"""Step-size calibration: the bias diagnostic's exact identity on quadratics, the calibration
loop, the calibrated estimator, and every error path."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from gradsketch.sampling import (
    SGMCMC,
    StepSizeDiagnostic,
    calibrate_step_size,
    calibrated_lr,
    estimate_learning_coeff_calibrated,
    estimate_learning_coeff_with_summary,
)

CURVATURE = 3.0


class Quadratic(torch.nn.Module):
    def __init__(self, dim: int = 4, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(dim, dtype=dtype))


def quadratic_loss(model: Quadratic, batch) -> torch.Tensor:
    return 0.5 * CURVATURE * model.w.square().sum()


def loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.zeros(8, 1)), batch_size=8)


def test_diagnostic_is_exact_on_a_quadratic():
    """L = c |w|^2 / 2: bias = eps nbeta^2 c^2 mean|w|^2 / 8 and LLC = nbeta c mean|w|^2 / 2
    over the same draws (loss and gradient at the same point), so rho = eps nbeta c / 4
    exactly, whatever the chain did."""
    lr, nbeta = 1e-3, 50.0
    diag = StepSizeDiagnostic()
    out = estimate_learning_coeff_with_summary(
        Quadratic(),
        loader(),
        evaluate=quadratic_loss,
        optimizer_kwargs=dict(lr=lr, nbeta=nbeta, localization=1.0),
        num_draws=50,
        num_chains=2,
        init_loss=0.0,
        seed=0,
        callbacks=[diag],
        verbose=False,
    )
    rho = out["llc/step_bias"] / out["llc/mean"]
    assert rho == pytest.approx(lr * nbeta * CURVATURE / 4, rel=1e-9)


def test_diagnostic_before_any_draw_is_nan():
    assert math.isnan(StepSizeDiagnostic().get_results()["llc/step_bias"])


def test_calibration_hits_the_target_on_a_quadratic():
    """rho = eps nbeta c / 4 exactly (see above), so the returned step must satisfy it and lie
    within the loop's factor 1.5 of the target."""
    nbeta, target = 50.0, 0.05
    cal = calibrate_step_size(
        Quadratic(),
        loader(),
        quadratic_loss,
        nbeta=nbeta,
        localization=1.0,
        target_bias=target,
        lr=1e-5,
        pilot_steps=40,
        init_loss=0.0,
    )
    assert cal.converged
    assert cal.predicted_bias == pytest.approx(cal.lr * nbeta * CURVATURE / 4, rel=1e-9)
    assert target / 1.5 <= cal.predicted_bias <= 1.5 * target
    assert len(cal.pilots) >= 2  # 1e-5 is 100x too small: one rescaling at least


def test_calibration_recovers_from_a_diverging_step():
    """float32 and eps nbeta c = 60: |1 - 30| per step overflows within 40 steps."""
    nbeta = 20.0
    cal = calibrate_step_size(
        Quadratic(dtype=torch.float32),
        loader(),
        quadratic_loss,
        nbeta=nbeta,
        lr=1.0,
        pilot_steps=40,
        init_loss=0.0,
    )
    assert cal.pilots[0][0] == 1.0 and cal.pilots[0][1] == float("inf")
    assert cal.converged and cal.lr * nbeta * CURVATURE / 4 == pytest.approx(cal.predicted_bias)


def test_calibrated_estimate_meets_its_bias_target():
    out = estimate_learning_coeff_calibrated(
        Quadratic(),
        loader(),
        quadratic_loss,
        nbeta=50.0,
        target_bias=0.05,
        num_burnin_steps=20,
        num_draws=40,
        init_loss=0.0,
        verbose=False,
    )
    assert out["llc/step_bias_rel"] <= 0.075
    assert out["llc/step_bias_rel"] == pytest.approx(out["llc/lr"] * 50.0 * CURVATURE / 4)
    assert out["llc/runs"] == 1 and out["loss/trace"].shape == (1, 40)


def test_boosted_burnin_sets_the_draw_step_from_the_spread_chain():
    """On the quadratic rho = eps nbeta c / 4 exactly over any draws, so the step the burn-in
    measures is exactly target / (nbeta c / 4), every chain draws at it, the draws' rho is the
    target, and the boosted phase has max(200, ceil(burnin_time / (boost eps0))) steps."""
    nbeta, target = 50.0, 0.05
    out = estimate_learning_coeff_calibrated(
        Quadratic(),
        loader(),
        quadratic_loss,
        nbeta=nbeta,
        target_bias=target,
        burnin_time=0.5,
        burnin_boost=8.0,
        num_burnin_steps=10,
        num_draws=30,
        num_chains=2,
        init_loss=0.0,
        verbose=False,
    )
    assert out["llc/lr"] == pytest.approx(target * 4 / (nbeta * CURVATURE), rel=1e-9)
    assert out["llc/step_bias_rel"] == pytest.approx(target, rel=1e-9)
    assert out["llc/burnin_step_bias_rel"] == pytest.approx(
        out["llc/burnin_lr"] * nbeta * CURVATURE / 4, rel=1e-9
    )
    assert out["llc/burnin_steps"] == max(200, math.ceil(0.5 / out["llc/burnin_lr"]))
    assert out["llc/steps"] == out["llc/burnin_steps"] + 10 + 30
    assert out["loss/trace"].shape == (2, 30) and out["llc/runs"] == 1


def test_without_boosted_burnin_every_step_is_the_pilot_step():
    """burnin_time=0: no boosted phase, the chain runs at the pilot step throughout, so its
    rho is exactly eps0 nbeta c / 4, within the pilots' factor 1.5 of target / 2."""
    nbeta = 50.0
    out = estimate_learning_coeff_calibrated(
        Quadratic(),
        loader(),
        quadratic_loss,
        nbeta=nbeta,
        burnin_time=0.0,
        num_burnin_steps=10,
        num_draws=20,
        init_loss=0.0,
        verbose=False,
    )
    assert out["llc/burnin_steps"] == 0 and math.isnan(out["llc/burnin_lr"])
    assert out["llc/step_bias_rel"] == pytest.approx(out["llc/lr"] * nbeta * CURVATURE / 4)
    assert 0.025 / 1.5 <= out["llc/step_bias_rel"] <= 0.025 * 1.5
    assert out["llc/steps"] == 30


def test_boosted_burnin_halves_a_diverging_boost():
    """float32, pilot step eps0 with eps0 nbeta c = 0.1 (rho = target / 2): a boost of 100
    (eps nbeta c = 10, |1 - 5| per step) and of 50 (|1 - 2.5|) overflow within the burn-in,
    25 (|1 - 1.25|) is stable; the returned burn-in step is 25 eps0."""
    nbeta = 50.0
    out = estimate_learning_coeff_calibrated(
        Quadratic(dtype=torch.float32),
        loader(),
        quadratic_loss,
        nbeta=nbeta,
        burnin_time=10.0,
        burnin_boost=100.0,
        num_burnin_steps=10,
        num_draws=20,
        init_loss=0.0,
        verbose=False,
    )
    eps0 = out["llc/burnin_lr"] / 25.0
    assert 0.05 / 2 / 1.5 <= eps0 * nbeta * CURVATURE / 4 <= 0.05 / 2 * 1.5
    assert out["llc/step_bias_rel"] == pytest.approx(0.05, rel=1e-5)


def test_calibrated_lr_aims_at_half_the_target():
    nbeta = 50.0
    step = calibrated_lr(Quadratic(), loader(), quadratic_loss, nbeta=nbeta, init_loss=0.0)
    assert 0.025 / 1.5 <= step * nbeta * CURVATURE / 4 <= 0.025 * 1.5


def test_calibrated_lr_warns_when_the_pilots_do_not_converge():
    """Six pilots move the step by at most 10x each: from 1e-12 they cannot reach ~3e-4."""
    with pytest.warns(UserWarning, match="step-size pilots did not converge"):
        step = calibrated_lr(
            Quadratic(), loader(), quadratic_loss, nbeta=50.0, lr=1e-12, init_loss=0.0
        )
    assert step == pytest.approx(1e-6)


def test_calibrated_lr_errors():
    with pytest.raises(ValueError, match=r"`target_bias` must be a float in \(0, 1\), got 2.0"):
        calibrated_lr(Quadratic(), loader(), quadratic_loss, nbeta=5.0, target_bias=2.0)


def test_diagnostic_refuses_preconditioned_samplers():
    with pytest.raises(ValueError, match="StepSizeDiagnostic needs identity-preconditioned SGLD"):
        estimate_learning_coeff_with_summary(
            Quadratic(),
            loader(),
            evaluate=quadratic_loss,
            sampling_method=SGMCMC.rmsprop_sgld,
            optimizer_kwargs=dict(lr=1e-3, nbeta=10.0),
            num_draws=2,
            num_chains=1,
            seed=0,
            callbacks=[StepSizeDiagnostic()],
            verbose=False,
        )


def call_calibrate(**kwargs):
    return calibrate_step_size(Quadratic(), loader(), quadratic_loss, nbeta=10.0, **kwargs)


ERRORS = [
    (dict(target_bias=1.5), r"`target_bias` must be a float in \(0, 1\), got 1.5"),
    (dict(target_bias=0), r"`target_bias` must be a float in \(0, 1\), got 0"),
    (dict(pilot_steps=10), "`pilot_steps` must be an int >= 20, got 10"),
    (dict(max_pilots=0), "`max_pilots` must be a positive int, got 0"),
    (dict(lr=-1.0), "`lr` must be a positive float, got -1.0"),
]


@pytest.mark.parametrize(("kwargs", "match"), ERRORS, ids=[m[:14] for _, m in ERRORS])
def test_calibrate_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        call_calibrate(**kwargs)


def test_calibrate_refuses_a_pilot_below_the_initial_loss():
    with pytest.raises(RuntimeError, match=r"estimated LLC=.* <= 0, so the relative bias"):
        call_calibrate(init_loss=1e6, pilot_steps=20)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(max_runs=0), "`max_runs` must be a positive int, got 0"),
        (dict(callbacks=[]), "`callbacks` is set by estimate_learning_coeff_calibrated"),
        (dict(store="x"), "`store` is set by estimate_learning_coeff_calibrated"),
        (dict(num_steps_bw_draws=2), "`num_steps_bw_draws` is set by"),
        (dict(burnin_time=-1.0), "`burnin_time` must be a finite float >= 0, got -1.0"),
        (dict(burnin_boost=0.5), "`burnin_boost` must be a float >= 1, got 0.5"),
        (dict(num_draws=0), "`num_draws`"),
    ],
    ids=["max_runs", "callbacks", "store", "steps_bw", "burnin_time", "boost", "draws"],
)
def test_calibrated_estimate_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        estimate_learning_coeff_calibrated(
            Quadratic(), loader(), quadratic_loss, nbeta=10.0, **kwargs
        )


def test_calibrated_estimate_refuses_chains_over_max_steps():
    with pytest.raises(RuntimeError, match=r"steps per chain, over max_steps=100; raise"):
        estimate_learning_coeff_calibrated(
            Quadratic(), loader(), quadratic_loss, nbeta=50.0, burnin_time=10.0, max_steps=100
        )
