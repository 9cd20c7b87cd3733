"""Side by side with devinterp 2.0.1 (the `bench` extra): masks, estimates on its stores, LLC."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _slt_helpers import tiny_gpt2, tiny_llama, tiny_neox, tiny_qwen2, token_data

from gradsketch import slt

pytestmark = pytest.mark.bench

devinterp_slt = pytest.importorskip("devinterp.slt")
from devinterp.slt import bif as d_bif  # noqa: E402
from devinterp.slt import llc as d_llc  # noqa: E402
from devinterp.slt import sampling as d_sampling  # noqa: E402
from devinterp.slt import susceptibilities as d_sus  # noqa: E402
from devinterp.slt import weight_restrictions as d_wr  # noqa: E402

RESTRICTIONS = [
    "full",
    "l0",
    "l1",
    "l0 attn",
    "l1 mlp",
    "embed",
    "l0h0",
    "l1h3",
    "l0g0",
    "l1g1",
    ["l0h1", "l1 mlp"],
    ["l0g1", "l0h0", "embed"],
]


def _tiny_gpt_neo() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPTNeoConfig(
        num_layers=2,
        hidden_size=32,
        num_heads=4,
        attention_types=[[["global", "local"], 1]],
        vocab_size=64,
        max_position_embeddings=64,
    )
    return transformers.GPTNeoForCausalLM(cfg)


FAMILIES = {
    "gpt2": tiny_gpt2,
    "llama-gqa": tiny_llama,
    "gpt_neox": tiny_neox,
    "qwen2-gqa": tiny_qwen2,
    "gpt_neo": _tiny_gpt_neo,
}


def _normalized(masks: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
    """devinterp's dict with all-True masks written as None (both mean 'all of it')."""
    out: dict[str, torch.Tensor | None] = {}
    for name, m in masks.items():
        if m is None or bool(m.all()):
            out[name] = None
        elif bool(m.any()):
            out[name] = m
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_create_param_masks_identical(family: str) -> None:
    model = FAMILIES[family]()
    for restriction in RESTRICTIONS:
        theirs = _normalized(d_wr.create_param_masks(model, restriction))
        ours = slt.param_masks_dict(slt.create_param_masks(model, restriction))
        # Same parameters (devinterp orders a union by restriction; ours by the model).
        assert sorted(ours) == sorted(theirs), (family, restriction)
        for name, m in theirs.items():
            if m is None:
                assert ours[name] is None, (family, restriction, name)
            else:
                assert ours[name] is not None and torch.equal(ours[name], m), (restriction, name)
        # And the sampler accepts devinterp's form for the same selection.
        assert slt.to_param_mask(model, d_wr.create_param_masks(model, restriction)) == (
            slt.create_param_masks(model, restriction)
        )


KW: dict[str, Any] = dict(
    lr=1e-4,
    n_beta=20.0,
    localization=100.0,
    num_chains=2,
    num_draws=4,
    batch_size=4,
    num_init_loss_batches=2,
)


@pytest.fixture(scope="module")
def devinterp_trees(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two devinterp stores of one model: the full model and head l1h0."""
    root = tmp_path_factory.mktemp("dev")
    model = tiny_gpt2()
    data = token_data(32)
    probe = token_data(8, seed=1)
    obs = {"pile": (data, 2), "code": (probe, 2)}
    from datasets import Dataset

    ds = {
        k: (Dataset.from_dict({"input_ids": v.tolist()}).with_format("torch"), b)
        for k, (v, b) in obs.items()
    }
    sampling = ds["pile"][0]
    trees = {}
    for name in ("full", "l1h0"):
        masks = None if name == "full" else d_wr.create_param_masks(model, name)
        trees[name] = d_sampling.sample(
            model, sampling, ds, param_masks=masks, output_path=root / f"{name}.zarr", **KW
        )
    _RUNS["args"] = (model, sampling, ds, root / "full.zarr")
    return trees


#: Equality of two libraries' numbers, not a comparison by standard error: any chain count.
FEW_CHAINS_OK = pytest.mark.filterwarnings("ignore::gradsketch.slt.FewChainsWarning")

_RUNS: dict[str, Any] = {}


@FEW_CHAINS_OK
def test_compute_llc_on_a_devinterp_store(devinterp_trees: dict[str, Any]) -> None:
    """devinterp averages float32 losses in float32, ours in float64: the means of
    losses near L differ by a few float32 ulps of L, and an LLC, n_beta times a
    difference of such means, by n_beta * 8 * eps32 * L at most."""
    tree = devinterp_trees["full"]
    theirs, ours = d_llc.compute_llc(tree), slt.compute_llc(tree)
    scale = float(theirs["init_loss"])
    atol = 20.0 * 8 * float(np.finfo(np.float32).eps) * scale
    for var in ("llc_mean", "llc_std", "llc_scalar", "llc_per_chain"):
        np.testing.assert_allclose(ours[var].values, theirs[var].values, atol=atol, err_msg=var)
    for var in ("loss_trace", "init_loss"):
        np.testing.assert_allclose(ours[var].values, theirs[var].values, rtol=8e-7, err_msg=var)
    for var in theirs.variables:  # devinterp's dtypes (llc_sem, ours alone: llc_mean's)
        assert ours[var].dtype == theirs[var].dtype, var
    assert ours["llc_sem"].dtype == theirs["llc_mean"].dtype


@pytest.mark.parametrize("method", ["token", "sequence"])
@pytest.mark.parametrize("reduce", ["stack", "mean"])
@pytest.mark.parametrize("cov", [False, True], ids=["corr", "cov"])
def test_compute_bif_on_a_devinterp_store(
    devinterp_trees: dict[str, Any], method: str, reduce: str, cov: bool
) -> None:
    tree = devinterp_trees["full"]
    kw = dict(
        correlation_method=method,
        reduce_chain_dimension_method=reduce,
        compute_covariance=cov,
        device="cpu",
    )
    theirs, ours = d_bif.compute_bif(tree, **kw), slt.compute_bif(tree, **kw)
    assert ours["influences"].dims == theirs["influences"].dims
    # devinterp centres float32 losses in float32: a series with mean m and spread
    # sd loses about eps32 * |m| / sd of its relative precision, and a correlation
    # (a covariance: times sd_x sd_y) of two such series inherits that error from
    # each. Ours is float64 (checked against float64 loops in test_estimates).
    x = np.concatenate([tree.dataset[v].values for v in ("loss_code", "loss_pile")], axis=2)
    if method == "sequence":
        x = x.mean(axis=3, keepdims=True)
    x = x.reshape(-1, *x.shape[2:]) if reduce == "stack" else x.mean(axis=0)
    x = x.astype(np.float64)
    sd = x.std(axis=0, ddof=1)
    worst = float((np.abs(x).max(axis=0) / sd).max())
    eps = float(np.finfo(np.float32).eps)
    atol = 2 * 8 * eps * worst * (float(sd.max()) ** 2 if cov else 1.0)
    np.testing.assert_allclose(ours["influences"].values, theirs["influences"].values, atol=atol)
    np.testing.assert_array_equal(ours["input_ids"].values, theirs["input_ids"].values)
    for coord in theirs["influences"].coords:
        np.testing.assert_array_equal(ours[coord].values, theirs[coord].values)
    assert set(ours.variables) == set(theirs.variables)
    for var in theirs.variables:
        assert ours[var].dtype == theirs[var].dtype, var


def test_compute_susceptibilities_on_devinterp_stores(devinterp_trees: dict[str, Any]) -> None:
    """devinterp forms phi = pt - init and E[phi L] from float32 arrays; each product
    phi * L is then off by a few float32 ulps of max|phi| * max|L|, and so are the
    means and their differences (ours are float64)."""
    theirs = d_sus.compute_susceptibilities(devinterp_trees, "pile")
    ours = slt.compute_susceptibilities(devinterp_trees, "pile")
    ds = devinterp_trees["l1h0"].dataset
    init = float(devinterp_trees["full"].dataset["init_loss"].values.mean())
    phi = np.abs(ds["loss_pile"].values.mean(axis=(2, 3)) - init).max()
    big = max(float(np.abs(ds[v].values).max()) for v in ("loss_pile", "loss_code"))
    atol = 8 * float(np.finfo(np.float32).eps) * phi * big
    for node in ("susceptibilities", "context"):
        a, b = ours[node].dataset, theirs[node].dataset
        assert set(a.variables) == set(b.variables), node
        assert a.attrs == b.attrs
        for var in b.variables:
            assert a[var].dtype == b[var].dtype, (node, var)
            if var == "sus":
                np.testing.assert_allclose(a[var].values, b[var].values, atol=atol)
            else:
                np.testing.assert_array_equal(a[var].values, b[var].values, err_msg=var)


def test_sample_reuses_a_devinterp_store(
    devinterp_trees: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from gradsketch.slt import _run

    model, sampling, obs, path = _RUNS["args"]

    def fail(self: Any) -> None:
        raise AssertionError("a completed devinterp store was sampled again")

    monkeypatch.setattr(_run.SampleRun, "run", fail)
    tree = slt.sample(model, sampling, obs, output_path=path, **KW)
    np.testing.assert_array_equal(
        tree.dataset["loss_code"].values, devinterp_trees["full"].dataset["loss_code"].values
    )
    with pytest.raises(slt.OutputPathMismatchError, match=r"lr: stored 0.0001, requested 0.0002"):
        slt.sample(model, sampling, obs, output_path=path, **{**KW, "lr": 2e-4})


def test_llc_agrees_with_devinterp(tmp_path: Path) -> None:
    """Same model, data and settings; different noise streams.

    Each LLC is a mean over C independent chains, with standard error
    ``s / sqrt(C)`` (``s``: the chains' standard deviation). The two estimates
    are independent, so their difference has standard error
    ``sqrt(sem_a^2 + sem_b^2)``; under Welch's t with about ``2C - 2 = 6``
    degrees of freedom, ``|difference| > 5 * se`` has probability below 0.3%.
    With fixed seeds the test is deterministic; the bound says how far apart
    two correct samplers may be.
    """
    from datasets import Dataset

    model = tiny_gpt2(dropout=0.1)
    data = token_data(96)
    ds = Dataset.from_dict({"input_ids": data.tolist()}).with_format("torch")
    kw = {**KW, "num_chains": 4, "num_draws": 30, "num_init_loss_batches": 8}
    theirs = d_llc.llc(model, ds, {"train": ds}, output_path=tmp_path / "d.zarr", **kw)
    ours = slt.llc(model, ds, {"train": ds}, output_path=tmp_path / "g.zarr", **kw)
    sem_theirs = float(theirs["llc_per_chain"].std(ddof=1)) / math.sqrt(4)
    se = math.sqrt(float(ours["llc_sem"]) ** 2 + sem_theirs**2)
    diff = abs(float(ours["llc_mean"]) - float(theirs["llc_mean"]))
    assert diff <= 5 * se, (float(ours["llc_mean"]), float(theirs["llc_mean"]), se)
    assert float(ours["llc_mean"]) > 0


@FEW_CHAINS_OK
@pytest.mark.filterwarnings("ignore:noise_level")
def test_without_noise_or_dropout_the_chains_are_devinterps(tmp_path: Path) -> None:
    """noise_level=0 and no dropout: both samplers are deterministic gradient flows.

    Every array of the two stores then agrees to float32 rounding (ours uses a
    fused cross-entropy, devinterp log-softmax and gather: ~1e-6 per loss),
    and so does the LLC: same batches, same ``init_loss``, same ``nbeta``
    scaling and localization, same formula. What remains between the two
    libraries' estimates with noise is the chains' randomness (noise and
    dropout draws), which ``test_llc_agrees_with_devinterp`` bounds.
    """
    from datasets import Dataset
    from devinterp.slt.llc import compute_llc as d_compute_llc

    model = tiny_gpt2()
    data = token_data(64)
    ds = Dataset.from_dict({"input_ids": data.tolist()}).with_format("torch")
    kw = {**KW, "num_draws": 6, "noise_level": 0.0, "save_metrics": True, "n_beta": 30.0}
    theirs = d_sampling.sample(model, ds, {"train": ds}, output_path=tmp_path / "d.zarr", **kw)
    ours = slt.sample(model, ds, {"train": ds}, output_path=tmp_path / "g.zarr", **kw)
    a, b = theirs.dataset, ours.dataset
    np.testing.assert_array_equal(
        a["sampling_input_ids_micro"].values, b["sampling_input_ids_micro"].values
    )
    for var in ("init_loss", "sampling_loss_micro", "sampling_loss", "loss_train"):
        np.testing.assert_allclose(b[var].values, a[var].values, rtol=0, atol=1e-5, err_msg=var)
    for var in ("metrics_scaled_grad", "metrics_localization", "metrics_distance"):
        np.testing.assert_allclose(b[var].values, a[var].values, rtol=1e-4, err_msg=var)
    llc_theirs = d_compute_llc(theirs)["llc_per_chain"].values
    llc_ours = slt.compute_llc(ours)["llc_per_chain"].values
    np.testing.assert_allclose(llc_ours, llc_theirs, rtol=0, atol=1e-4)
    # The chains did move: the comparison is not between two copies of w*.
    assert np.abs(llc_ours).min() > 1e-2


def _chunk_bytes(path: Path, name: str) -> int:
    """Bytes of an array's chunk files (its data, without the metadata)."""
    return sum(f.stat().st_size for f in (path / name / "c").rglob("*") if f.is_file())


def test_devinterp_reuses_our_compressed_store_and_it_is_smaller(
    devinterp_trees: dict[str, Any], tmp_path: Path
) -> None:
    """devinterp opens our Blosc-zstd + crc32c store and returns it as its own completed
    samples (same arrays: resampling would draw other noise); for the same run our chunks
    of losses, and the store's data as a whole, take fewer bytes than devinterp's zstd
    ones. (Chunks of a few hundred bytes, init_loss and this run's token ids, are the
    exception: blosc's 16-byte header and the 4-byte checksum outweigh the shuffle's
    gain; on a 2 x 50-draw run the token ids are 30 % smaller than devinterp's.)"""
    model, sampling, obs, theirs_path = _RUNS["args"]
    ours_path = tmp_path / "ours.zarr"
    ours = slt.sample(model, sampling, obs, output_path=ours_path, **KW).dataset
    again = d_sampling.sample(model, sampling, obs, output_path=ours_path, **KW).dataset
    assert set(again.data_vars) == set(ours.data_vars)
    for var in ours.data_vars:
        np.testing.assert_array_equal(again[var].values, ours[var].values, err_msg=str(var))
    for name in ("sampling_loss_micro", "sampling_loss", "loss_pile", "loss_code"):
        assert _chunk_bytes(ours_path, name) < _chunk_bytes(theirs_path, name), name
    names = [str(v) for v in ours.data_vars]
    total = {p: sum(_chunk_bytes(p, name) for name in names) for p in (ours_path, theirs_path)}
    assert total[ours_path] < total[theirs_path]
