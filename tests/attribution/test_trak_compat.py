"""trak 0.3.2 drop-in: IterativeGradientComputer, the "iterative_image_classification" task,
ModelIDException as an AssertionError.

Default tests compare against the explicit float64 formulas of ``helpers.attribution``;
the side-by-side comparisons with trak itself are marked ``bench``.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from gradsketch.attribution import (
    TASK_TO_MODELOUT,
    FunctionalGradientComputer,
    HookGradientComputer,
    ImageClassificationModelOutput,
    IterativeGradientComputer,
    IterativeImageClassificationModelOutput,
    ModelIDException,
    TRAKer,
)
from gradsketch.errors import GradsketchError
from gradsketch.sketch import CountSketchProjector, NoOpProjector
from helpers.attribution import logreg_checkpoints, logreg_data, margin_grad_reference, q_reference

QUIET = {"logging_level": logging.WARNING, "progress": False, "device": "cpu"}


def _logreg(state):
    model = torch.nn.Linear(5, 3).double()
    model.load_state_dict(state)
    return model


def test_iterative_task_is_registered_under_trak_name():
    assert TASK_TO_MODELOUT["iterative_image_classification"] is (
        IterativeImageClassificationModelOutput
    )


def test_iterative_gradients_equal_explicit_float64_formula():
    """``[batch, grad_dim]`` (trak's shape, parameters in model order) equal to the margin
    gradient written out by hand, and ``Q = 1 - p_y``."""
    x, y = logreg_data(n=12)
    (state,) = logreg_checkpoints(count=1)
    task = IterativeImageClassificationModelOutput()
    gc = IterativeGradientComputer(_logreg(state), task, 18, torch.float64, "cpu")
    grads = gc.compute_per_sample_grad((x, y))
    assert grads.shape == (12, 18) and grads.dtype == torch.float64
    torch.testing.assert_close(grads, margin_grad_reference(state, x, y), rtol=1e-12, atol=1e-14)
    q = gc.compute_loss_grad((x, y))
    assert q.shape == (12, 1)
    torch.testing.assert_close(q[:, 0], q_reference(state, x, y), rtol=1e-12, atol=1e-14)


def test_iterative_gradients_honour_grad_wrt_and_checkpoints():
    """Only the selected parameters (trak ignores grad_wrt); load_model_params takes a new one."""
    x, y = logreg_data(n=6)
    first, second = logreg_checkpoints(count=2)
    model = _logreg(first)
    task = IterativeImageClassificationModelOutput()
    gc = IterativeGradientComputer(model, task, 3, torch.float64, "cpu", grad_wrt=["bias"])
    torch.testing.assert_close(
        gc.compute_per_sample_grad((x, y)), margin_grad_reference(first, x, y)[:, 15:]
    )
    model.load_state_dict(second)
    gc.load_model_params(model)
    torch.testing.assert_close(
        gc.compute_per_sample_grad((x, y)), margin_grad_reference(second, x, y)[:, 15:]
    )
    with pytest.raises(ValueError, match=r"`grad_wrt` has names \['nope'\]"):
        IterativeGradientComputer(model, task, 3, torch.float64, "cpu", grad_wrt=["nope"])


def test_unused_parameter_has_zero_gradient():
    class WithSpare(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(5, 3).double()
            self.spare = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))

        def forward(self, x):
            return self.lin(x)

    x, y = logreg_data(n=4)
    gc = IterativeGradientComputer(
        WithSpare(), IterativeImageClassificationModelOutput(), 20, torch.float64, "cpu"
    )
    grads = gc.compute_per_sample_grad((x, y))
    # Model order: the module's own `spare` first, then `lin.weight`, `lin.bias`.
    assert grads.shape == (4, 20) and torch.equal(grads[:, :2], torch.zeros(4, 2).double())
    assert grads[:, 2:].abs().sum() > 0


def test_iterative_task_works_with_the_other_computers():
    """Given one example (vmap) it returns a scalar; the vmap and hook computers then give the
    same gradients as the iterative one, and as the image-classification task."""
    x, y = logreg_data(n=7)
    (state,) = logreg_checkpoints(count=1)
    task = IterativeImageClassificationModelOutput()
    model = _logreg(state)
    w, b = dict(model.named_parameters()), dict(model.named_buffers())
    assert task.get_output(model, w, b, x[0], y[0]).shape == ()
    ref = margin_grad_reference(state, x, y)
    for cls in (FunctionalGradientComputer, HookGradientComputer):
        for t in (task, ImageClassificationModelOutput()):
            grads = cls(model, t, 18, torch.float64, "cpu").compute_per_sample_grad((x, y))
            flat = torch.cat([g.flatten(1) for g in grads.values()], dim=1)
            torch.testing.assert_close(flat, ref, rtol=1e-12, atol=1e-14)


class _ColumnOutput(IterativeImageClassificationModelOutput):
    """A task returning ``[batch, 1]`` instead of ``[batch]``."""

    @staticmethod
    def get_output(model, weights, buffers, *batch):
        return IterativeImageClassificationModelOutput.get_output(model, weights, buffers, *batch)[
            :, None
        ]


def test_bad_task_output_shape_is_refused():
    x, y = logreg_data(n=3)
    (state,) = logreg_checkpoints(count=1)
    gc = IterativeGradientComputer(_logreg(state), _ColumnOutput(), 18)
    with pytest.raises(ValueError, match=r"needs one output per example, \[batch\]"):
        gc.compute_per_sample_grad((x, y))


def _scores(tmp_path, name, gradient_computer, task, state, x, y, xt, yt):
    model = _logreg(state)
    traker = TRAKer(
        model,
        task,
        len(x),
        save_dir=tmp_path / name,
        projector=NoOpProjector(),
        lambda_reg=0.1,
        gradient_computer=gradient_computer,
        **QUIET,
    )
    traker.load_checkpoint(state, model_id=0)
    for s in range(0, len(x), 8):
        traker.featurize((x[s : s + 8], y[s : s + 8]), num_samples=len(x[s : s + 8]))
    traker.finalize_features()
    traker.start_scoring_checkpoint("exp", state, model_id=0, num_targets=len(xt))
    traker.score((xt, yt), num_samples=len(xt))
    return np.asarray(traker.finalize_scores("exp"), dtype=np.float64)


def test_traker_with_iterative_computer_equals_functional(tmp_path):
    """A trak script on the non-functorch path runs unchanged and scores as the default one."""
    x, y = logreg_data(n=24)
    xt, yt = logreg_data(n=4, seed=9)
    (state,) = logreg_checkpoints(count=1)
    ours = _scores(
        tmp_path,
        "it",
        IterativeGradientComputer,
        "iterative_image_classification",
        state,
        x,
        y,
        xt,
        yt,
    )
    ref = _scores(
        tmp_path, "fn", FunctionalGradientComputer, "image_classification", state, x, y, xt, yt
    )
    np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-9 * np.abs(ref).max())


def test_forgetting_load_checkpoint_raises_an_assertion_error(tmp_path):
    """trak raises AssertionError there and its users catch that; we keep our class too."""
    x, y = logreg_data(n=8)
    traker = TRAKer(
        torch.nn.Linear(5, 3).double(), "image_classification", 8, save_dir=tmp_path, **QUIET
    )
    with pytest.raises(AssertionError, match=r"no checkpoint loaded; call traker.load_checkpoint"):
        traker.featurize((x, y), num_samples=8)
    # trak's own tests match its phrase at the start of the message; ours follows it.
    trak = r"^Load a checkpoint using traker.load_checkpoint before featurizing: no checkpoint"
    with pytest.raises(AssertionError, match=trak):
        traker.featurize((x, y), num_samples=8)
    with pytest.raises(AssertionError, match=trak):
        traker.featurize_loader([(x, y)])
    assert issubclass(ModelIDException, AssertionError)
    assert issubclass(ModelIDException, GradsketchError)
    assert issubclass(ModelIDException, RuntimeError)


# ---------------------------------------------------------------------- bench: trak
@pytest.mark.bench
def test_bench_iterative_computer_matches_trak(tmp_path):
    """trak's IterativeGradientComputer and task on the same float32 model: same gradients
    (trak's flat [batch, grad_dim] layout) and out-to-loss terms; missing load_checkpoint
    raises AssertionError in both."""
    trak_gc = pytest.importorskip("trak.gradient_computers")
    trak_mo = pytest.importorskip("trak.modelout_functions")
    trak = pytest.importorskip("trak")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    x = torch.randn(6, 5)
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    d = sum(p.numel() for p in model.parameters())
    theirs = trak_gc.IterativeGradientComputer(
        model,
        trak_mo.TASK_TO_MODELOUT["iterative_image_classification"](),
        d,
        torch.float32,
        "cpu",
    )
    ours = IterativeGradientComputer(
        model, TASK_TO_MODELOUT["iterative_image_classification"](), d, torch.float32, "cpu"
    )
    torch.testing.assert_close(
        ours.compute_per_sample_grad((x, y)),
        theirs.compute_per_sample_grad((x, y)),
        rtol=1e-6,
        atol=1e-7,
    )
    torch.testing.assert_close(ours.compute_loss_grad((x, y)), theirs.compute_loss_grad((x, y)))
    for cls, name in ((trak.TRAKer, "theirs"), (TRAKer, "ours")):
        extra = {"progress": False} if cls is TRAKer else {}
        traker = cls(
            model,
            "image_classification",
            6,
            save_dir=str(tmp_path / name),
            device="cpu",
            projector=NoOpProjector() if cls is TRAKer else None,
            use_half_precision=False,
            logging_level=logging.WARNING,
            **extra,
        )
        with pytest.raises(AssertionError):
            traker.featurize((x, y), num_samples=6)


def test_a_cpu_projector_with_a_cuda_device_is_accepted_until_devices_would_mix(tmp_path):
    """trak's test_class_init / test_load_ckpt: TRAKer(..., projector=<a CPU projector>,
    device="cuda:0") constructs with a warning and loads (and reloads) checkpoints; the first
    featurize refuses it naming both devices, before anything touches CUDA (so this runs
    without a GPU)."""
    model = torch.nn.Linear(5, 3)
    projector = CountSketchProjector(18, 8, 0, "cpu")
    match = r"`projector` lives on cpu but `device`='cuda:0'"
    with pytest.warns(UserWarning, match=match):
        traker = TRAKer(
            model,
            "image_classification",
            8,
            save_dir=tmp_path,
            projector=projector,
            device="cuda:0",
            logging_level=logging.WARNING,
            progress=False,
        )
    for _ in range(2):
        traker.load_checkpoint(model.state_dict(), model_id=0)
    x, y = logreg_data(n=8)
    with pytest.raises(ValueError, match=match):
        traker.featurize((x.float(), y), num_samples=8)
