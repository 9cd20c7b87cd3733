"""Gradient computers and model outputs against batch-of-one float64 loops."""

from __future__ import annotations

import pytest
import torch

from gradsketch.attribution import (
    FunctionalGradientComputer,
    ImageClassificationModelOutput,
    TextClassificationModelOutput,
    register_task,
)
from gradsketch.attribution._modelout import AbstractModelOutput, resolve_task
from gradsketch.sketch import CountSketchProjector
from helpers.attribution import logreg_checkpoints, logreg_data, margin_grad_reference, q_reference


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4)
    ).double()


def _loop_grads(model, x, y, names):
    """Reference: autograd on one example at a time."""
    task = ImageClassificationModelOutput()
    params = dict(model.named_parameters())
    rows = []
    for i in range(len(x)):
        out = task.get_output(model, params, dict(model.named_buffers()), x[i], y[i])
        grads = torch.autograd.grad(out, [params[n] for n in names])
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
    return torch.stack(rows)


@pytest.mark.parametrize("grad_wrt", [None, ["2.weight", "0.bias"]])
def test_vmap_grads_match_loop(grad_wrt):
    model = _mlp()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 4, (7,), generator=g)
    gc = FunctionalGradientComputer(model, ImageClassificationModelOutput(), grad_wrt=grad_wrt)
    grads = gc.compute_per_sample_grad((x, y))
    names = [n for n, _ in model.named_parameters() if grad_wrt is None or n in grad_wrt]
    assert list(grads) == names  # model order, only the requested ones
    flat = torch.cat([grads[n].reshape(7, -1) for n in names], dim=1)
    torch.testing.assert_close(flat, _loop_grads(model, x, y, names))


def test_grad_wrt_passes_other_parameters_as_constants():
    model = _mlp()
    gc = FunctionalGradientComputer(model, ImageClassificationModelOutput(), grad_wrt=["2.bias"])
    assert list(gc.func_weights) == ["2.bias"]
    assert {"0.weight", "0.bias", "2.weight"} <= set(gc.func_buffers)


def test_margin_and_q_match_explicit_formula():
    x, y = logreg_data(n=9)
    state = logreg_checkpoints(count=1)[0]
    model = torch.nn.Linear(5, 3).double()
    model.load_state_dict(state)
    gc = FunctionalGradientComputer(model, ImageClassificationModelOutput())
    grads = gc.compute_per_sample_grad((x, y))
    flat = torch.cat([grads["weight"].reshape(9, -1), grads["bias"]], dim=1)
    torch.testing.assert_close(flat, margin_grad_reference(state, x, y))
    torch.testing.assert_close(gc.compute_loss_grad((x, y)).reshape(-1), q_reference(state, x, y))


def test_default_project_equals_projecting_grads():
    model = _mlp().float()
    x, y = torch.randn(5, 6), torch.tensor([0, 1, 2, 3, 0])
    gc = FunctionalGradientComputer(model, ImageClassificationModelOutput())
    proj = CountSketchProjector(sum(p.numel() for p in model.parameters()), 16, 0, "cpu")
    a = gc.project((x, y), proj, model_id=0)
    b = proj.project(gc.compute_per_sample_grad((x, y)), model_id=0)
    torch.testing.assert_close(a, b)


class _TinyText(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 3)

    def forward(self, input_ids, token_type_ids, attention_mask):
        h = (self.emb(input_ids) * attention_mask[..., None]).sum(1)
        return self.head(h + token_type_ids.sum(1, keepdim=True))


def test_text_classification_grads_match_loop():
    torch.manual_seed(0)
    model = _TinyText().double()
    ids = torch.randint(0, 10, (4, 5))
    tt = torch.zeros(4, 5, dtype=torch.float64)
    am = torch.ones(4, 5, dtype=torch.float64)
    y = torch.tensor([0, 2, 1, 0])
    task = TextClassificationModelOutput()
    gc = FunctionalGradientComputer(model, task)
    grads = gc.compute_per_sample_grad((ids, tt, am, y))
    params = dict(model.named_parameters())
    for i in range(4):
        out = task.get_output(model, params, {}, ids[i], tt[i], am[i], y[i])
        ref = torch.autograd.grad(out, list(params.values()))
        for (name, _), r in zip(params.items(), ref):
            torch.testing.assert_close(grads[name][i], r)
    q = gc.compute_loss_grad((ids, tt, am, y))
    p = torch.softmax(model(ids, tt, am), 1)[torch.arange(4), y]
    torch.testing.assert_close(q.reshape(-1), (1 - p).detach())


def test_unknown_grad_wrt_lists_allowed_names():
    with pytest.raises(ValueError, match=r"allowed names are \['0.weight', '0.bias'"):
        FunctionalGradientComputer(_mlp(), ImageClassificationModelOutput(), grad_wrt=["w"])


def test_task_registry():
    @register_task("my_task")
    class MyTask(ImageClassificationModelOutput):
        pass

    assert isinstance(resolve_task("my_task"), MyTask)
    with pytest.raises(ValueError, match=r"known tasks are .*'my_task'"):
        resolve_task("other")
    with pytest.raises(TypeError, match="must subclass AbstractModelOutput"):
        register_task("bad")(int)  # type: ignore[arg-type]
    from gradsketch.attribution import TASK_TO_MODELOUT

    del TASK_TO_MODELOUT["my_task"]


def test_temperature_must_be_positive():
    with pytest.raises(ValueError, match="`temperature` must be > 0"):
        ImageClassificationModelOutput(temperature=0.0)
    assert issubclass(TextClassificationModelOutput, AbstractModelOutput)


def test_a_task_registers_once_and_the_old_tables_are_views_of_it():
    """register_task fills the task's record; TASK_TO_MODELOUT, BATCH_OUTPUTS... read it."""
    from gradsketch.attribution import (
        LOSS_GRAD_FROM_OUTPUT,
        SAMPLED_LOSSES,
        TASK_TO_MODELOUT,
        TRAINING_LOSSES,
    )
    from gradsketch.attribution._modelout import BATCH_OUTPUTS
    from gradsketch.attribution._task import TASKS, task_protocol, unregister_task

    def batch_output(model, x, y):
        return model(x).sum(-1)

    def training_loss(task, model, x, y):
        return model(x).pow(2).sum(-1)

    @register_task("squared_task", batch_output=batch_output, training_loss=training_loss)
    class Squared(ImageClassificationModelOutput):
        pass

    try:
        assert TASK_TO_MODELOUT["squared_task"] is Squared
        assert BATCH_OUTPUTS[Squared] is batch_output
        assert TRAINING_LOSSES[Squared] is training_loss
        protocol = task_protocol(Squared())
        # Inherited slots come from the nearest registered base; Q from the output is exact-type.
        assert protocol.sampled_loss is SAMPLED_LOSSES[ImageClassificationModelOutput]
        assert protocol.loss_grad_from_output is None
        LOSS_GRAD_FROM_OUTPUT[Squared] = LOSS_GRAD_FROM_OUTPUT[ImageClassificationModelOutput]
        assert task_protocol(Squared).loss_grad_from_output is not None
        del TRAINING_LOSSES[Squared]
        assert TASKS[Squared].training_loss is None
        with pytest.raises(ValueError, match="`slot` must be one of"):
            register_task("x", no_such_slot=1)
    finally:
        unregister_task("squared_task")
    assert Squared not in TASKS and "squared_task" not in TASK_TO_MODELOUT


class _Flaky(ImageClassificationModelOutput):
    """Margins whose per-example output (vmap) and batched output (hooks) fail on demand."""

    fail_vmap = True
    fail_hooks = False

    @staticmethod
    def get_output(model, weights, buffers, *example):
        if _Flaky.fail_vmap:
            raise RuntimeError("vmap cannot trace this")
        return ImageClassificationModelOutput.get_output(model, weights, buffers, *example)

    @staticmethod
    def get_batch_output(model, images, labels):
        if _Flaky.fail_hooks:
            raise RuntimeError("the hooks fail too")
        return ImageClassificationModelOutput.batch_logits(model, None, (images,)).sum(-1)


def test_a_batch_neither_path_computes_switches_nothing(caplog):
    """vmap -> hooks is decided only by a batch vmap fails on and the hooks then compute."""
    model = _mlp()
    x, y = torch.randn(3, 6, dtype=torch.float64), torch.tensor([0, 1, 2])
    gc = FunctionalGradientComputer(model, _Flaky())
    _Flaky.fail_vmap, _Flaky.fail_hooks = True, True
    try:
        with pytest.raises(RuntimeError, match="the hooks fail too"):
            gc.compute_per_sample_grad((x, y))
        assert gc.hooks is None and gc._vmap.ok is None
        assert not any(m._forward_hooks for m in model.modules())  # the trial hooks are gone
        assert "now come from layer hooks" not in caplog.text
        _Flaky.fail_vmap, _Flaky.fail_hooks = False, False
        gc.compute_per_sample_grad((x, y))
        assert gc.hooks is None and gc._vmap.ok is True
        _Flaky.fail_vmap = True
        with caplog.at_level("WARNING"):
            gc.compute_per_sample_grad((x, y))
        assert gc.hooks is not None and gc._vmap.ok is False
        assert "now come from layer hooks" in caplog.text
    finally:
        _Flaky.fail_vmap, _Flaky.fail_hooks = True, False
        if gc.hooks is not None:
            gc.hooks.remove_hooks()


# -- bad batches are named before any forward pass ------------------------------------
def _classifier():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 10))


BAD_BATCHES = [
    pytest.param(
        lambda: (torch.randn(4, 5), torch.tensor([0, 1, 2, 3])),
        r"`batch\[0\] \(the images\)` has shape \(4, 5\): 5 features per example, but the "
        r"model's first layer '0' \(Linear\(in_features=6.*expects 6\. Pass inputs of width 6",
        id="width",
    ),
    pytest.param(
        lambda: (torch.randn(4, 6, dtype=torch.float64), torch.tensor([0, 1, 2, 3])),
        r"is torch\.float64 but the model's parameters are torch\.float32.*Cast the inputs "
        r"with `\.to\(torch\.float32\)`",
        id="dtype",
    ),
    pytest.param(
        lambda: (torch.randn(4, 6), torch.tensor([0, 1, 10, 3])),
        r"holds label 10, but the model has 10 classes \(labels 0 to 9\)\. Fix the labels",
        id="label-range",
    ),
    pytest.param(
        lambda: (torch.randn(4, 6), torch.tensor([0, -1, 2, 3])),
        r"holds label -1; class labels are 0, 1, \.\.\.",
        id="negative-label",
    ),
]


@pytest.mark.parametrize("make_batch, message", BAD_BATCHES)
@pytest.mark.parametrize("computer", ["vmap", "hooks"])
def test_bad_batches_are_named_before_the_forward(make_batch, message, computer):
    """Width, dtype and label range come from the model; the computer is not switched."""
    from gradsketch.attribution import HookGradientComputer
    from gradsketch.errors import BatchFormatError

    model = _classifier()
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    cls = FunctionalGradientComputer if computer == "vmap" else HookGradientComputer
    gc = cls(model, ImageClassificationModelOutput())
    with pytest.raises(BatchFormatError, match=message):
        gc.compute_per_sample_grad(make_batch())
    assert not calls  # refused before any forward pass
    if computer == "vmap":
        assert gc.hooks is None and gc._vmap.ok is None
        grads = gc.compute_per_sample_grad((torch.randn(4, 6), torch.tensor([0, 1, 9, 3])))
        assert gc.hooks is None and grads["0.weight"].shape == (4, 8, 6)


@pytest.mark.parametrize("make_batch, message", BAD_BATCHES[:3])
def test_featurize_names_a_bad_batch_and_keeps_going(tmp_path, make_batch, message):
    """TRAKer.featurize refuses the bad batch; the next good batch is featurized by vmap."""
    from gradsketch.attribution import TRAKer
    from gradsketch.errors import BatchFormatError

    model = _classifier()
    traker = TRAKer(model, "image_classification", 8, save_dir=tmp_path, proj_dim=8, progress=False)
    traker.load_checkpoint(model.state_dict(), model_id=0)
    with pytest.raises(BatchFormatError, match=message):
        traker.featurize(make_batch(), inds=[0, 1, 2, 3])
    traker.featurize((torch.randn(8, 6), torch.arange(8)), num_samples=8)
    gc = traker.gradient_computer
    assert isinstance(gc, FunctionalGradientComputer) and gc.hooks is None
