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
