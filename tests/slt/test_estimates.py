"""compute_llc, compute_bif, compute_susceptibilities against float64 loops over definitions."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from gradsketch.slt import FewChainsWarning, compute_bif, compute_llc, compute_susceptibilities

xr = pytest.importorskip("xarray")

CHAINS, DRAWS, TOK = 3, 7, 4


def _samples(sizes: dict[str, int], *, seed: int, n_beta: float = 10.0) -> Any:
    """A sample store in memory: correlated per-token losses for each observable."""
    rng = np.random.default_rng(seed)
    shared = rng.normal(size=(CHAINS, DRAWS, 1, 1))
    data: dict[str, Any] = {
        "init_loss": (("chain", "token_pos"), rng.uniform(1, 2, (CHAINS, TOK)).astype(np.float32)),
        "sampling_loss_micro": (
            ("chain", "step", "batch_sampling", "token_pos"),
            rng.uniform(1.5, 2.5, (CHAINS, DRAWS, 5, TOK)).astype(np.float32),
        ),
    }
    for name, n in sizes.items():
        loss = 2 + 0.5 * shared + rng.normal(size=(CHAINS, DRAWS, n, TOK))
        data[f"loss_{name}"] = (
            ("chain", "draw", f"batch_{name}", "token_pos"),
            loss.astype(np.float32),
        )
        ids = rng.integers(0, 50, (n, TOK + 1))
        data[f"input_ids_{name}"] = ((f"batch_{name}", "token"), ids)
    attrs = {"metadata": {"config": {"sampler": {"n_beta": n_beta}}}}
    return xr.DataTree(xr.Dataset(data, attrs=attrs))


def test_llc_is_nbeta_times_the_loss_excess() -> None:
    """Computed in float64 (agreeing with the loop to ~1e-15 relative) and rounded once to
    devinterp's float32: at most one float32 ulp from the float64 reference rounded."""
    tree = _samples({"a": 2}, seed=0)
    ds = tree.dataset
    micro = ds["sampling_loss_micro"].values.astype(np.float64)
    init = ds["init_loss"].values.astype(np.float64).mean()
    per_chain = [10.0 * (micro[c].mean() - init) for c in range(CHAINS)]
    with pytest.warns(FewChainsWarning, match=r"llc_sem rests on 3 chains \(num_chains=3\)"):
        out = compute_llc(tree)
    expected = {
        "llc_per_chain": np.asarray(per_chain),
        "llc_mean": np.mean(per_chain),
        "llc_std": np.std(per_chain),
        "llc_sem": np.std(per_chain, ddof=1) / np.sqrt(3),
    }
    for name, value in expected.items():
        assert out[name].dtype == np.float32, name
        np.testing.assert_array_max_ulp(out[name].values, np.float32(value), maxulp=1)
    assert out["loss_trace"].dims == ("chain", "step")


def _constant_store(chains: int) -> Any:
    return xr.Dataset(
        {
            "init_loss": (("chain", "token_pos"), np.ones((chains, 3), np.float32)),
            "sampling_loss_micro": (
                ("chain", "step", "batch_sampling", "token_pos"),
                np.full((chains, 4, 1, 3), 1.5, np.float32),
            ),
        },
        attrs={"metadata": {"config": {"sampler": {"n_beta": 10.0}}}},
    )


def test_fewer_than_four_chains_warn_with_the_fix() -> None:
    """The standard error of 2 chains has one degree of freedom: comparisons need more."""
    # filterwarnings=error: four chains pass silently.
    assert float(compute_llc(_constant_store(4)).llc_sem) == 0.0
    with pytest.warns(FewChainsWarning, match=r"rests on 1 chain \(num_chains=1\).*>= 4"):
        assert np.isnan(float(compute_llc(_constant_store(1)).llc_sem))
    with pytest.warns(
        FewChainsWarning, match=r"rests on 2 chains.*sample with num_chains >= 4, and 8 or more"
    ):
        compute_llc(_constant_store(2))
    assert issubclass(FewChainsWarning, UserWarning)


def _series(tree: Any, keys: list[str], method: str, reduce: str) -> np.ndarray:
    """[batch, token (or 1), observations] in float64, the definition's way."""
    losses = np.concatenate([tree.dataset[f"loss_{k}"].values for k in keys], axis=2).astype(float)
    if method == "sequence":
        losses = losses.mean(axis=3, keepdims=True)
    obs = losses.reshape(-1, *losses.shape[2:]) if reduce == "stack" else losses.mean(axis=0)
    return np.moveaxis(obs, 0, -1)


def _pair(x: np.ndarray, y: np.ndarray, cov: bool) -> float:
    return float(np.cov(x, y)[0, 1] if cov else np.corrcoef(x, y)[0, 1])


@pytest.mark.parametrize("reduce", ["stack", "mean"])
@pytest.mark.parametrize("cov", [False, True], ids=["corr", "cov"])
def test_token_bif_matches_pairwise_float64(reduce: str, cov: bool) -> None:
    """Token-level products run in float32: a dot product of ``n`` terms rounded to float32
    and summed in float32 is within ``(n + 2) * 2^-24 * |z_i| |z_j|`` of the exact one
    (``n`` for the sum, 2 for rounding both factors; ``|z|`` = 1 for correlations, the
    series' standard deviation for covariances), plus the float32 result's rounding."""
    tree = _samples({"a": 3, "b": 2}, seed=1)
    out = compute_bif(
        tree,
        correlation_method="token",
        reduce_chain_dimension_method=reduce,  # type: ignore[arg-type]
        compute_covariance=cov,
        batch_size=2,
    )
    s = _series(tree, ["a", "b"], "token", reduce)
    ref = np.array(
        [
            [
                [[_pair(s[i, t], s[j, u], cov) for u in range(TOK)] for t in range(TOK)]
                for j in range(5)
            ]
            for i in range(5)
        ]
    )
    assert out["influences"].dims == ("batch_1", "batch_2", "target_position", "target_position_T")
    assert out["influences"].dtype == np.float32
    n = s.shape[-1]
    norm = s.std(axis=-1, ddof=1) if cov else np.ones(s.shape[:2])  # |z| per [batch, token]
    unit = 2.0**-24
    tol = (n + 2) * unit * norm[:, None, :, None] * norm[None, :, None, :] + unit * np.abs(ref)
    assert np.all(np.abs(out["influences"].values - ref) <= tol)
    assert out["target_position"].values.tolist() == [1, 2, 3, 4]
    assert out["input_ids"].dims == ("batch", "position") and out["input_ids"].shape == (5, TOK + 1)


@pytest.mark.parametrize("cov", [False, True], ids=["corr", "cov"])
def test_sequence_bif_and_index_ranges(cov: bool) -> None:
    tree = _samples({"a": 3, "b": 2}, seed=2)
    out = compute_bif(
        tree,
        correlation_method="sequence",
        batch_index_range_1=[4, 0],
        batch_index_range_2=[1, 2, 3],
        compute_covariance=cov,
    )
    s = _series(tree, ["a", "b"], "sequence", "stack")[:, 0]
    ref = np.array([[_pair(s[i], s[j], cov) for j in (1, 2, 3)] for i in (4, 0)])
    np.testing.assert_allclose(out["influences"].values, ref, rtol=1e-5, atol=1e-6)
    assert out["batch_1"].values.tolist() == [4, 0]
    assert out["batch_2"].values.tolist() == [1, 2, 3]


def test_averaged_token_bif_and_loss_keys() -> None:
    tree = _samples({"a": 3, "b": 2}, seed=3)
    full = compute_bif(tree, loss_keys=["b"])
    avg = compute_bif(tree, loss_keys=["b"], average_tokenwise_bif=True)
    assert avg["influences"].dims == ("batch_1", "batch_2")
    np.testing.assert_allclose(
        avg["influences"].values, full["influences"].values.mean(axis=(2, 3)), rtol=1e-5
    )
    with pytest.raises(KeyError, match=r"\['c'\] are not in the samples"):
        compute_bif(tree, loss_keys=["c"])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"correlation_method": "pair"}, r"`correlation_method` must be 'token' or 'sequence'"),
        ({"reduce_chain_dimension_method": "max"}, r"must be 'stack' or 'mean'"),
        ({"batch_size": 0}, r"`batch_size` must be a positive int"),
    ],
    ids=["method", "reduce", "batch"],
)
def test_bif_argument_errors(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        compute_bif(_samples({"a": 2}, seed=0), **kwargs)


def test_susceptibilities_match_the_definition() -> None:
    """float32 as devinterp's: the float64 result (within 1e-10 relative of the loop
    below, far inside float32's half ulp of 6e-8) rounded once, so at most one float32
    ulp from the loop's value rounded."""
    wr = {"full": _samples({"pile": 2, "code": 3, "math": 2}, seed=4)}
    wr["l0"] = _samples({"pile": 2, "code": 3, "math": 2}, seed=5)
    wr["l1h0"] = _samples({"pile": 2, "code": 3, "math": 2}, seed=6)
    for name in ("l0", "l1h0"):  # same sequences in every restriction's samples
        for k in ("code", "math", "pile"):
            wr[name][f"input_ids_{k}"] = wr["full"].dataset[f"input_ids_{k}"]
    out = compute_susceptibilities(wr, "pile")
    sus = out["susceptibilities"].dataset
    assert sus.attrs["dataset_id_to_name"] == ["code", "math"]
    assert sus["wr"].values.tolist() == ["l0", "l1h0"]
    full = wr["full"].dataset
    init = full["init_loss"].values.astype(float).mean()
    full_pt = full["loss_pile"].values.astype(float).mean()
    rows = []
    for k in ("code", "math"):
        fk = full[f"loss_{k}"].values.astype(float).mean(axis=(0, 1))
        cols = []
        for name in ("l0", "l1h0"):
            ds = wr[name].dataset
            pt = ds["loss_pile"].values.astype(float).mean(axis=(2, 3))
            phi = pt - init
            probe = ds[f"loss_{k}"].values.astype(float)
            chi = np.empty(probe.shape[2:])
            for b in range(probe.shape[2]):
                for t in range(TOK):
                    chi[b, t] = (
                        (phi * pt).mean()
                        - (phi * probe[:, :, b, t]).mean()
                        - phi.mean() * (full_pt - fk[b, t])
                    )
            cols.append(chi.ravel())
        rows.append(np.stack(cols, axis=-1))
    assert sus["sus"].dtype == np.float32
    expected = np.concatenate(rows).astype(np.float32)
    np.testing.assert_array_max_ulp(sus["sus"].values, expected, maxulp=1)
    assert sus["dataset_id"].values.tolist() == [0] * 12 + [1] * 8
    assert sus["target_position"].values[:4].tolist() == [1, 2, 3, 4]
    ctx = out["context"].dataset
    assert ctx["input_ids"].shape == (5 * (TOK + 1),)
    np.testing.assert_array_equal(
        ctx["input_ids"].values[: 3 * (TOK + 1)], full["input_ids_code"].values.ravel()
    )


def test_susceptibility_errors() -> None:
    a = _samples({"pile": 2, "code": 2}, seed=0)
    with pytest.raises(ValueError, match=r"must have a 'full' entry"):
        compute_susceptibilities({"l0": a}, "pile")
    with pytest.raises(ValueError, match=r"`sampling_task`='web' is not an observable"):
        compute_susceptibilities({"full": a, "l0": a}, "web")
    with pytest.raises(ValueError, match=r"has only 'full'"):
        compute_susceptibilities({"full": a}, "pile")
    only = _samples({"pile": 2}, seed=0)
    with pytest.raises(ValueError, match=r"no probe observable"):
        compute_susceptibilities({"full": only, "l0": only}, "pile")
