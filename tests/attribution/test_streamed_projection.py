"""Layer hooks projecting each layer's per-example gradient as it comes, against float64 references.

``HookGradientComputer.project`` with a flat projector (count sketch, sparse
or dense JL, no-op) accumulates every hooked call's per-example gradient at
its parameters' offsets and drops it: by linearity
(``P concat(g_1, g_2) = P_1 g_1 + P_2 g_2``, a tied weight's two uses summed)
that is ``projector.project(per_example_gradients)`` up to the order of the
float additions. In float64 each output coordinate is a sum of at most
``d`` (< 10^4 here) products on both sides; reordering such a sum moves it by
at most ``d * eps * sum|terms|`` (``eps = 1.1e-16``), below ``1e-11`` times the
largest output, so ``rtol = atol / max|ref| = 1e-10`` leaves a margin of ten.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradsketch.attribution import (
    FunctionalGradientComputer,
    HookGradientComputer,
    ImageClassificationModelOutput,
    LanguageModelingModelOutput,
    _hook_computer,
)
from gradsketch.masked import ParamMask
from gradsketch.sketch import (
    BasicProjector,
    CountSketchProjector,
    NoOpProjector,
    SparseProjector,
)

F64 = torch.float64
TASK = ImageClassificationModelOutput()


class Scale(nn.Module):
    """A module with a direct parameter and no rule: its gradients come from torch.func."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


class TiedTokens(nn.Module):
    """Embedding (with padding) tied to the output head; LayerNorm, Linear and a fallback unit."""

    def __init__(self, vocab: int = 13, width: int = 6) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width, padding_idx=0)
        self.norm = nn.LayerNorm(width)
        self.mix = nn.Linear(width, width)
        self.scale = Scale(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight
        self.out = nn.Linear(vocab, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.scale(torch.tanh(self.mix(self.norm(self.tok(tokens)))))
        return self.out(self.head(h).mean(1))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return TiedTokens().double().eval()


def _batch(n: int = 5):
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, 13, (n, 7), generator=gen), torch.arange(n) % 3


def _grad_dim(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


PROJECTORS = {
    "countsketch": lambda d: CountSketchProjector(d, 32, 0, "cpu"),
    "countsketch-hashed": lambda d: CountSketchProjector(d, 32, 0, "cpu", materialize=False),
    "sparse-nnz3": lambda d: SparseProjector(d, 32, 0, 3, "cpu"),
    "dense": lambda d: BasicProjector(d, 16, 0, "rademacher", "cpu", dtype=F64),
    "noop": lambda d: NoOpProjector(d, device="cpu"),
}


def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal up to the order of float64 additions (module docstring)."""
    scale = float(ref.abs().max())
    assert scale > 0
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10 * scale)


@pytest.mark.parametrize("kind", list(PROJECTORS))
def test_streamed_projection_equals_projected_functional_gradients(kind, monkeypatch):
    """Tied head + embedding rows + chunked weights + a fallback unit, never the flat gradient."""
    model, batch = _model(), _batch()
    ref_grads = FunctionalGradientComputer(model, TASK).compute_per_sample_grad(batch)
    projector = PROJECTORS[kind](_grad_dim(model))
    expected = projector.project(ref_grads, model_id=0)
    # A few rows per chunk, so the head's weight is handed on in several pieces.
    monkeypatch.setattr(_hook_computer, "REST_CHUNK_BYTES", 5 * 6 * 8 * 3)
    with HookGradientComputer(model, TASK) as gc:

        def refuse(batch):
            raise AssertionError("the streamed path must not build every per-example gradient")

        monkeypatch.setattr(gc, "compute_per_sample_grad", refuse)
        got = gc.project(batch, projector, 0)
    assert got.dtype == F64
    _close(got, expected)


def test_streamed_projection_of_frozen_and_selected_parameters():
    """``grad_wrt`` lays out only the selected parameters, in model order."""
    model, batch = _model(), _batch()
    wanted = ["tok.weight", "scale.gain", "out.bias"]
    ref = FunctionalGradientComputer(model, TASK, grad_wrt=wanted).compute_per_sample_grad(batch)
    d = sum(g[0].numel() for g in ref.values())
    projector = CountSketchProjector(d, 16, 3, "cpu")
    with HookGradientComputer(model, TASK, grad_wrt=wanted) as gc:
        got = gc.project(batch, projector, 0)
    _close(got, projector.project(ref, model_id=0))


def test_masked_projector_takes_the_dense_path():
    """A mask selects entries of each parameter: the mapping is projected whole, as before."""
    model, batch = _model(), _batch()
    masks = {
        n: (torch.arange(p.numel()) % 2 == 0).reshape(p.shape) for n, p in model.named_parameters()
    }
    mask = ParamMask(masks)
    projector = CountSketchProjector(mask.numel, 16, 0, "cpu", mask=mask)
    assert not projector.streams_by_coordinates
    ref = FunctionalGradientComputer(model, TASK).compute_per_sample_grad(batch)
    with HookGradientComputer(model, TASK) as gc:
        got = gc.project(batch, projector, 0)
    _close(got, projector.project(ref, model_id=0))


def test_streamed_projection_refuses_a_projector_of_another_width():
    model, batch = _model(), _batch()
    d = _grad_dim(model)
    with HookGradientComputer(model, TASK) as gc:
        with pytest.raises(ValueError, match=rf"{d} coordinates .*grad_dim={d + 1}; build it"):
            gc.project(batch, CountSketchProjector(d + 1, 16, 0, "cpu"), 0)


def test_streamed_projection_on_gpt2_with_padding():
    """GPT-2's Conv1D (weight stored transposed), learned positions, tied head, padded batch."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=8, n_head=2, vocab_size=29, n_positions=8)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).double().eval()
    task = LanguageModelingModelOutput()
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 29, (3, 6), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    batch = task.as_batch({"input_ids": ids, "attention_mask": mask})
    projector = CountSketchProjector(_grad_dim(model), 32, 0, "cpu")
    with HookGradientComputer(model, task) as gc:
        expected = projector.project(gc.compute_per_sample_grad(batch), model_id=0)
        got = gc.project(batch, projector, 0)
    _close(got, expected)


class Branchy(nn.Module):
    """Data-dependent control flow: ``vmap`` cannot trace it, the hooks take over."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if bool((h > 100).any()):
            h = h * 0
        return self.b(torch.tanh(h))


def test_functional_switch_projects_through_the_hooks_stream(monkeypatch, caplog):
    """The batch vmap fails on is streamed by the hooks, and its Q reuses their forward."""
    torch.manual_seed(0)
    model = Branchy().double().eval()
    gen = torch.Generator().manual_seed(3)
    batch = (torch.randn(5, 4, generator=gen, dtype=F64), torch.arange(5) % 3)
    with HookGradientComputer(model, TASK) as hooks:
        ref_grads = hooks.compute_per_sample_grad(batch)
        ref_q = hooks.compute_loss_grad(batch)
    projector = CountSketchProjector(_grad_dim(model), 16, 0, "cpu")
    gc = FunctionalGradientComputer(model, TASK)

    def refuse(self, batch):
        raise AssertionError("the switch must stream, not build every per-example gradient")

    monkeypatch.setattr(HookGradientComputer, "compute_per_sample_grad", refuse)
    got = gc.project(batch, projector, 0)
    assert gc.hooks is not None
    _close(got, projector.project(ref_grads, model_id=0))
    forwards = []
    gc.hooks.model.register_forward_hook(lambda *args: forwards.append(1))
    assert torch.equal(gc.compute_loss_grad(batch), ref_q)
    assert forwards == []  # the hooked forward's output was reused
    gc.hooks.remove_hooks()
