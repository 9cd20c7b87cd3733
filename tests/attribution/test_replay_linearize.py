"""Metagradients linearized at ``w = a·1`` (``ReplaySettings.linearize_at``)."""

from __future__ import annotations

import math

import pytest
import torch

from gradsketch._settings import SettingsMismatchError
from gradsketch.attribution import ReplaySettings
from helpers.attribution import (
    REPLAY_BATCH,
    REPLAY_N,
    REPLAY_OPTIMIZERS,
    REPLAY_STEPS,
    replay_data,
    replay_mlp,
    trained_replay,
)

N, STEPS, BATCH = REPLAY_N, REPLAY_STEPS, REPLAY_BATCH

#: SGD with momentum and weight decay, Adam with L2, AdamW with a schedule.
OPTIMIZERS = [p for p in REPLAY_OPTIMIZERS if p.id != "sgd-schedule-no-momentum"]
_replay = trained_replay


@pytest.mark.parametrize(("optimizer", "kw"), OPTIMIZERS)
def test_metagradient_at_half_equals_central_difference_around_half(optimizer, kw):
    """∂f/∂w_i at w = ½·1 equals (f(½·1 + h e_i) - f(½·1 - h e_i)) / 2h through all T steps.

    Same derivation as the w = 1 test (``test_replay.py``): truncation
    ``h² |f'''| / 6 < 2e-10`` and rounding ``T ε |f| / h ≈ 2e-10`` at
    ``h = 1e-5``; 1e-8 leaves a factor of 25. The metagradient at ½ must also
    differ from the one at 1 by far more than that (the check is not vacuous).
    """
    r = _replay(optimizer, kw, linearize_at=0.5)
    at_one = _replay(optimizer, kw)
    _check_central_difference(r, torch.full((N,), 0.5, dtype=torch.float64), at_one)


def _check_central_difference(r, base, other):
    """``r``'s metagradients of rows 0 and 11, by both pull-backs, against central
    differences around its run's weights ``base``; they must differ from ``other``'s."""
    x, y = replay_data(N)
    queries = (x[:3], y[:3])
    scores = r.metagradients(queries)  # reverse-over-reverse (a block under JVP_MIN_BLOCK)
    r._jvp_min_block = 1
    by_jvp = r.metagradients(queries)  # forward-over-reverse
    elsewhere = other.metagradients(queries)
    h = 1e-5
    for i in (0, 11):
        plus, minus = base.clone(), base.clone()
        plus[i] += h
        minus[i] -= h
        fd = (r.outputs(queries, r.retrain(plus)) - r.outputs(queries, r.retrain(minus))) / (2 * h)
        torch.testing.assert_close(scores[i], fd, rtol=0, atol=1e-8)
        torch.testing.assert_close(by_jvp[i], fd, rtol=0, atol=1e-8)
        assert fd.abs().max() > 1e-3
        assert (scores[i] - elsewhere[i]).abs().max() > 1e-4


def test_the_run_is_trained_at_its_weights_and_retrain_defaults_to_them():
    """``retrain()`` and ``load_final`` give the run at ``linearize_at`` everywhere, bit for bit."""
    # full_batch: at w = ½·1 the loss is halved, so the run is another one (with kept_mean
    # it is the ordinary run: test_linearize_at_a_number_keeps_the_run).
    r = _replay("adam", {"lr": 0.05}, linearize_at=0.5, subset_loss="full_batch")
    explicit = r.retrain(torch.full((N,), 0.5, dtype=torch.float64))
    own = r.retrain()
    model = r.load_final()
    final = r._require_trained()
    for name, p in model.named_parameters():
        assert torch.equal(own[name], final[name])
        assert torch.equal(explicit[name], final[name])
        assert torch.equal(p.detach(), final[name])
    ordinary = _replay("adam", {"lr": 0.05}, subset_loss="full_batch")._require_trained()
    assert not torch.equal(ordinary["0.weight"], final["0.weight"])


@pytest.mark.parametrize(("optimizer", "kw"), OPTIMIZERS)
def test_linearize_at_one_is_the_ordinary_run(optimizer, kw):
    """``linearize_at=1.0`` changes nothing: the same final weights and scores, bit for bit."""
    x, y = replay_data(N)
    default = _replay(optimizer, kw)
    explicit = _replay(optimizer, kw, linearize_at=1.0)
    assert default.settings.linearize_at == 1.0
    for name, p in default._require_trained().items():
        assert torch.equal(explicit._require_trained()[name], p)
    assert torch.equal(
        explicit.metagradients((x[:3], y[:3])), default.metagradients((x[:3], y[:3]))
    )


def test_the_autograd_fallback_linearizes_at_the_same_point():
    """Reverse-over-reverse at w = ½·1 equals forward-over-reverse within ``T D ε max|s|``."""
    r = _replay("adamw", {"lr": 0.05, "weight_decay": 0.1}, linearize_at=0.5)
    r._jvp_min_block = 1
    x, y = replay_data(N)
    fast = r.metagradients((x[:3], y[:3]))
    assert r._vmap_ok is True
    r._vmap_ok = False
    slow = r.metagradients((x[:3], y[:3]))
    bound = STEPS * 5 * torch.finfo(torch.float64).eps * float(fast.abs().max())
    assert float((fast - slow).abs().max()) <= bound


def test_a_store_written_at_another_point_is_refused(tmp_path):
    x, y = replay_data(N)
    queries = (x[:2], y[:2])
    _replay("sgd", {"lr": 0.2}, save_dir=tmp_path).score(queries, exp_name="q")
    later = _replay("sgd", {"lr": 0.2}, save_dir=tmp_path, linearize_at=0.5)
    with pytest.raises(SettingsMismatchError, match=r"linearize_at: stored 1.0, requested 0.5"):
        later.score(queries, exp_name="q")


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (0.0, r"`linearize_at` must be a finite number > 0.0, got 0.0; pass the fraction"),
        (-0.5, r"`linearize_at` must be a finite number > 0.0, got -0.5"),
        (1.5, r"`linearize_at` must be a finite number in \(0, 1\], got 1.5; pass the fraction"),
        (math.nan, r"`linearize_at` must be a finite number > 0.0, got nan"),
        (math.inf, r"`linearize_at` must be a finite number > 0.0, got inf"),
        (True, r"`linearize_at` must be a finite number > 0.0, got True"),
        ("0.5", r"`linearize_at` must be a finite number > 0.0, got '0.5'"),
    ],
    ids=["zero", "negative", "above-one", "nan", "inf", "bool", "string"],
)
def test_invalid_linearize_at_is_refused(value, match):
    with pytest.raises(ValueError, match=match):
        ReplaySettings(linearize_at=value)


@pytest.mark.parametrize("subset_loss", ["kept_mean", "full_batch"])
@pytest.mark.parametrize(("optimizer", "kw"), OPTIMIZERS)
def test_per_row_weights_give_the_central_difference_at_those_weights(optimizer, kw, subset_loss):
    """Per-row ``linearize_at`` (a random half's 0/1 mask): ∂f/∂w_i there, by both pull-backs.

    The same float64 bound as at ½·1 (truncation and rounding below 4e-10 at
    ``h = 1e-5``). Row 0 is in the mask and row 11 out of it, so the check
    covers a derivative at weight 1 and at weight 0; the values differ from
    those at ``w = ½·1`` by far more than the tolerance.
    """
    mask = torch.zeros(N, dtype=torch.float64)
    mask[torch.randperm(N, generator=torch.Generator().manual_seed(5))[: N // 2]] = 1.0
    mask[0], mask[11] = 1.0, 0.0
    r = _replay(optimizer, kw, linearize_at=mask.tolist(), subset_loss=subset_loss)
    assert all(torch.equal(r.retrain()[n], p) for n, p in r.retrain(mask).items())
    _check_central_difference(
        r, mask, _replay(optimizer, kw, linearize_at=0.5, subset_loss=subset_loss)
    )


def test_per_row_weights_are_recorded_by_fingerprint_and_refused_when_changed(tmp_path):
    x, y = replay_data(N)
    queries = (x[:2], y[:2])
    mask = [1.0 if i % 2 else 0.0 for i in range(N)]
    r = _replay("sgd", {"lr": 0.2}, save_dir=tmp_path, linearize_at=mask)
    assert r.settings.record()["linearize_at"].startswith(f"{N} rows, sha256 ")
    r.score(queries, exp_name="q")
    again = _replay("sgd", {"lr": 0.2}, save_dir=tmp_path, linearize_at=mask)
    assert torch.equal(again.score(queries, exp_name="q"), r.score(queries, exp_name="q"))
    other = _replay("sgd", {"lr": 0.2}, save_dir=tmp_path, linearize_at=mask[::-1])
    with pytest.raises(SettingsMismatchError, match=r"linearize_at: stored .*rows, sha256"):
        other.score(queries, exp_name="q")


@pytest.mark.parametrize(
    ("value", "match", "error"),
    [
        (
            [0.5] * (N - 1),
            rf"gives {N - 1} per-row weights but the training set has {N} rows",
            ValueError,
        ),
        ([0.0] * N, r"weighs every row 0: nothing trains", ValueError),
        (
            [0.5] * (N - 1) + [1.5],
            rf"row {N - 1} is 1.5; per-row weights must be finite and in \[0, 1\]",
            ValueError,
        ),
        ([0.5] * (N - 1) + [math.nan], rf"row {N - 1} is nan", ValueError),
        ([[0.5]] * N, r"non-empty 1-d sequence of numbers, got shape \(\d+, 1\)", ValueError),
        ([], r"non-empty 1-d sequence", ValueError),
    ],
)
def test_invalid_per_row_weights_are_refused(value, match, error):
    with pytest.raises(error, match=match):
        _replay("sgd", {"lr": 0.2}, linearize_at=value)


# -- subset_loss: which retrains the replay's run and metagradients are ---------------------
#: Every optimizer x decay form the replay takes, with ε and schedules.
RUNS = [
    pytest.param("sgd", {"lr": 0.3}, id="sgd"),
    pytest.param("sgd", {"lr": 0.3, "momentum": 0.9}, id="sgd-momentum"),
    pytest.param("sgd", {"lr": 0.3, "momentum": 0.9, "weight_decay": 0.05}, id="sgd-momentum-l2"),
    pytest.param("sgd", {"lr": [0.3 * 0.9**t for t in range(STEPS)]}, id="sgd-schedule"),
    pytest.param("adam", {"lr": 0.05}, id="adam"),
    pytest.param("adam", {"lr": 0.05, "weight_decay": 0.05, "eps": 1e-6}, id="adam-l2-eps"),
    pytest.param("adamw", {"lr": 0.05, "weight_decay": 0.1}, id="adamw-decoupled"),
    pytest.param(
        "adamw",
        {"lr": lambda t: 0.05 * min(1.0, (t + 1) / 3), "weight_decay": 0.1, "eps": 1e-3},
        id="adamw-warmup-eps",
    ),
]


@pytest.mark.parametrize("alpha", [0.3, 1e-4])
@pytest.mark.parametrize(("optimizer", "kw"), RUNS)
def test_linearize_at_a_number_keeps_the_run(optimizer, kw, alpha):
    """With ``subset_loss="kept_mean"`` (the default) ``w = α·1`` trains the model of ``w = 1``.

    Each step's loss is ``Σ α ℓ_i / Σ α``, the batch mean up to rounding, so
    nothing (L2 or decoupled decay, ε, the rate) needs scaling. Float64: each
    step's gradient differs by a few ulps (α·ℓ_i and Σα round), and 10 steps
    of a tanh MLP at these rates amplify that far less than 1e4-fold, so the
    weights agree within 1e-12 (measured: under 1e-14). The metagradients at
    ``α·1`` are those at 1 times ``1 / α`` (the run's outputs do not change
    when every weight is scaled, so their weight-gradients sum to 0).
    """
    x, y = replay_data(N)
    queries = (x[:3], y[:3])
    ordinary = _replay(optimizer, kw)
    low = _replay(optimizer, kw, linearize_at=alpha)
    for name, p in ordinary._require_trained().items():
        torch.testing.assert_close(low._require_trained()[name], p, rtol=0, atol=1e-12)
    at_one = ordinary.metagradients(queries)
    scale = float(at_one.abs().max())
    torch.testing.assert_close(
        low.metagradients(queries) * alpha, at_one, rtol=0, atol=1e-9 * scale
    )
    torch.testing.assert_close(
        at_one.sum(0), torch.zeros(3, dtype=torch.float64), rtol=0, atol=1e-9 * scale
    )


def _torch_retrain(optimizer, kw, mask, subset_loss):
    """The run retrained by a plain torch loop on ``mask``'s rows, in the replay's batch order.

    ``kept_mean``: each batch's loss is the mean over its kept rows (a batch
    with none steps on a zero gradient); ``full_batch``: the left-out rows'
    losses are zeroed and the sum divided by the full batch.
    """
    from gradsketch.attribution import batch_order

    model = replay_mlp()
    x, y = replay_data(N)
    rates = kw["lr"]
    rate = (
        (lambda t: rates(t))
        if callable(rates)
        else (lambda t: rates[t])
        if isinstance(rates, list)
        else (lambda t: rates)
    )
    rest = {k: v for k, v in kw.items() if k != "lr"}
    make = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
    opt = make[optimizer](model.parameters(), lr=rate(0), foreach=False, **rest)
    for t, idx in enumerate(batch_order(N, BATCH, STEPS, seed=0)):
        for group in opt.param_groups:
            group["lr"] = rate(t)
        opt.zero_grad()
        keep = idx[mask[idx] > 0]
        if subset_loss == "full_batch":
            losses = torch.nn.functional.cross_entropy(model(x[idx]), y[idx], reduction="none")
            ((losses * mask[idx]).sum() / len(idx)).backward()
        elif keep.numel():
            torch.nn.functional.cross_entropy(model(x[keep]), y[keep]).backward()
        else:
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
        opt.step()
    return dict(model.named_parameters())


@pytest.mark.parametrize("subset_loss", ["kept_mean", "full_batch"])
@pytest.mark.parametrize(("optimizer", "kw"), RUNS)
def test_the_run_at_a_mask_is_the_torch_retrain_on_its_rows(optimizer, kw, subset_loss):
    """``linearize_at=mask`` trains what a torch loop trains on the kept rows (float64).

    ``kept_mean``: the loss averaged over each batch's kept rows, as torch
    training loops do; ``full_batch``: the replay's rule before the setting.
    The mask leaves out every row of step 1's batch, so one step has no kept
    row. The replay's loss is ``softplus(-margin)``, torch's cross-entropy
    ``-log p_y``: equal up to rounding, and torch's optimizers do each
    element's operations in the replay's order, so 10 steps agree within
    1e-12 (measured: under 1e-14).
    """
    from gradsketch.attribution import batch_order

    mask = torch.ones(N, dtype=torch.float64)
    mask[batch_order(N, BATCH, STEPS, seed=0)[1]] = 0.0
    mask[torch.tensor([0, 5])] = 0.0
    r = _replay(optimizer, kw, linearize_at=mask.tolist(), subset_loss=subset_loss)
    reference = _torch_retrain(optimizer, kw, mask, subset_loss)
    for name, p in r._require_trained().items():
        torch.testing.assert_close(p, reference[name].detach(), rtol=0, atol=1e-12)
    # Retraining the ordinary run at the mask is the same model.
    for name, p in _replay(optimizer, kw, subset_loss=subset_loss).retrain(mask).items():
        torch.testing.assert_close(p, reference[name].detach(), rtol=0, atol=1e-12)
    # The step without kept rows: both pull-backs take full_batch's derivative there.
    x, y = replay_data(N)
    by_graphs = r.metagradients((x[:3], y[:3]))
    r._jvp_min_block = 1
    by_jvp = r.metagradients((x[:3], y[:3]))
    assert torch.isfinite(by_jvp).all()
    bound = STEPS * 5 * torch.finfo(torch.float64).eps * float(by_jvp.abs().max())
    assert float((by_jvp - by_graphs).abs().max()) <= bound


def test_subset_loss_is_recorded_and_checked(tmp_path):
    """``full_batch`` is left out of the record (stores written before the setting match
    it); ``kept_mean`` is recorded, and a store of the other is refused."""
    x, y = replay_data(N)
    queries = (x[:2], y[:2])
    assert "subset_loss" not in ReplaySettings(subset_loss="full_batch").record()
    assert ReplaySettings().record()["subset_loss"] == "kept_mean"
    _replay("sgd", {"lr": 0.2}, save_dir=tmp_path, subset_loss="full_batch").score(
        queries, exp_name="q"
    )
    later = _replay("sgd", {"lr": 0.2}, save_dir=tmp_path)
    with pytest.raises(
        SettingsMismatchError, match=r"subset_loss: stored '<missing>', requested 'kept_mean'"
    ):
        later.score(queries, exp_name="q")


def test_an_unknown_subset_loss_is_refused():
    with pytest.raises(ValueError, match=r"`subset_loss`='mean' is not a loss normalization"):
        ReplaySettings(subset_loss="mean")
