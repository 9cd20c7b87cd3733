"""TRAKer end to end: explicit float64 formula, store, resume, budget, errors."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
import zarr

from gradsketch._settings import SettingsMismatchError
from gradsketch.attribution import (
    BasicScoreComputer,
    FunctionalGradientComputer,
    ModelIDException,
    TRAKer,
    UnknownTaskError,
)
from gradsketch.sketch import NoOpProjector
from helpers.attribution import logreg_checkpoints, logreg_data, margin_grad_reference, q_reference

QUIET = {"logging_level": logging.WARNING, "progress": False, "device": "cpu"}


def _run(save_dir, model, ckpts, x, y, xt, yt, batch=8, **kwargs):
    traker = TRAKer(model, "image_classification", len(x), save_dir=save_dir, **{**QUIET, **kwargs})
    for mid, state in enumerate(ckpts):
        traker.load_checkpoint(state, model_id=mid)
        for s in range(0, len(x), batch):
            traker.featurize(
                (x[s : s + batch], y[s : s + batch]), num_samples=len(x[s : s + batch])
            )
    traker.finalize_features()
    for mid, state in enumerate(ckpts):
        traker.start_scoring_checkpoint("exp", state, model_id=mid, num_targets=len(xt))
        traker.score((xt, yt), num_samples=len(xt))
    return traker, traker.finalize_scores("exp")


@pytest.mark.parametrize("lam", [0.0, 0.1])
def test_noop_logreg_scores_equal_explicit_float64_formula(tmp_path, lam):
    x, y = logreg_data(n=40)
    xt, yt = logreg_data(n=6, seed=9)
    ckpts = logreg_checkpoints(count=2)
    model = torch.nn.Linear(5, 3).double()
    _, scores = _run(
        tmp_path, model, ckpts, x, y, xt, yt, projector=NoOpProjector(), lambda_reg=lam
    )
    d = 5 * 3 + 3
    acc = torch.zeros(40, 6, dtype=torch.float64)
    qsum = torch.zeros(40, dtype=torch.float64)
    for state in ckpts:
        phi = margin_grad_reference(state, x, y) / d**0.5
        phit = margin_grad_reference(state, xt, yt) / d**0.5
        a = phi.T @ phi + lam * torch.eye(d, dtype=torch.float64)
        # Margin gradients sum to zero over classes, so XᵀX is singular at λ=0:
        # the pseudo-inverse is the limit λ -> 0 of the damped formula.
        acc += phi @ torch.linalg.pinv(a, hermitian=True) @ phit.T
        qsum += q_reference(state, x, y)
    ref = (acc / 2 * (qsum / 2)[:, None]).numpy()
    assert isinstance(scores, np.ndarray) and scores.shape == (40, 6)
    np.testing.assert_allclose(scores, ref, rtol=2e-3, atol=2e-4 * np.abs(ref).max())


def test_default_projector_is_count_sketch_on_cpu(tmp_path):
    model = torch.nn.Linear(5, 3)
    traker = TRAKer(model, "image_classification", 4, save_dir=tmp_path, proj_dim=16, **QUIET)
    assert type(traker.projector).__name__ == "CountSketchProjector"
    assert traker.settings.projector["kind"] == "sparse"


def test_user_score_computer_gives_same_scores(tmp_path):
    x, y = logreg_data(n=30)
    xt, yt = logreg_data(n=4, seed=3)
    ckpts = logreg_checkpoints(count=1)
    model = torch.nn.Linear(5, 3).double()
    _, a = _run(tmp_path / "a", model, ckpts, x, y, xt, yt, projector=NoOpProjector())
    _, b = _run(
        tmp_path / "b",
        model,
        ckpts,
        x,
        y,
        xt,
        yt,
        projector=NoOpProjector(),
        score_computer=BasicScoreComputer,
    )
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4 * np.abs(a).max())


def test_del_grads_forms_features_with_same_scores(tmp_path):
    x, y = logreg_data(n=30)
    xt, yt = logreg_data(n=4, seed=3)
    ckpts = logreg_checkpoints(count=2)
    model = torch.nn.Linear(5, 3).double()
    _, a = _run(tmp_path / "a", model, ckpts, x, y, xt, yt, proj_dim=12)
    traker = TRAKer(
        model, "image_classification", 30, save_dir=tmp_path / "b", proj_dim=12, **QUIET
    )
    for mid, state in enumerate(ckpts):
        traker.load_checkpoint(state, mid)
        traker.featurize((x, y), num_samples=30)
    traker.finalize_features(del_grads=True)
    assert not traker.store.has("checkpoints/0/grads")
    for mid, state in enumerate(ckpts):
        traker.start_scoring_checkpoint("exp", state, mid, 4)
        traker.score((xt, yt), num_samples=4)
    b = traker.finalize_scores("exp")
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4 * np.abs(a).max())


def test_memory_budget_far_below_matrix_writes_zarr(tmp_path):
    x, y = logreg_data(n=64)
    xt, yt = logreg_data(n=20, seed=4)
    ckpts = logreg_checkpoints(count=2)
    model = torch.nn.Linear(5, 3).double()
    _, full = _run(tmp_path / "a", model, ckpts, x, y, xt, yt, proj_dim=8)
    budget = 24 * 64 + 1500  # the score matrix is 64 x 20 x 4 = 5120 bytes
    _, disk = _run(tmp_path / "b", model, ckpts, x, y, xt, yt, proj_dim=8, memory_budget=budget)
    assert isinstance(disk, zarr.Array)
    assert (tmp_path / "b" / "scores" / "exp").exists()
    np.testing.assert_allclose(disk[:], full, rtol=1e-5, atol=1e-6 * np.abs(full).max())


def test_reopen_with_other_settings_is_refused_showing_both(tmp_path):
    model = torch.nn.Linear(5, 3)
    TRAKer(model, "image_classification", 10, save_dir=tmp_path, proj_dim=16, **QUIET)
    with pytest.raises(SettingsMismatchError, match=r"proj_dim: stored 16, requested 32"):
        TRAKer(model, "image_classification", 10, save_dir=tmp_path, proj_dim=32, **QUIET)
    with pytest.raises(SettingsMismatchError, match=r"train_set_size: stored 10, requested 11"):
        TRAKer(model, "image_classification", 11, save_dir=tmp_path, proj_dim=16, **QUIET)
    with pytest.raises(SettingsMismatchError, match=r"model: stored '[0-9a-f]+', requested"):
        TRAKer(
            torch.nn.Linear(5, 4),
            "image_classification",
            10,
            save_dir=tmp_path,
            proj_dim=16,
            **QUIET,
        )


def test_model_id_with_other_weights_is_refused(tmp_path):
    model = torch.nn.Linear(5, 3).double()
    a, b = logreg_checkpoints(count=2)
    traker = TRAKer(model, "image_classification", 10, save_dir=tmp_path, proj_dim=8, **QUIET)
    traker.load_checkpoint(a, 0)
    with pytest.raises(SettingsMismatchError, match=r"model id 0 .* fingerprint"):
        traker.load_checkpoint(b, 0)


class CountingComputer(FunctionalGradientComputer):
    rows = 0

    def compute_per_sample_grad(self, batch):
        CountingComputer.rows += int(batch[0].shape[0])
        return super().compute_per_sample_grad(batch)


CHILD = textwrap.dedent(
    """
    import sys, time, logging, torch
    sys.path.insert(0, {tests!r})
    from gradsketch.attribution import TRAKer
    from helpers.attribution import logreg_checkpoints, logreg_data
    x, y = logreg_data(n=200)
    model = torch.nn.Linear(5, 3).double()
    traker = TRAKer(model, "image_classification", 200, save_dir={save!r}, proj_dim=8,
                    device="cpu", progress=False, logging_level=logging.WARNING)
    traker.load_checkpoint(logreg_checkpoints(count=1)[0], 0)
    for s in range(0, 200, 5):
        traker.featurize((x[s:s + 5], y[s:s + 5]), num_samples=5)
        if s % 10 == 5:
            # featurize writes behind; flush() is the point where rows are
            # on disk. Every other batch is still queued when printing.
            traker.store.flush()
            print(s + 5, flush=True)
        time.sleep(0.05)
    """
)


def test_sigkill_mid_featurize_then_resume_computes_only_missing_rows(tmp_path):
    save = tmp_path / "killed"
    code = CHILD.format(tests=os.path.dirname(os.path.dirname(__file__)), save=str(save))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    written = 0
    deadline = time.monotonic() + 60
    while written < 60 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        written = int(line)
    os.kill(proc.pid, signal.SIGKILL)  # mid-run: the child is between or inside writes
    proc.wait()
    proc.stdout.close()
    assert 60 <= written < 200

    x, y = logreg_data(n=200)
    xt, yt = logreg_data(n=5, seed=7)
    state = logreg_checkpoints(count=1)[0]
    model = torch.nn.Linear(5, 3).double()
    traker = TRAKer(
        model,
        "image_classification",
        200,
        save_dir=save,
        proj_dim=8,
        gradient_computer=CountingComputer,
        **QUIET,
    )
    traker.load_checkpoint(state, 0)
    done_before = int(traker.store.done_rows("checkpoints/0/done").sum())
    assert done_before >= written  # every printed batch was flagged after its data
    CountingComputer.rows = 0
    for s in range(0, 200, 5):
        traker.featurize((x[s : s + 5], y[s : s + 5]), num_samples=5)
    assert CountingComputer.rows == 200 - done_before
    traker.finalize_features()
    traker.start_scoring_checkpoint("exp", state, 0, 5)
    traker.score((xt, yt), num_samples=5)
    resumed = traker.finalize_scores("exp")

    _, clean = _run(tmp_path / "clean", model, [state], x, y, xt, yt, batch=5, proj_dim=8)
    # Exact: both runs featurize the same 5-row batches and reduce the same stored rows.
    np.testing.assert_array_equal(resumed, clean)


def test_featurize_errors(tmp_path):
    model = torch.nn.Linear(5, 3).double()
    x, y = logreg_data(n=10)
    traker = TRAKer(model, "image_classification", 10, save_dir=tmp_path, proj_dim=8, **QUIET)
    with pytest.raises(ModelIDException, match="load_checkpoint"):
        traker.featurize((x, y), num_samples=10)
    traker.load_checkpoint(logreg_checkpoints(count=1)[0], 0)
    with pytest.raises(ValueError, match="exactly one of `inds`"):
        traker.featurize((x, y), inds=np.arange(10), num_samples=10)
    with pytest.raises(ValueError, match="exactly one of `inds`"):
        traker.featurize((x, y))
    with pytest.raises(IndexError, match=r"outside \[0, 10\)"):
        traker.featurize((x, y), inds=np.arange(5, 15))
    with pytest.raises(ValueError, match="repeated rows"):
        traker.featurize((x[:2], y[:2]), inds=[1, 1])
    traker.featurize((x[:4], y[:4]), inds=np.array([3, 0, 2, 1]))
    with pytest.raises(ModelIDException, match="6 of 10 rows missing"):
        traker.finalize_features()
    with pytest.raises(ModelIDException, match="model id 5 is not in"):
        traker.finalize_features(model_ids=[5])


def test_scoring_errors_and_allow_skip(tmp_path):
    model = torch.nn.Linear(5, 3).double()
    x, y = logreg_data(n=10)
    a, b = logreg_checkpoints(count=2)
    traker = TRAKer(model, "image_classification", 10, save_dir=tmp_path, proj_dim=8, **QUIET)
    with pytest.raises(ModelIDException, match="start_scoring_checkpoint"):
        traker.score((x, y), num_samples=2)
    with pytest.raises(ValueError, match="experiment 'nope' does not exist"):
        traker.finalize_scores("nope")
    for mid, state in enumerate((a, b)):
        traker.load_checkpoint(state, mid)
        traker.featurize((x, y), num_samples=10)
    traker.finalize_features()
    traker.start_scoring_checkpoint("exp", a, 0, num_targets=3)
    traker.score((x[:3], y[:3]), num_samples=3)
    with pytest.raises(ModelIDException, match=r"model id 1 has no target features.*allow_skip"):
        traker.finalize_scores("exp")
    skipped = traker.finalize_scores("exp", allow_skip=True)
    only0 = traker.finalize_scores("exp", model_ids=[0])
    np.testing.assert_array_equal(skipped, only0)
    with pytest.raises(SettingsMismatchError, match="num_targets=3, requested 4"):
        traker.start_scoring_checkpoint("exp", a, 0, num_targets=4)
    with pytest.raises(ValueError, match="`exp_name` must be"):
        traker.start_scoring_checkpoint("a/b", a, 0, num_targets=4)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        pytest.param(
            {"task": "regression"},
            UnknownTaskError,
            r"known tasks are \['image_classification', 'iterative_image_classification', "
            r"'language_modeling', 'seq2seq_lm', 'text_classification'\]",
            id="task",
        ),
        pytest.param({"saver": object()}, ValueError, "`saver`=.* is not supported", id="saver"),
        pytest.param(
            {"memory_budget": -5}, ValueError, "`memory_budget` must be a positive", id="budget"
        ),
        pytest.param(
            {"grad_wrt": ["nope"]}, ValueError, r"`grad_wrt` names \['nope'\]", id="grad_wrt"
        ),
        pytest.param({"lambda_reg": float("nan")}, ValueError, "`lambda_reg` must be", id="lambda"),
    ],
)
def test_constructor_errors(tmp_path, kwargs, error, match):
    args = {"task": "image_classification", **kwargs}
    with pytest.raises(error, match=match):
        TRAKer(
            torch.nn.Linear(5, 3), train_set_size=4, save_dir=tmp_path, proj_dim=8, **QUIET, **args
        )


def test_projector_on_another_device_warns_then_is_refused_where_devices_would_mix(tmp_path):
    """As trak, a projector built for another device than the TRAKer's is accepted at
    construction, with a warning naming both devices; loading a checkpoint still works, and
    the first featurize (where the devices would mix) refuses it with the same message
    (not a device error deep inside the projection)."""
    model = torch.nn.Linear(5, 3).double()
    match = r"`projector` lives on meta but `device`='cpu'"
    with pytest.warns(UserWarning, match=match):
        traker = TRAKer(
            model,
            "image_classification",
            10,
            save_dir=tmp_path,
            projector=NoOpProjector(device="meta"),
            **QUIET,
        )
    traker.load_checkpoint(model.state_dict(), model_id=0)
    x, y = logreg_data(n=10)
    with pytest.raises(ValueError, match=match):
        traker.featurize((x, y), num_samples=10)


def test_a_store_that_lost_its_settings_record_is_never_reused_under_other_settings(tmp_path):
    """Featurized with projector_seed=0, then settings.json deleted: reopening with seed 1
    is refused with both projectors shown (the seed-0 rows are never scored against seed-1
    targets); reopening with seed 0 restores the record and scores as before."""
    x, y = logreg_data(n=24)
    xt, yt = logreg_data(n=4, seed=9)
    ckpts = logreg_checkpoints(count=1)
    model = torch.nn.Linear(5, 3).double()
    _, first = _run(tmp_path, model, ckpts, x, y, xt, yt, proj_dim=8, projector_seed=0)
    (tmp_path / "settings.json").unlink()
    match = (
        r"settings\.json` is missing.*other settings:\n  projector: stored .*'seed': 0.*requested"
    )
    with pytest.raises(SettingsMismatchError, match=match):
        TRAKer(
            model,
            "image_classification",
            24,
            save_dir=tmp_path,
            proj_dim=8,
            projector_seed=1,
            **QUIET,
        )
    assert not (tmp_path / "settings.json").exists()
    _, again = _run(tmp_path, model, ckpts, x, y, xt, yt, proj_dim=8, projector_seed=0)
    np.testing.assert_array_equal(again, first)
    assert (tmp_path / "settings.json").exists()
