"""LLC estimation: ground truth, parallel chains, recording, plots, CLI and errors."""

from __future__ import annotations

import functools
import inspect
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from gradsketch.cli import llc_command
from gradsketch.sampling import (
    SGMCMC,
    LLCRecordSettings,
    SettingsMismatchError,
    default_nbeta,
    estimate_learning_coeff,
    estimate_learning_coeff_with_summary,
    open_draw_store,
    plot_trace,
)

# Each test runs with the native scatter kernels and with torch's scatter.
pytestmark = pytest.mark.usefixtures("scatter_backend")


class Potential(torch.nn.Module):
    """Weights w (initially w*) whose 'loss' is a fixed potential, independent of the batch."""

    def __init__(self, dim: int, powers: list[int] | None = None) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(dim, dtype=torch.float64))
        self.powers = powers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def quadratic_loss(model: Potential, batch):
    return 0.5 * (model.w**2).sum(), {"unused": True}  # tuple: the loss comes first


def crossing_loss(model: Potential, batch):
    out = torch.ones((), dtype=torch.float64)
    for wi, k in zip(model.w, model.powers):
        out = out * wi ** (2 * k)
    return out


def dummy_loader(batch_size: int = 8) -> DataLoader:
    return DataLoader(TensorDataset(torch.zeros(64, 1)), batch_size=batch_size)


@functools.lru_cache(maxsize=1)
def digits_setup(n: int = 256):
    torch.manual_seed(0)
    x = torch.randn(n, 8)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(100):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
    return model, loader


KW = dict(lr=1e-4, localization=100.0, nbeta=10.0)


def quadratic_estimate(dim: int, chains: int, draws: int):
    """SGLD on U(w) = c |w|^2 / 2 with c = nbeta is the AR(1) chain
    w' = (1 - eps c / 2) w + sqrt(eps) xi, whose stationary variance per coordinate is
    1 / (c (1 - eps c / 4)). So E[nbeta L] = (d / 2) / (1 - eps c / 4): the ground truth
    d / 2 times a known discretization factor."""
    nbeta, lr = 100.0, 1e-3
    out = estimate_learning_coeff_with_summary(
        Potential(dim),
        dummy_loader(),
        evaluate=quadratic_loss,
        optimizer_kwargs=dict(lr=lr, nbeta=nbeta),
        num_draws=draws,
        num_chains=chains,
        num_burnin_steps=200,
        seed=0,
        verbose=False,
    )
    factor = 1.0 / (1.0 - lr * nbeta / 4.0)
    return out, factor


def check_against(out, truth: float, bias: float) -> None:
    """|estimate - truth| <= 5 SE + |known bias|, SE = sd(draws of nbeta (L - L0)) / sqrt(ESS)
    with the ArviZ effective sample size of all chains (the chain spread, autocorrelation
    included); a 5 SE deviation has probability < 1e-6 under the CLT."""
    llc_trace = out["nbeta"] * (out["loss/trace"] - out["init_loss"])
    se = float(llc_trace.std()) / math.sqrt(out["llc/ess"])
    assert abs(out["llc/mean"] - truth) <= 5 * se + abs(bias), (out["llc/mean"], truth, se, bias)


def test_quadratic_potential_gives_half_the_dimension():
    out, factor = quadratic_estimate(dim=3, chains=4, draws=1000)
    check_against(out, 1.5 * factor, 0.0)  # the exact stationary value
    check_against(out, 1.5, 1.5 * (factor - 1.0))  # the ground truth d/2
    assert np.isfinite(out["llc/rhat"]) and abs(out["llc/rhat"] - 1.0) < 0.05


@pytest.mark.slow
@pytest.mark.parametrize("dim", [1, 10])
def test_quadratic_potential_gives_half_the_dimension_slow(dim):
    out, factor = quadratic_estimate(dim=dim, chains=8, draws=5000)
    check_against(out, dim / 2 * factor, 0.0)
    check_against(out, dim / 2, dim / 2 * (factor - 1.0))


def crossing_expectation(powers, nbeta, gamma, grid=4001, radius=None):
    """E[nbeta K] under exp(-nbeta K - gamma |w|^2 / 2) by quadrature on a 2-D grid."""
    radius = radius or 8.0 / math.sqrt(gamma)
    axis = np.linspace(-radius, radius, grid)
    w1, w2 = np.meshgrid(axis, axis, indexing="ij")
    k = w1 ** (2 * powers[0]) * w2 ** (2 * powers[1])
    log_p = -nbeta * k - gamma * (w1**2 + w2**2) / 2
    p = np.exp(log_p - log_p.max())
    return float((nbeta * k * p).sum() / p.sum())


@pytest.mark.slow
@pytest.mark.parametrize(("powers", "lam"), [([1, 2], 0.25), ([1, 1], 0.5)])
def test_normal_crossing(powers, lam):
    """K(w) = w1^(2 k1) w2^(2 k2) at w* = 0 has lambda = 1 / (2 max k).

    At finite nbeta and localization gamma the sampled quantity is
    E[nbeta K] under exp(-nbeta K - gamma |w|^2 / 2), computed here by quadrature;
    its distance to lambda is the (deterministic, stated) finite-temperature bias.
    The SGLD estimate must match the quadrature value within 5 SE (+5% for the
    O(eps) discretization bias, eps nbeta |Hess K| <= 0.05 in the sampled region), and
    lambda within that plus the finite-temperature gap."""
    nbeta, gamma, lr = 1e4, 1.0, 2e-4
    model = Potential(2, powers)
    out = estimate_learning_coeff_with_summary(
        model,
        dummy_loader(),
        evaluate=crossing_loss,
        optimizer_kwargs=dict(lr=lr, nbeta=nbeta, localization=gamma, bounding_box_size=4.0),
        num_draws=20000,
        num_chains=4,
        num_burnin_steps=2000,
        num_steps_bw_draws=1,
        seed=0,
        verbose=False,
    )
    reference = crossing_expectation(powers, nbeta, gamma)
    check_against(out, reference, 0.05 * reference)
    check_against(out, lam, 0.05 * reference + abs(reference - lam))


def test_summary_keys_online_and_estimate_learning_coeff():
    model, loader = digits_setup()
    out = estimate_learning_coeff_with_summary(
        model,
        loader,
        optimizer_kwargs=KW,
        num_draws=10,
        num_chains=3,
        seed=1,
        online=True,
        verbose=False,
    )
    for key in (
        "llc/mean",
        "llc/std",
        "llc-chain/0",
        "llc-chain/2",
        "loss/trace",
        "llc/ess",
        "llc/rhat",
        "llc/trace",
        "llc/means",
        "llc/stds",
        "init_loss",
    ):
        assert key in out
    assert out["loss/trace"].shape == (3, 10) and out["llc/trace"].shape == (3, 10)
    chains = [out[f"llc-chain/{i}"] for i in range(3)]
    assert out["llc/mean"] == pytest.approx(np.mean(chains))
    assert out["llc/std"] == pytest.approx(np.std(chains, ddof=1))
    assert out["llc/means"][-1] == pytest.approx(out["llc/mean"])  # running estimate ends at it
    assert out["llc-chain/1"] == pytest.approx(
        out["nbeta"] * (out["loss/trace"][1].mean() - out["init_loss"])
    )
    single = estimate_learning_coeff(
        model, loader, optimizer_kwargs=KW, num_draws=10, num_chains=3, seed=1, verbose=False
    )
    assert single == out["llc/mean"]


def test_estimate_learning_coeff_takes_the_summary_parameters_and_records_a_store(tmp_path):
    """It is the summary's mean under the summary's own parameters: ``online`` and ``store``
    change what is recorded, not the float returned (same seed: the same chains)."""
    summary = inspect.signature(estimate_learning_coeff_with_summary)
    mean = inspect.signature(estimate_learning_coeff)
    assert list(mean.parameters) == list(summary.parameters)
    assert mean.return_annotation == "float"
    model, loader = digits_setup()
    run = dict(optimizer_kwargs=KW, num_draws=4, num_chains=2, seed=3, verbose=False)
    plain = estimate_learning_coeff(model, loader, **run)
    stored = estimate_learning_coeff(model, loader, online=True, store=tmp_path / "llc", **run)
    assert isinstance(stored, float) and stored == plain
    assert (tmp_path / "llc").exists()


def test_burnin_excluded_and_init_loss_averaged_over_batches():
    model, loader = digits_setup()
    out = estimate_learning_coeff_with_summary(
        model,
        loader,
        optimizer_kwargs=KW,
        num_draws=4,
        num_chains=1,
        num_burnin_steps=3,
        num_steps_bw_draws=2,
        seed=0,
        verbose=False,
    )
    assert out["loss/trace"].shape == (1, 4)
    torch.manual_seed(0)  # same loader order as the estimator's init-loss pass
    with torch.no_grad():
        batches = [torch.nn.functional.cross_entropy(model(x), y).item() for x, y in loader][:8]
    assert len(batches) == 8 and out["init_loss"] == pytest.approx(np.mean(batches))
    given = estimate_learning_coeff_with_summary(
        model,
        loader,
        optimizer_kwargs=KW,
        num_draws=4,
        num_chains=1,
        init_loss=0.0,
        seed=0,
        verbose=False,
    )
    assert given["init_loss"] == 0.0


def test_chains_use_distinct_noise_and_seed_reproduces():
    model, loader = digits_setup()
    a = estimate_learning_coeff_with_summary(
        model, loader, optimizer_kwargs=KW, num_draws=5, num_chains=2, seed=3, verbose=False
    )
    b = estimate_learning_coeff_with_summary(
        model, loader, optimizer_kwargs=KW, num_draws=5, num_chains=2, seed=3, verbose=False
    )
    np.testing.assert_array_equal(a["loss/trace"], b["loss/trace"])
    assert not np.array_equal(a["loss/trace"][0], a["loss/trace"][1])


@pytest.mark.slow
def test_parallel_chains_equal_sequential():
    """cores=2 (spawned processes, ~10-25 s of start-up) reproduces cores=1."""
    model, loader = digits_setup()
    kw = dict(optimizer_kwargs=KW, num_draws=8, num_chains=2, seed=5, verbose=False)
    one = estimate_learning_coeff_with_summary(model, loader, cores=1, **kw)
    two = estimate_learning_coeff_with_summary(model, loader, cores=2, **kw)
    np.testing.assert_allclose(two["loss/trace"], one["loss/trace"], rtol=1e-6, atol=0)
    assert two["llc/mean"] == pytest.approx(one["llc/mean"], rel=1e-6)


def test_callbacks_see_every_draw_and_results_merge():
    model, loader = digits_setup()

    class Counter:
        def __init__(self):
            self.seen = []

        def __call__(self, *, chain, draw, loss, model, optimizer):
            self.seen.append((chain, draw))

        def get_results(self):
            return {"counter/n": len(self.seen)}

    counter = Counter()
    out = estimate_learning_coeff_with_summary(
        model,
        loader,
        optimizer_kwargs=KW,
        num_draws=3,
        num_chains=2,
        seed=0,
        callbacks=[counter],
        verbose=False,
    )
    assert counter.seen == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert out["counter/n"] == 6


def test_other_samplers_by_factory_and_name():
    model, loader = digits_setup()
    for method in (SGMCMC.rmsprop_sgld, "sgnht", SGMCMC.adam_sgld):
        kwargs = dict(lr=1e-4, nbeta=10.0) if method == "sgnht" else KW
        out = estimate_learning_coeff_with_summary(
            model,
            loader,
            sampling_method=method,
            optimizer_kwargs=kwargs,
            num_draws=3,
            num_chains=1,
            seed=0,
            verbose=False,
        )
        assert np.isfinite(out["llc/mean"])


def test_recording_store_resume_and_mismatch(tmp_path: Path):
    model, loader = digits_setup()
    kwargs = dict(KW, sketch_dim=16, save_metrics=True)
    store = tmp_path / "run"
    out = estimate_learning_coeff_with_summary(
        model,
        loader,
        optimizer_kwargs=kwargs,
        num_draws=4,
        num_chains=2,
        seed=0,
        verbose=False,
        store=store,
    )
    settings = json.loads((store / "settings.json").read_text())
    reopened = open_draw_store(store, LLCRecordSettings.from_dict(settings), sketch_dim=16)
    np.testing.assert_array_equal(reopened.losses(), out["loss/trace"])
    assert reopened.sketches("noise").shape == (2, 4, 16)
    assert np.all(np.isfinite(reopened.metrics("distance")))
    assert reopened.chain_done(1)
    # A rerun with equal settings resumes: finished chains are read back, not resampled.
    again = estimate_learning_coeff_with_summary(
        model,
        loader,
        optimizer_kwargs=kwargs,
        num_draws=4,
        num_chains=2,
        seed=0,
        verbose=False,
        store=store,
    )
    np.testing.assert_array_equal(again["loss/trace"], out["loss/trace"])
    with pytest.raises(SettingsMismatchError, match=r"num_draws: stored 4, requested 5"):
        estimate_learning_coeff_with_summary(
            model,
            loader,
            optimizer_kwargs=kwargs,
            num_draws=5,
            num_chains=2,
            seed=0,
            verbose=False,
            store=store,
        )
    with pytest.raises(ValueError, match=r"`quantity` must be one of"):
        reopened.sketches("momentum")
    with pytest.raises(ValueError, match=r"`name` must be one of"):
        reopened.metrics("energy")


def _flip_middle(file: Path) -> None:
    raw = bytearray(file.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    file.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    ("array", "damage"),
    [
        ("loss", Path.unlink),
        ("loss", _flip_middle),
        ("loss", lambda f: f.write_bytes(f.read_bytes()[:5])),
        ("sketch/noise", Path.unlink),
        ("metrics/distance", _flip_middle),
    ],
    ids=["loss-deleted", "loss-bit-flipped", "loss-truncated", "sketch-deleted", "metric-flipped"],
)
def test_a_damaged_recorded_draw_is_sampled_again_never_read_as_nan(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, array: str, damage
):
    """Issue 47: a finished chain whose recorded draws lost a chunk is named (array, chunk,
    file) and sampled again, bit-identical to the first run; the estimate is never NaN."""
    model, loader = digits_setup()
    run = functools.partial(
        estimate_learning_coeff_with_summary,
        model,
        loader,
        optimizer_kwargs=dict(KW, sketch_dim=16, save_metrics=True),
        num_draws=4,
        num_chains=2,
        seed=0,
        verbose=False,
        store=tmp_path / "run",
    )
    first = run()
    chunk = tmp_path / "run" / array / "c" / "1" / "0"
    if array.startswith("sketch"):
        chunk = chunk / "0"
    damage(chunk)
    with caplog.at_level("WARNING", logger="gradsketch.sampling._recording"):
        again = run()
    np.testing.assert_array_equal(again["loss/trace"], first["loss/trace"])
    assert again["llc/mean"] == first["llc/mean"] and np.isfinite(again["llc/mean"])
    assert f"`{array}`: rows [1] (1 row(s)) in chunk (1, 0" in caplog.text
    assert str(chunk) in caplog.text and "Sampling chains [1] again" in caplog.text


def test_a_recorded_store_with_an_unreadable_array_record_is_refused(tmp_path: Path):
    from gradsketch.errors import StoreIntegrityError

    model, loader = digits_setup()
    run = functools.partial(
        estimate_learning_coeff_with_summary,
        model,
        loader,
        optimizer_kwargs=KW,
        num_draws=4,
        num_chains=2,
        seed=0,
        verbose=False,
        store=tmp_path / "run",
    )
    run()
    meta = tmp_path / "run" / "loss" / "zarr.json"
    meta.write_text(meta.read_text()[:40])
    with pytest.raises(StoreIntegrityError, match=r"damaged zarr record `.*loss/zarr\.json`.*Fix"):
        run()


def test_store_without_sketches_or_metrics_says_how_to_record(tmp_path: Path):
    store = open_draw_store(
        tmp_path / "s", LLCRecordSettings(num_chains=1, num_draws=2, seed=0, nbeta=1.0)
    )
    with pytest.raises(RuntimeError, match=r"holds no sketches"):
        store.sketches("noise")
    with pytest.raises(RuntimeError, match=r"holds no metrics"):
        store.metrics("noise")


def test_draw_store_is_a_shared_row_store(tmp_path: Path):
    """The recording sits on the ground-floor RowStore and settings record: one
    SettingsMismatchError class for the whole package, package versions recorded
    (never compared), one chain per chunk so processes writing different chains
    never share a file, and arrays of another shape refused with both shapes."""
    import gradsketch._settings
    from gradsketch._store import RowStore

    assert SettingsMismatchError is gradsketch._settings.SettingsMismatchError
    settings = LLCRecordSettings(num_chains=3, num_draws=4, seed=0, nbeta=2.0, record_metrics=True)
    store = open_draw_store(tmp_path / "s", settings, sketch_dim=8)
    assert isinstance(store.rows, RowStore) and store.sketch_dim == 8
    record = json.loads((tmp_path / "s" / "settings.json").read_text())
    assert record["num_draws"] == 4 and "torch" in record["versions"]
    for name in ("loss", "sketch/noise", "metrics/distance", "chains.done"):
        assert store.rows.array(name).chunks[0] == 1, name
    sketches = np.arange(4 * 5 * 8, dtype=np.float32).reshape(4, 5, 8)
    metrics = np.arange(4 * 9, dtype=np.float64).reshape(4, 9)
    store.write_chain(1, np.arange(4.0), sketches, metrics)
    assert [store.chain_done(c) for c in range(3)] == [False, True, False]
    np.testing.assert_array_equal(store.sketches("weight_decay")[1], sketches[:, 3])
    np.testing.assert_array_equal(store.metrics("dot_grad_noise")[1], metrics[:, 7])
    assert np.isnan(store.losses()[0]).all() and np.isnan(store.sketches("noise")[2]).all()
    with pytest.raises(SettingsMismatchError, match=r"shape \(3, 4, 8\).*shape \(3, 4, 16\)"):
        open_draw_store(tmp_path / "s", settings, sketch_dim=16)
    with pytest.raises(SettingsMismatchError, match=r"seed: stored 0, requested 1"):
        LLCRecordSettings(num_chains=3, num_draws=4, seed=1, nbeta=2.0).require_same(settings)


def test_plot_trace_writes_png(tmp_path: Path):
    res = {
        "loss/trace": np.random.default_rng(0).normal(size=(3, 20)),
        "init_loss": 0.0,
        "llc/mean": 1.0,
        "llc/std": 0.2,
    }
    path = plot_trace(res, tmp_path / "trace.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match=r"has no 'loss/trace'"):
        plot_trace({}, tmp_path / "x.png")
    with pytest.raises(ValueError, match=r"must be \[chains, draws\]"):
        plot_trace({"loss/trace": np.zeros(3)}, tmp_path / "x.png")


CONFIG = """
import torch
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,))), batch_size=16)


def evaluate(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y), None


settings = dict(num_chains=2, num_draws=5, seed=0, verbose=False,
                optimizer_kwargs=dict(lr=1e-4, localization=100.0, nbeta=8.0))
"""


def test_llc_command_writes_summary_and_plot(tmp_path: Path):
    config = tmp_path / "cfg_llc_test.py"
    config.write_text(CONFIG)
    summary_path = llc_command(config, tmp_path / "out")
    summary = json.loads(summary_path.read_text())
    assert np.isfinite(summary["llc/mean"]) and len(summary["loss/trace"]) == 2
    assert (tmp_path / "out" / "llc_trace.png").exists()


def test_llc_command_errors(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match=r"`config_path` must be an existing \.py file"):
        llc_command(tmp_path / "missing.py", tmp_path)
    bad = tmp_path / "cfg_llc_bad.py"
    bad.write_text("model = None\n")
    with pytest.raises(ValueError, match=r"does not define \['loader'\]"):
        llc_command(bad, tmp_path)
    unknown = tmp_path / "cfg_llc_unknown.py"
    unknown.write_text("model = None\nloader = None\nsettings = {'chains': 2}\n")
    with pytest.raises(ValueError, match=r"unknown keys \['chains'\]"):
        llc_command(unknown, tmp_path)


def test_default_nbeta():
    assert default_nbeta(100) == pytest.approx(100 / math.log(100))
    assert default_nbeta(dummy_loader(10), grad_accum_steps=2) == pytest.approx(20 / math.log(20))
    assert default_nbeta(1) == 1.0


def _nan_evaluate(model, batch):
    return model(batch[0]).sum() * float("nan")


def _bad_evaluate(model, batch):
    return torch.ones(3)


LLC_ERRORS = [
    pytest.param(
        lambda: default_nbeta("32"), ValueError, r"`loader_or_batch_size` must be", id="nbeta-type"
    ),
    pytest.param(
        lambda: default_nbeta(4, grad_accum_steps=0),
        ValueError,
        r"`grad_accum_steps` must be",
        id="nbeta-gas",
    ),
    pytest.param(
        lambda: estimate_learning_coeff_with_summary(*digits_setup(), num_draws=0),
        ValueError,
        r"`num_draws` must be a positive int",
        id="draws",
    ),
    pytest.param(
        lambda: estimate_learning_coeff_with_summary(*digits_setup(), cores=2, callbacks=[print]),
        ValueError,
        r"`callbacks` run in the calling process",
        id="callbacks-cores",
    ),
    pytest.param(
        lambda: estimate_learning_coeff_with_summary(*digits_setup(), sampling_method=3),
        ValueError,
        r"`sampling_method` must be",
        id="method",
    ),
    pytest.param(
        lambda: estimate_learning_coeff_with_summary(*digits_setup(), sampling_method="hmc"),
        ValueError,
        r"`method` must be one of",
        id="method-name",
    ),
    pytest.param(
        lambda: estimate_learning_coeff_with_summary(digits_setup()[0], [(torch.zeros(2, 8),)] * 2),
        ValueError,
        r"has no `nbeta` and `loader` is not a DataLoader",
        id="nbeta-missing",
    ),
    pytest.param(
        lambda: estimate_learning_coeff_with_summary(
            *digits_setup(), evaluate=_bad_evaluate, verbose=False
        ),
        ValueError,
        r"`evaluate` must return a scalar loss",
        id="evaluate",
    ),
    pytest.param(
        lambda: estimate_learning_coeff_with_summary(digits_setup()[0], [], optimizer_kwargs=KW),
        ValueError,
        r"`loader` yielded no batches",
        id="empty-loader",
    ),
    pytest.param(
        lambda: estimate_learning_coeff_with_summary(
            *digits_setup(),
            evaluate=_nan_evaluate,
            optimizer_kwargs=KW,
            num_draws=2,
            num_chains=1,
            seed=0,
            verbose=False,
            init_loss=0.0,
        ),
        RuntimeError,
        r"hit a non-finite loss",
        id="diverged",
    ),
    pytest.param(
        lambda: LLCRecordSettings(num_chains=0, num_draws=1, seed=0, nbeta=1.0),
        ValueError,
        r"`num_chains` must be a positive int",
        id="settings",
    ),
    pytest.param(
        lambda: LLCRecordSettings.from_dict({"num_chains": 1, "bogus": 2}),
        ValueError,
        r"fields \['bogus'\] that LLCRecordSettings does not know",
        id="settings-unknown",
    ),
]


@pytest.mark.parametrize(("make", "exc", "match"), LLC_ERRORS)
def test_llc_errors(make, exc, match):
    with pytest.raises(exc, match=match):
        make()
