"""HookGradientComputer against FunctionalGradientComputer (vmap) in float64."""

from __future__ import annotations

import functools
import logging
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradsketch.attribution import (
    FunctionalGradientComputer,
    ImageClassificationModelOutput,
    TRAKer,
    TransformerClassifier,
)
from gradsketch.attribution._hook_computer import HookGradientComputer, WrappedModelError
from gradsketch.attribution._layers import (
    GRAD_SAMPLERS,
    HookComputationError,
    register_grad_sampler,
)
from gradsketch.attribution._modelout import (
    AbstractModelOutput,
    TextClassificationModelOutput,
    register_batch_output,
    register_loss_grad_from_output,
)
from gradsketch.demos import build_cnn, build_mlp
from gradsketch.sketch import CountSketchProjector, FactorizedProjector

F64 = torch.float64
TASK = ImageClassificationModelOutput()


#: Two blocks of width 8 over 5 tokens of an 11-word vocabulary, 3 classes.
TinyTransformer = functools.partial(
    TransformerClassifier, vocab=11, width=8, seq=5, layers=2, heads=2, mlp_ratio=2, classes=3
)


class TorchEncoder(nn.Module):
    """nn.TransformerEncoderLayer: its MultiheadAttention has no rule (torch.func fallback)."""

    def __init__(self, vocab: int = 11, width: int = 8, classes: int = 3) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width, padding_idx=0)
        self.enc = nn.TransformerEncoderLayer(width, 2, 16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(width, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.tok(tokens)).mean(-2))


class Reused(nn.Module):
    """One Linear called twice, an in-place ReLU after it, a frozen and an unused parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)
        self.unused = nn.Linear(2, 2)
        self.head.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.lin(F.relu(self.lin(x), inplace=True))))


class LearnedPositions(nn.Module):
    """Positions embedded once as [1, T, D] and broadcast over the batch; an RMSNorm."""

    def __init__(self, vocab: int = 11, seq: int = 5, width: int = 8) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(seq, width)
        self.norm = nn.RMSNorm(width)
        self.head = nn.Linear(width, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)[None]
        return self.head(self.norm(self.tok(tokens) + self.pos(positions)).tanh().mean(1))


def _seeded(make):
    torch.manual_seed(0)
    return make().double().eval()


def image_batch(n: int = 6, width: int = 64):
    gen = torch.Generator().manual_seed(1)
    return torch.randn(n, width, generator=gen, dtype=F64), torch.arange(n) % 3


def token_batch(n: int = 6, seq: int = 5, vocab: int = 11):
    gen = torch.Generator().manual_seed(2)
    return torch.randint(0, vocab, (n, seq), generator=gen), torch.arange(n) % 3


#: The vmap reference warns that it loops over CPU flash attention (exact, only slower).
VMAP_SDPA = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")

CASES = {
    "mlp": (lambda: build_mlp(hidden=16, seed=0), lambda: image_batch()),
    "cnn": (lambda: build_cnn(channels=3, seed=0), lambda: image_batch()),
    "transformer": (TinyTransformer, lambda: token_batch()),
    "torch-encoder": (TorchEncoder, lambda: token_batch()),
    "reused-inplace-frozen": (Reused, lambda: image_batch(width=6)),
    "learned-positions-rmsnorm": (LearnedPositions, lambda: token_batch()),
    # No output requires grad: every layer output needs the zero-add path.
    "all-frozen": (lambda: build_mlp(hidden=16, seed=0).requires_grad_(False), image_batch),
}


@VMAP_SDPA
@pytest.mark.parametrize("case", list(CASES))
def test_per_example_gradients_equal_functional_float64(case):
    make, data = CASES[case]
    model = _seeded(make)
    batch = data()
    expected = FunctionalGradientComputer(model, TASK).compute_per_sample_grad(batch)
    with HookGradientComputer(model, TASK) as gc:
        got = gc.compute_per_sample_grad(batch)
    assert list(got) == list(expected)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-10, atol=1e-12, msg=name)
    assert any(g.abs().sum() > 0 for g in got.values())


def test_batch_of_one_loop_reference_on_transformer():
    """Independent slow reference: autograd on each example alone."""
    model = _seeded(TinyTransformer)
    tokens, labels = token_batch(n=3)
    got = HookGradientComputer(model, TASK).compute_per_sample_grad((tokens, labels))
    for b in range(3):
        logits = model(tokens[b : b + 1])
        margin = logits[0, labels[b]] - logits[0].masked_fill(
            torch.arange(3) == labels[b], float("-inf")
        ).logsumexp(0)
        grads = torch.autograd.grad(margin, list(model.parameters()))
        for (name, _), g in zip(model.named_parameters(), grads):
            torch.testing.assert_close(got[name][b], g, rtol=1e-10, atol=1e-12, msg=name)


@VMAP_SDPA
@pytest.mark.parametrize("case", list(CASES))
def test_factorized_projection_equals_projection_of_functional_gradients(case):
    """Hooks + FactorizedProjector (never forming Linear/Conv gradients) == P(vmap gradients)."""
    make, data = CASES[case]
    model = _seeded(make)
    batch = data()
    projector = FactorizedProjector.from_model(model, k_in=4, k_out=3, seed=7, rest_proj_dim=16)
    expected = projector.project(
        FunctionalGradientComputer(model, TASK).compute_per_sample_grad(batch), 0
    )
    gc = HookGradientComputer(model, TASK)
    got = gc.project(batch, projector, 0)
    assert got.dtype == F64
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    # Any other projector goes through the per-example gradients.
    cs = CountSketchProjector(projector.grad_dim, 32, 0, "cpu")
    torch.testing.assert_close(
        gc.project(batch, cs, 0), cs.project(gc.compute_per_sample_grad(batch), 0)
    )


# -- out-to-loss terms from the hooked forward ---------------------------------------
class _Counted:
    """Counts calls of a model's forward (a hook, removed by ``close``)."""

    def __init__(self, model: nn.Module) -> None:
        self.calls = 0
        self._handle = model.register_forward_hook(self._hook)

    def _hook(self, *args) -> None:
        self.calls += 1

    def close(self) -> None:
        self._handle.remove()


def _task_q(task, model, batch):
    weights = {n: p.detach() for n, p in model.named_parameters()}
    buffers = {n: b.detach() for n, b in model.named_buffers()}
    return task.get_out_to_loss_grad(model, weights, buffers, batch)


@pytest.mark.parametrize("case", ["mlp", "transformer", "reused-inplace-frozen", "all-frozen"])
@pytest.mark.parametrize("through", ["project", "per_sample"])
def test_loss_grad_reuses_the_hooked_forward_exactly(case, through):
    """Q after project / compute_per_sample_grad of the same batch: no second forward, same bits."""
    make, data = CASES[case]
    model = _seeded(make)
    batch = data()
    task = ImageClassificationModelOutput(temperature=1.7)
    expected = _task_q(task, model, batch)
    gc = HookGradientComputer(model, task)
    projector = FactorizedProjector.from_model(model, k_in=3, k_out=3, seed=0)
    counted = _Counted(model)
    for _ in range(2):  # the reuse works batch after batch
        if through == "project":
            gc.project(batch, projector, 0)
        else:
            gc.compute_per_sample_grad(batch)
        before = counted.calls
        q = gc.compute_loss_grad(batch)
        assert counted.calls == before, "compute_loss_grad ran another forward"
        assert q.shape == (batch[0].shape[0], 1)
        assert torch.equal(q, expected)
    # Used once: asking again runs the task's own forward, with the same result.
    before = counted.calls
    assert torch.equal(gc.compute_loss_grad(batch), expected)
    assert counted.calls == before + 1
    counted.close()


def test_loss_grad_not_reused_when_weights_batch_or_task_differ():
    model = _seeded(lambda: build_mlp(hidden=16, seed=0))
    batch = image_batch()
    gc = HookGradientComputer(model, TASK)
    counted = _Counted(model)

    # New weights (in place, as load_state_dict does) after the hooked forward.
    gc.compute_per_sample_grad(batch)
    with torch.no_grad():
        next(model.parameters()).mul_(1.5)
    before = counted.calls
    q = gc.compute_loss_grad(batch)
    assert counted.calls == before + 1
    assert torch.equal(q, _task_q(TASK, model, batch))

    # Another batch object with equal values, or the same batch edited in place.
    gc.compute_per_sample_grad(batch)
    clone = tuple(t.clone() for t in batch)
    before = counted.calls
    assert torch.equal(gc.compute_loss_grad(clone), _task_q(TASK, model, clone))
    assert counted.calls == before + 2  # the fallback and the reference
    gc.compute_per_sample_grad(batch)
    batch[0].mul_(-1.0)
    before = counted.calls
    assert torch.equal(gc.compute_loss_grad(batch), _task_q(TASK, model, batch))
    assert counted.calls == before + 2

    # A subclass may override get_out_to_loss_grad: the registry is keyed by exact type.
    class Halved(ImageClassificationModelOutput):
        def get_out_to_loss_grad(self, model, weights, buffers, batch):
            return super().get_out_to_loss_grad(model, weights, buffers, batch) / 2

    sub = HookGradientComputer(model, Halved())
    sub.compute_per_sample_grad(batch)
    before = counted.calls
    assert torch.equal(sub.compute_loss_grad(batch), _task_q(TASK, model, batch) / 2)
    assert counted.calls == before + 2
    counted.close()


class _LogitsBox:
    """A Hugging Face style output: an object with ``.logits``."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


class _TextModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = TinyTransformer()

    def forward(self, input_ids, token_type_ids, attention_mask):
        return _LogitsBox(self.net(input_ids * attention_mask + token_type_ids))


def test_loss_grad_reuse_for_text_classification_with_logits_attribute():
    model = _seeded(_TextModel)
    tokens, labels = token_batch()
    batch = (tokens, torch.zeros_like(tokens), torch.ones_like(tokens), labels)
    task = TextClassificationModelOutput()
    expected = _task_q(task, model, batch)
    gc = HookGradientComputer(model, task)
    counted = _Counted(model)
    gc.project(batch, FactorizedProjector.from_model(model, k_in=2, k_out=2, seed=0), 0)
    before = counted.calls
    assert torch.equal(gc.compute_loss_grad(batch), expected)
    assert counted.calls == before
    counted.close()


def test_grad_wrt_restricts_gradients_and_factorized_layout():
    model = _seeded(TinyTransformer)
    batch = token_batch()
    wanted = ["tok.weight", "blocks.0.q.weight", "blocks.1.ln2.bias", "head.weight", "head.bias"]
    expected = FunctionalGradientComputer(model, TASK, grad_wrt=wanted).compute_per_sample_grad(
        batch
    )
    gc = HookGradientComputer(model, TASK, grad_wrt=wanted)
    got = gc.compute_per_sample_grad(batch)
    assert list(got) == wanted
    for name in wanted:
        torch.testing.assert_close(got[name], expected[name])
    projector = FactorizedProjector.from_model(model, k_in=3, k_out=3, seed=1, grad_wrt=wanted)
    torch.testing.assert_close(gc.project(batch, projector, 0), projector.project(expected, 0))


def test_float32_features_match_float64():
    model64 = _seeded(TinyTransformer)
    model32 = _seeded(TinyTransformer).float()
    batch = token_batch()
    p = FactorizedProjector.from_model(model64, k_in=4, k_out=4, seed=0)
    ref = HookGradientComputer(model64, TASK).project(batch, p, 0)
    got = HookGradientComputer(model32, TASK).project(batch, p, 0)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


def test_hooks_kept_removed_idempotently_and_moved():
    model = _seeded(TinyTransformer)
    batch = token_batch()
    gc = HookGradientComputer(model, TASK)
    hooked = [m for m in model.modules() if m._forward_hooks]
    units = int(re.search(r"units=(\d+),", repr(gc)).group(1))
    assert gc.hooks_installed and len(hooked) == units
    before = gc.compute_per_sample_grad(batch)
    # Idle hooks do not touch ordinary forwards (no capture, same outputs).
    with torch.no_grad():
        model(batch[0])
    gc.add_hooks()  # idempotent
    assert sum(len(m._forward_hooks) for m in model.modules()) == units
    gc.remove_hooks()
    gc.remove_hooks()
    assert not gc.hooks_installed
    assert all(not m._forward_hooks for m in model.modules())
    with pytest.raises(HookComputationError, match="hooks were removed; call add_hooks"):
        gc.compute_per_sample_grad(batch)
    gc.add_hooks()
    after = gc.compute_per_sample_grad(batch)
    for name in before:
        torch.testing.assert_close(after[name], before[name])
    other = _seeded(TinyTransformer)
    gc.load_model_params(other)
    assert all(not m._forward_hooks for m in model.modules())
    assert any(m._forward_hooks for m in other.modules())
    with gc:
        pass
    assert all(not m._forward_hooks for m in other.modules())


def test_refuses_data_parallel_and_nested_wrappers():
    model = _seeded(TinyTransformer)
    with pytest.raises(WrappedModelError, match=r"wrapped in DataParallel.*Pass `model.module`"):
        HookGradientComputer(nn.DataParallel(model), TASK)
    outer = nn.Sequential(nn.DataParallel(nn.Linear(2, 2)))
    with pytest.raises(WrappedModelError, match="submodule '0' is wrapped in DataParallel"):
        HookGradientComputer(outer, TASK)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable")
def test_refuses_real_ddp_with_a_gloo_group_of_one():
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(build_mlp(hidden=4, seed=0))
        with pytest.raises(WrappedModelError, match=r"DistributedDataParallel.*`model.module`"):
            HookGradientComputer(ddp, TASK)
        HookGradientComputer(ddp.module, TASK).remove_hooks()  # the fix works
    finally:
        dist.destroy_process_group()


class NoBatchTask(AbstractModelOutput):
    """A task with a per-example output only (no batched twin registered)."""

    @staticmethod
    def get_output(model, weights, buffers, *example):
        return torch.func.functional_call(
            model, (weights, buffers), (example[0].unsqueeze(0),)
        ).sum()

    def get_out_to_loss_grad(self, model, weights, buffers, batch):
        return torch.ones(batch[0].shape[0], 1)


class SumTask(NoBatchTask):
    """Same output, with the batched twin as a method."""

    @staticmethod
    def get_batch_output(model, x, y):
        return model(x).sum(-1)


class SeqFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        return self.lin(x.transpose(0, 1)).mean(0)


def test_task_batch_output_method_and_registry():
    model = _seeded(lambda: nn.Linear(4, 2))
    x = torch.randn(5, 4, dtype=F64)
    expected = FunctionalGradientComputer(model, SumTask()).compute_per_sample_grad((x, x))
    got = HookGradientComputer(model, SumTask()).compute_per_sample_grad((x, x))
    torch.testing.assert_close(got["weight"], expected["weight"])

    class Registered(NoBatchTask):
        pass

    register_batch_output(Registered)(lambda model, x, y: model(x).sum(-1))
    got = HookGradientComputer(model, Registered()).compute_per_sample_grad((x, x))
    torch.testing.assert_close(got["weight"], expected["weight"])


def test_custom_grad_sampler_registration_is_used():
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(3, dtype=F64))

        def forward(self, x):
            return x * self.w

    calls = []

    @register_grad_sampler(Scale)
    def scale_grad(module, inputs, grad_output):
        calls.append(1)
        return {"w": (inputs[0] * grad_output).reshape(grad_output.shape[0], -1, 3).sum(1)}

    try:
        model = nn.Sequential(Scale(), nn.Linear(3, 2).double())
        x = torch.randn(4, 3, dtype=F64), torch.arange(4) % 2
        got = HookGradientComputer(model, TASK).compute_per_sample_grad(x)
        expected = FunctionalGradientComputer(model, TASK).compute_per_sample_grad(x)
        assert calls
        torch.testing.assert_close(got["0.w"], expected["0.w"])
    finally:
        del GRAD_SAMPLERS[Scale]


def _tied():
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Linear(4, 3)).double()
    model[2].weight = model[0].weight
    return model


def test_tied_weights_sum_contributions():
    model = _seeded(_tied)
    batch = image_batch(width=4)
    expected = FunctionalGradientComputer(model, TASK).compute_per_sample_grad(batch)
    got = HookGradientComputer(model, TASK).compute_per_sample_grad(batch)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name])


ERRORS = [
    (
        "task-without-batch-output",
        lambda: HookGradientComputer(nn.Linear(2, 2), NoBatchTask()),
        ValueError,
        r"NoBatchTask has no batched output.*`get_batch_output\(model, \*batch\) -> \[B\]`",
    ),
    (
        "grad-wrt",
        lambda: HookGradientComputer(nn.Linear(2, 2), TASK, grad_wrt=["weight", "nope"]),
        ValueError,
        r"`grad_wrt` has names \['nope'\].*allowed names are \['weight', 'bias'\]",
    ),
    (
        "batch-not-first",
        lambda: HookGradientComputer(SeqFirst(), TASK).compute_per_sample_grad(
            (torch.randn(2, 5, 4), torch.tensor([0, 1]))
        ),
        HookComputationError,
        r"module 'lin' \(Linear\) returned shape \(5, 2, 3\) for a batch of 2; .*batch on dim 0",
    ),
    (
        # One position, sequence first: a leading 1 over a floating input is no broadcast.
        "batch-not-first-one-position",
        lambda: HookGradientComputer(SeqFirst(), TASK).compute_per_sample_grad(
            (torch.randn(2, 1, 4), torch.tensor([0, 1]))
        ),
        HookComputationError,
        r"module 'lin' \(Linear\) returned shape \(1, 2, 3\) for a batch of 2; .*batch on dim 0",
    ),
    (
        "projector-params",
        lambda: HookGradientComputer(build_mlp(hidden=4), TASK).project(
            image_batch(),
            FactorizedProjector.from_model(build_mlp(hidden=4), seed=0, grad_wrt=["0.weight"]),
            0,
        ),
        ValueError,
        r"`projector` does not match .* missing \['0.bias', '2.weight'",
    ),
    (
        "projector-shapes",
        lambda: HookGradientComputer(build_mlp(hidden=4), TASK).project(
            image_batch(), FactorizedProjector.from_model(build_mlp(hidden=5), seed=0), 0
        ),
        ValueError,
        r"layer '0': `projector` expects 325 coordinates, the model has 260",
    ),
    (
        "tied-factorized",
        lambda: HookGradientComputer(_tied(), TASK).project(
            image_batch(width=4), FactorizedProjector.from_model(_tied(), seed=0), 0
        ),
        ValueError,
        r"factorized layers \['0'\] share their weight .* Untie the weights",
    ),
    (
        "register-non-module",
        lambda: register_grad_sampler(int),
        TypeError,
        "`module_types` must be nn.Module subclasses, got <class 'int'>",
    ),
    (
        "register-non-task",
        lambda: register_batch_output(nn.Linear),
        TypeError,
        "`task_types` must be AbstractModelOutput subclasses",
    ),
    (
        "register-loss-grad-non-task",
        lambda: register_loss_grad_from_output(nn.Linear),
        TypeError,
        "`task_types` must be AbstractModelOutput subclasses, got <class",
    ),
]


@pytest.mark.parametrize(
    ("make", "exc", "match"), [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS]
)
def test_errors(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


# -- TRAKer -----------------------------------------------------------------------
def _digits_traker_scores(
    tmp_path, name, model, ckpt, split, *, gc, projector, n_train, n_targets, lambda_reg=1e-2
):
    traker = TRAKer(
        model,
        "image_classification",
        n_train,
        save_dir=tmp_path / name,
        device="cpu",
        gradient_computer=gc,
        projector=projector,
        progress=False,
        logging_level=logging.WARNING,
        use_half_precision=False,
        lambda_reg=lambda_reg,
    )
    traker.load_checkpoint(ckpt, model_id=0)
    for start in range(0, n_train, 128):
        stop = min(start + 128, n_train)
        traker.featurize(
            (split.x_train[start:stop], split.y_train[start:stop]), num_samples=stop - start
        )
    traker.finalize_features()
    traker.start_scoring_checkpoint("t", ckpt, model_id=0, num_targets=n_targets)
    traker.score((split.x_test[:n_targets], split.y_test[:n_targets]), num_samples=n_targets)
    return np.asarray(traker.finalize_scores("t"))


@pytest.fixture(scope="module")
def digits_model():
    from gradsketch.demos import TrainSettings, load_digits_split, train_digits_model

    split = load_digits_split(seed=0)
    model = train_digits_model(
        split.x_train, split.y_train, arch="mlp", seed=0, settings=TrainSettings(epochs=4)
    )
    return split, model


def test_plugs_into_traker_same_scores_as_functional_with_same_projector(tmp_path, digits_model):
    """Hooks + FactorizedProjector in TRAKer == vmap + the same projector (same map, exact)."""
    split, model = digits_model
    ckpt = {k: v.clone() for k, v in model.state_dict().items()}
    n_train, n_targets = 400, 20
    projector = FactorizedProjector.from_model(model, k_in=16, k_out=8, seed=0)
    hooks = _digits_traker_scores(
        tmp_path,
        "hooks",
        model,
        ckpt,
        split,
        gc=HookGradientComputer,
        projector=projector,
        n_train=n_train,
        n_targets=n_targets,
    )
    vmap = _digits_traker_scores(
        tmp_path,
        "vmap",
        model,
        ckpt,
        split,
        gc=FunctionalGradientComputer,
        projector=projector,
        n_train=n_train,
        n_targets=n_targets,
    )
    assert hooks.shape == (n_train, n_targets)
    np.testing.assert_allclose(hooks, vmap, rtol=1e-3, atol=1e-4 * np.abs(vmap).max())


def test_traker_defaults_to_count_sketch_with_exactly_proj_dim(tmp_path, digits_model):
    """With no projector both computers get CountSketchProjector(proj_dim) on CPU: exactly
    proj_dim features, and the hook computer's scores are the vmap computer's (same map)."""
    split, model = digits_model
    ckpt = {k: v.clone() for k, v in model.state_dict().items()}
    kw = dict(device="cpu", logging_level=logging.WARNING, progress=False)
    traker = TRAKer(
        model,
        "image_classification",
        10,
        save_dir=tmp_path / "d",
        proj_dim=300,
        **kw,
        gradient_computer=HookGradientComputer,
    )
    assert isinstance(traker.projector, CountSketchProjector)
    assert traker.proj_dim == traker.projector.proj_dim == 300
    runs = {
        name: _digits_traker_scores(
            tmp_path,
            name,
            model,
            ckpt,
            split,
            gc=gc,
            projector=None,
            n_train=200,
            n_targets=5,
        )
        for name, gc in (("hooks", HookGradientComputer), ("vmap", FunctionalGradientComputer))
    }
    ref = runs["vmap"]
    np.testing.assert_allclose(runs["hooks"], ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())
    masked = pytest.importorskip("gradsketch.masked")
    mask = masked.ParamMask.random(model, 0.5, seed=0)
    with_mask = TRAKer(
        model,
        "image_classification",
        10,
        save_dir=tmp_path / "m",
        mask=mask,
        **kw,
        gradient_computer=HookGradientComputer,
    )
    assert type(with_mask.projector).__name__ == "CountSketchProjector"
    vmap = TRAKer(model, "image_classification", 10, save_dir=tmp_path / "v", **kw)
    assert type(vmap.projector).__name__ == "CountSketchProjector"


@pytest.mark.slow
def test_lds_of_hooks_factorized_against_dense_count_sketch(tmp_path):
    """LDS of hooks + FactorizedProjector vs vmap + CountSketchProjector of the same size.

    The demo's protocol: 3 checkpoints, proj_dim below the 1,437 training rows
    (468 here) so lambda_reg=0 works, 30 MLPs retrained on random halves
    (seeded), 50 targets. Both are random projections of the same gradients,
    so their scores differ; what must hold is that both predict retraining
    better than chance (LDS > 0). The two values are printed for the README.
    """
    from gradsketch.attribution import lds_ground_truth, linear_datamodeling_score
    from gradsketch.demos import (
        TrainSettings,
        load_digits_split,
        margins,
        train_digits_model,
    )

    split = load_digits_split(seed=0)
    settings = TrainSettings()
    n_train, n_targets = split.n_train, 50
    models = [
        train_digits_model(split.x_train, split.y_train, arch="mlp", seed=s, settings=settings)
        for s in range(3)
    ]

    def ensemble(name, gc, make_projector):
        total = 0.0
        for s, model in enumerate(models):
            ckpt = {k: v.clone() for k, v in model.state_dict().items()}
            total = total + _digits_traker_scores(
                tmp_path,
                f"{name}{s}",
                model,
                ckpt,
                split,
                gc=gc,
                projector=make_projector(model),
                n_train=n_train,
                n_targets=n_targets,
                lambda_reg=0.0,
            )
        return total

    hooks = ensemble(
        "hooks",
        HookGradientComputer,
        lambda m: FactorizedProjector.from_model(m, k_in=13, k_out=13, seed=0),
    )
    dense = ensemble(
        "dense",
        FunctionalGradientComputer,
        lambda m: CountSketchProjector(sum(p.numel() for p in m.parameters()), 468, 0, "cpu"),
    )
    x_t, y_t = split.x_test[:n_targets], split.y_test[:n_targets]

    def train(idx, seed):
        idx_t = torch.as_tensor(idx)
        return train_digits_model(
            split.x_train[idx_t],
            split.y_train[idx_t],
            arch="mlp",
            seed=100 + seed,
            settings=settings,
        )

    truth = lds_ground_truth(
        train,
        lambda m: margins(m, x_t, y_t).double().numpy(),
        n_train=n_train,
        num_models=30,
        seed=0,
        progress=False,
    )
    lds_hooks = linear_datamodeling_score(hooks, truth.subset_masks, truth.target_outputs)
    lds_dense = linear_datamodeling_score(dense, truth.subset_masks, truth.target_outputs)
    corr = np.corrcoef(hooks.ravel(), dense.ravel())[0, 1]
    print(f"LDS hooks+factorized={lds_hooks:.3f} vmap+countsketch={lds_dense:.3f} corr={corr:.3f}")
    assert lds_hooks > 0 and lds_dense > 0
