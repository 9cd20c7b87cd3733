"""LLC chains over 2 gloo ranks: bit-identical to one process with ``cores=1``.

Chains run the same arithmetic wherever they run (same seed per chain, same
model copy, same loader order, one thread), and the summary is computed from
the gathered traces by the same formulas, so every value must be equal, not
close.
"""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from _llc_dist_worker import SETTINGS, problem

from gradsketch import _distributed as common
from gradsketch.sampling import _distributed as D
from gradsketch.sampling import (
    estimate_learning_coeff_distributed,
    estimate_learning_coeff_with_summary,
)
from gradsketch.sampling._recording import METRIC_FIELDS
from gradsketch.sketch import SKETCH_QUANTITIES

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers.launch import one_thread, torchrun

WORLD = 2


def assert_same_summary(a: dict, b: dict) -> None:
    """Exact on any CPU: a chain's draws depend only on its seed, and every chain
    runs the one-process arithmetic with one thread wherever it runs."""
    assert set(a) == set(b)
    for key, value in a.items():
        if isinstance(value, np.ndarray):
            assert value.dtype == b[key].dtype and np.array_equal(value, b[key], equal_nan=True)
        elif isinstance(value, float) and np.isnan(value):
            assert np.isnan(b[key]), key
        else:
            assert value == b[key], key


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    dist_root = tmp_path_factory.mktemp("dist")
    single_store = tmp_path_factory.mktemp("single") / "store"
    torchrun(Path(__file__).with_name("_llc_dist_worker.py"), str(dist_root), nproc=WORLD)
    ranks = [pickle.loads((dist_root / f"rank{r}.pkl").read_bytes()) for r in range(WORLD)]
    model, loader = problem()
    with one_thread():
        ref = estimate_learning_coeff_with_summary(
            model, loader, cores=1, store=single_store, **SETTINGS
        )
    return {"ranks": ranks, "ref": ref, "dist_store": dist_root / "store", "store": single_store}


def _without(result: dict, *keys: str) -> dict:
    return {k: v for k, v in result.items() if k not in keys}


def test_every_rank_returns_the_one_process_summary(runs):
    ref = _without(runs["ref"], "store")
    for result in runs["ranks"]:
        assert_same_summary(_without(result, "store", "mismatch"), ref)
    assert np.isfinite(ref["llc/ess"])  # 8 draws: ArviZ diagnostics are computed


def _arrays(path: Path) -> dict[str, np.ndarray]:
    """Every zarr array under ``path`` (found by its metadata file), by relative name."""
    out = {}
    for meta in path.rglob("zarr.json"):
        if json.loads(meta.read_text()).get("node_type") == "array":
            name = meta.parent.relative_to(path).as_posix()
            out[name] = np.asarray(zarr.open_array(str(meta.parent), mode="r")[:])
    return out


def test_shared_store_equals_one_process_store(runs):
    """Ranks wrote their own chains (chunks) of one store; every array is bit-equal."""
    a, b = _arrays(runs["dist_store"]), _arrays(runs["store"])
    assert set(a) == set(b)
    assert {"loss", *(f"sketch/{q}" for q in SKETCH_QUANTITIES)} <= set(a)
    assert {f"metrics/{m}" for m in METRIC_FIELDS} <= set(a)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert np.array_equal(a[name], b[name], equal_nan=True), name
    assert not np.isnan(a["loss"]).any()  # every chain was written


def test_one_process_resumes_from_the_distributed_store(runs):
    """Every chain is done in the shared store: a one-process rerun only reads it."""
    model, loader = problem()
    rerun = estimate_learning_coeff_with_summary(
        model, loader, cores=1, store=runs["dist_store"], **SETTINGS
    )
    assert_same_summary(_without(rerun, "store"), _without(runs["ref"], "store"))


def test_ranks_with_different_seeds_are_refused(runs):
    for result in runs["ranks"]:
        message = result["mismatch"]
        # Only the differing setting is named, with every rank's value.
        assert message.startswith("LLC settings differs across ranks (seed: rank 0: 0, rank 1: 1)")
        assert "num_chains" not in message


def test_without_process_group_equals_cores_1():
    model, loader = problem()
    settings = {**SETTINGS, "optimizer_kwargs": {"lr": 1e-3, "localization": 100.0}}
    with one_thread():
        a = estimate_learning_coeff_distributed(model, loader, **settings)
        b = estimate_learning_coeff_with_summary(model, loader, cores=1, **settings)
    assert_same_summary(a, b)


class Collect:
    """A callback aggregating over chains (devinterp style)."""

    def __init__(self) -> None:
        self.draws = 0

    def __call__(self, **_: object) -> None:
        self.draws += 1

    def get_results(self) -> dict[str, int]:
        return {"collect/draws": self.draws}


def test_callbacks_run_and_merge_in_one_process():
    model, loader = problem()
    callback = Collect()
    out = estimate_learning_coeff_distributed(
        model, loader, callbacks=[callback], **{**SETTINGS, "online": False}
    )
    assert out["collect/draws"] == SETTINGS["num_chains"] * SETTINGS["num_draws"]


def test_aggregating_callbacks_refused_across_ranks():
    D.check_distributed_callbacks([Collect()], 1)
    D.check_distributed_callbacks([lambda **_: None], WORLD)
    with pytest.raises(ValueError, match=r"`callbacks` \['Collect'\] have get_results\(\)"):
        D.check_distributed_callbacks([Collect()], WORLD)


def test_mismatch_is_refused_before_any_chain(monkeypatch):
    model, loader = problem()
    monkeypatch.setattr(common, "rank_and_world", lambda: (0, WORLD))
    monkeypatch.setattr(common, "all_gather_object", lambda value: [value, {**value, "seed": 99}])
    with pytest.raises(
        D.DistributedMismatchError, match=r"differs across ranks \(seed: rank 0: \d+, rank 1: 99\)"
    ):
        estimate_learning_coeff_distributed(model, loader, **SETTINGS)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_chains": 0}, "`num_chains` must be a positive integer, got 0"),
        ({"num_draws": -1}, "`num_draws` must be a positive integer, got -1"),
        ({"num_burnin_steps": -2}, "`num_burnin_steps` must be a non-negative int"),
        ({"loader": [(torch.zeros(2, 5), torch.zeros(2).long())]}, "has no `nbeta`"),
    ],
    ids=["chains", "draws", "burnin", "no-nbeta"],
)
def test_argument_errors(kwargs, match):
    model, loader = problem()
    args = {"loader": loader, "optimizer_kwargs": {"lr": 1e-3}, **kwargs}
    with pytest.raises(ValueError, match=match):
        estimate_learning_coeff_distributed(model, **args)


def test_cuda_without_index_means_this_ranks_gpu(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert D._device_for_rank("cuda") == torch.device("cuda", 1)
    assert D._device_for_rank("cuda:0") == torch.device("cuda", 0)
    assert D._device_for_rank("cpu") == torch.device("cpu")
