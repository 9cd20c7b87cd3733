"""K-FAC / EK-FAC over the stacked expert weights of mixture-of-experts models.

Mixtral, Qwen2-MoE, OLMoE... keep their experts as 3-D parameters
``W [E, d_out, d_in]`` called as ``F.linear(x_routed, W[e])``; every slice
``W[e]`` is a factored layer of its own. Checked in float64 on tiny random
models (2 layers, width 32, 4 experts, top-2, right-padded batches):

* the stored features of the stacked weights are their per-example
  gradients (a loop of single-example backward passes; both gradient
  computers), flattened row-major;
* TRAKer's K-FAC / EK-FAC scores equal an explicit dense reference: per
  layer (per expert) ``A`` and ``S`` summed by hand from each example's
  captured inputs and output gradients, taken alone (so an expert's rows
  are exactly the example's, with no padding), eigendecompositions,
  EK-FAC's corrected eigenvalues ``diag(Qᵀ F Q)`` and ``torch.linalg.solve``
  of ``H + λI``;
* an expert no example is routed to gives zero rows and finite scores,
  also without damping;
* transformers' transposed ``[E, d_in, d_out]`` experts with a bias
  (gpt-oss: ``x @ W[e] + B[e]``) are ``[dW[e]ᵀ | dB[e]]`` per expert; stacked
  weights called any other way are refused with the ways out.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

transformers = pytest.importorskip("transformers")

from gradsketch.attribution import (  # noqa: E402
    FunctionalGradientComputer,
    HookGradientComputer,
    ImageClassificationModelOutput,
    TRAKer,
)
from gradsketch.attribution._fisher import INFLUENCE_OUTPUTS, find_task_entry  # noqa: E402
from gradsketch.attribution._kronecker_features import KroneckerFeaturizer  # noqa: E402
from gradsketch.attribution._layer_capture import capture_layers, find_layers  # noqa: E402
from gradsketch.attribution._layers import (  # noqa: E402
    WHOLE_MODULES,
    HookComputationError,
    register_whole_module,
)
from gradsketch.attribution._lm import LanguageModelingModelOutput  # noqa: E402
from gradsketch.attribution._lm_data import as_task_batch  # noqa: E402
from gradsketch.attribution._modelout import resolve_batch_output  # noqa: E402
from helpers.hf_families import Family, _decoder, float64_case  # noqa: E402
from helpers.launch import one_thread  # noqa: E402

F64 = torch.float64
#: Per-layer "auto" damping: this fraction of each layer's mean eigenvalue.
AUTO_FRACTION = 0.3
SMALL = {"hidden_size": 32, "num_key_value_heads": 2, "experts_implementation": "eager"}
FAMILIES = {
    "mixtral": Family(
        "mixtral",
        _decoder("MixtralConfig", intermediate_size=8, num_local_experts=4, **SMALL),
        "MixtralForCausalLM",
        "lm",
        rtol=1e-5,
    ),
    "qwen2_moe": Family(
        "qwen2_moe",
        _decoder(
            "Qwen2MoeConfig",
            intermediate_size=32,
            num_experts=4,
            moe_intermediate_size=8,
            shared_expert_intermediate_size=32,
            **SMALL,
        ),
        "Qwen2MoeForCausalLM",
        "lm",
        rtol=1e-5,
    ),
}


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Models this small run fastest on one thread (and do not fight for shared cores)."""
    with one_thread():
        yield


@functools.cache
def _case(name: str) -> tuple[nn.Module, Any, tuple[Tensor, ...], dict[str, Tensor]]:
    """A family's float64 model, task, padded 4-example batch and loop gradients."""
    return float64_case(FAMILIES[name])


def _stacked(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.dim() == 3]


def _featurizer(model: nn.Module, task: Any, grad_wrt: list[str] | None) -> KroneckerFeaturizer:
    return KroneckerFeaturizer(
        model,
        task,
        grad_wrt=grad_wrt,
        projection=None,
        projection_seed=0,
        curvature="loss",
        sample_seed=0,
        device=torch.device("cpu"),
        dtype=F64,
    )


def _block(featurizer: KroneckerFeaturizer, features: Tensor, param: str) -> Tensor:
    """The columns of a stacked weight: its experts' layers, one after another."""
    experts = [x for x in featurizer.layers if x.param == param]
    assert [x.expert for x in experts] == list(range(len(experts)))
    assert all(b.offset == a.offset + a.width for a, b in itertools.pairwise(experts))
    return features[:, experts[0].offset : experts[-1].offset + experts[-1].width]


def _influence_output(task: Any) -> Any:
    """The output influence differentiates: the summed log-likelihood for language models."""
    override = find_task_entry(INFLUENCE_OUTPUTS, task)
    return resolve_batch_output(task) if override is None else override[0]


def _out_to_loss(model: nn.Module, task: Any, batch: tuple[Tensor, ...]) -> Tensor:
    """Q of influence: 1 for language models (the loss is minus the log-likelihood)."""
    if isinstance(task, LanguageModelingModelOutput):
        return torch.ones(batch[0].shape[0], dtype=F64)
    weights = {k: p.detach() for k, p in model.named_parameters()}
    return task.get_out_to_loss_grad(model, weights, {}, batch).reshape(-1).to(F64)


def _loop(model: nn.Module, output: Any, batch: tuple[Tensor, ...], param: str) -> Tensor:
    """``[B, numel]``: one backward of ``output`` per example, alone."""
    weight = model.get_parameter(param)
    rows = []
    for i in range(batch[0].shape[0]):
        (grad,) = torch.autograd.grad(output(model, *(t[i : i + 1] for t in batch)).sum(), weight)
        rows.append(grad.reshape(-1))
    return torch.stack(rows)


# -- features --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_stacked_expert_features_equal_float64_per_example_grads(name):
    """``vec(sum_t g_t a_tᵀ)`` of the experts, concatenated, is ``dW[b]`` flattened row-major.

    Of TRAK's output against a loop and both gradient computers; of the
    stored influence features (the summed log-likelihood) against a loop.
    """
    model, task, batch, reference = _case(name)
    layers = find_layers(model, None, None)
    caps, _ = capture_layers(model, layers, resolve_batch_output(task), batch)
    featurizer = _featurizer(model, task, None)
    assert [x.name for x in featurizer.layers] == [x.name for x in layers]
    parts, _ = featurizer.layer_parts(batch)
    features = featurizer.features([(a, g) for a, g, _ in parts])
    computed = {}
    for computer in (FunctionalGradientComputer, HookGradientComputer):
        gc = computer(model, task)
        computed[computer.__name__] = gc.compute_per_sample_grad(batch)
        hooks = gc if isinstance(gc, HookGradientComputer) else gc.hooks
        if hooks is not None:
            hooks.remove_hooks()
    params = _stacked(model)
    assert len(params) == 4
    for param in params:
        experts = [caps[x.name] for x in layers if x.param == param]
        got = torch.cat([torch.bmm(g.transpose(1, 2), a).flatten(1) for a, g, _ in experts], 1)
        expected = reference[param].reshape(4, -1)
        scale = expected.abs().max().item()
        assert scale > 0
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10 * scale)
        for grads in computed.values():
            torch.testing.assert_close(
                got, grads[param].reshape(4, -1), rtol=1e-10, atol=1e-10 * scale
            )
        expected = _loop(model, _influence_output(task), batch, param)
        scale = expected.abs().max().item()
        got = _block(featurizer, features, param)
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10 * scale)


def test_padded_examples_have_the_features_of_their_real_tokens():
    """An example's features in a right-padded batch equal those of its real tokens alone."""
    model, task, batch, _ = _case("mixtral")
    featurizer = _featurizer(model, task, _stacked(model))
    parts, _ = featurizer.layer_parts(batch)
    padded = featurizer.features([(a, g) for a, g, _ in parts])
    lengths = batch[1].sum(1)
    assert (lengths < batch[1].shape[1]).any()
    for i, length in enumerate(lengths.tolist()):
        alone = tuple(t[i : i + 1, :length] for t in batch)
        one, _ = featurizer.layer_parts(alone)
        expected = featurizer.features([(a, g) for a, g, _ in one])
        scale = expected.abs().max().item()
        torch.testing.assert_close(padded[i : i + 1], expected, rtol=1e-9, atol=1e-9 * scale)


def test_other_experts_implementations_run_eagerly_while_capturing():
    """A model set to batched matmuls captures the eager features; its setting is kept."""
    model, task, batch, _ = _case("mixtral")
    featurizer = _featurizer(model, task, _stacked(model))
    parts, _ = featurizer.layer_parts(batch)
    eager = featurizer.features([(a, g) for a, g, _ in parts])
    model.config._experts_implementation_internal = "batched_mm"
    try:
        parts, _ = featurizer.layer_parts(batch)
        assert model.config._experts_implementation == "batched_mm"
    finally:
        model.config._experts_implementation_internal = "eager"
    got = featurizer.features([(a, g) for a, g, _ in parts])
    torch.testing.assert_close(got, eager, rtol=1e-12, atol=1e-12 * eager.abs().max().item())


# -- scores against a dense float64 reference ------------------------------------------------
def _example_parts(
    model: nn.Module, task: Any, layers: list[Any], batch: tuple[Tensor, ...]
) -> list[list[tuple[Tensor, Tensor]]]:
    """Per example and layer ``(a [rows, d_in(+1)], g [rows, d_out])``, each example alone.

    Alone, a routed layer's rows are the example's own (no padding to other
    examples' counts); a direct layer's padded positions are dropped (they
    carry ``g = 0`` and stay out of ``A``).
    """
    output = _influence_output(task)
    out = []
    for i in range(batch[0].shape[0]):
        one = tuple(t[i : i + 1] for t in batch)
        caps, _ = capture_layers(model, layers, output, one)
        mask = one[1][0].bool() if isinstance(task, LanguageModelingModelOutput) else None
        rows = []
        for x in layers:
            a, g, _ = caps[x.name]
            a, g = a[0], g[0]
            if x.bias:
                a = torch.cat([a, torch.ones_like(a[:, :1])], 1)
            if x.container is None and mask is not None:
                a, g = a[mask], g[mask]
            rows.append((a, g))
        out.append(rows)
    return out


def _reference_scores(
    model: nn.Module,
    task: Any,
    grad_wrt: list[str] | None,
    train: tuple[Tensor, ...],
    query: tuple[Tensor, ...],
    method: str,
    damping: float | str,
) -> Tensor:
    """``Σ_l q_i vec(G_q^l)ᵀ (H_l + λ_l I)⁻¹ vec(G_i^l)`` with dense float64 matrices.

    ``A`` is the mean over every (real) row of ``a aᵀ``, ``S`` the mean over
    examples of ``Σ_t (|q| g)(|q| g)ᵀ`` (the empirical Fisher); K-FAC's
    ``H = S ⊗ A``, EK-FAC's ``Q diag(Λ) Qᵀ`` with ``Q = Q_S ⊗ Q_A`` and
    ``Λ = diag(Qᵀ (mean_i q_i² vec(G_i) vec(G_i)ᵀ) Q)``.
    """
    layers = find_layers(model, grad_wrt, None)
    q = _out_to_loss(model, task, train)
    rows, qrows = (_example_parts(model, task, layers, b) for b in (train, query))
    n = len(rows)
    scores = torch.zeros(n, len(qrows), dtype=F64)
    for i in range(len(layers)):
        a_all = torch.cat([r[i][0] for r in rows])
        a_cov = a_all.T @ a_all / max(a_all.shape[0], 1)
        s_cov = sum((q[b] * r[i][1]).T @ (q[b] * r[i][1]) for b, r in enumerate(rows)) / n
        gt = torch.stack([(r[i][1].T @ r[i][0]).reshape(-1) for r in rows])
        gq = torch.stack([(r[i][1].T @ r[i][0]).reshape(-1) for r in qrows])
        if method == "kfac":
            h = torch.kron(s_cov, a_cov)  # eigenvalues: the products of the factors'
            values = torch.outer(torch.linalg.eigvalsh(s_cov), torch.linalg.eigvalsh(a_cov))
        else:
            _, q_a = torch.linalg.eigh(a_cov)
            _, q_s = torch.linalg.eigh(s_cov)
            basis = torch.kron(q_s, q_a)
            rotated = (q[:, None] * gt) @ basis
            values = (rotated * rotated).mean(0)
            h = basis @ torch.diag(values) @ basis.T
        lam = damping if damping != "auto" else AUTO_FRACTION * float(values.mean())
        if lam == 0 and not bool(h.any()):
            continue  # an expert no training row reached: zero rows, nothing to add
        solved = torch.linalg.solve(h + lam * torch.eye(h.shape[0], dtype=F64), gq.T)
        scores += q[:, None] * (gt @ solved)
    return scores


def _traker_scores(
    tmp_path: Any,
    model: nn.Module,
    task: Any,
    grad_wrt: list[str] | None,
    train: tuple[Tensor, ...],
    query: tuple[Tensor, ...],
    method: str,
    damping: float | str,
    batch_size: int,
) -> tuple[TRAKer, np.ndarray]:
    n, m = train[0].shape[0], query[0].shape[0]
    traker = TRAKer(
        model,
        task,
        n,
        save_dir=tmp_path,
        device="cpu",
        progress=False,
        method=method,
        lambda_reg=damping,
        grad_wrt=grad_wrt,
        dtype=F64,
        logging_level=logging.ERROR,
    )
    state = model.state_dict()
    traker.load_checkpoint(state, model_id=0)
    for start in range(0, n, batch_size):
        rows = tuple(t[start : start + batch_size] for t in train)
        traker.featurize(rows, num_samples=int(rows[0].shape[0]))
    traker.finalize_features()
    traker.start_scoring_checkpoint("q", state, model_id=0, num_targets=m)
    traker.score(query, num_samples=m)
    return traker, np.asarray(traker.finalize_scores("q"))


def _assert_scores(traker: TRAKer, scores: np.ndarray, ref: Tensor) -> None:
    """The returned scores are float32; from the float64 store they agree to float64 rounding.

    ``q_i <x_i, (H + λI)⁻¹ x_q>`` from the stored rows and the fitted
    preconditioner: eigendecompositions and solves of matrices up to
    1024 x 1024 in float64 agree to ~1e-12 of the scores' scale; 1e-9 leaves room
    for the conditioning of ``H + λI``.
    """
    scale = float(ref.abs().max())
    assert scale > 0 and np.isfinite(scores).all()
    np.testing.assert_allclose(scores, ref.numpy(), rtol=1e-6, atol=1e-6 * scale)
    train_rows = torch.as_tensor(np.asarray(traker.stored_features(0)[:]))
    targets = torch.as_tensor(np.asarray(traker.store.array("experiments/q/0/grads")[:]))
    q = torch.as_tensor(np.asarray(traker.store.array("checkpoints/0/out_to_loss")[:]))
    got = q.reshape(-1, 1) * (train_rows @ traker.preconditioner(0).solve(targets).T)
    torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-9 * scale)


SCORE_CASES = [
    pytest.param("mixtral", "ekfac", "experts", "auto", id="mixtral-ekfac-experts"),
    pytest.param(
        "mixtral", "kfac", "experts", 0.01, id="mixtral-kfac-experts", marks=pytest.mark.slow
    ),
    pytest.param("mixtral", "kfac", "all", 0.01, id="mixtral-kfac-all"),
    pytest.param("mixtral", "ekfac", "all", "auto", id="mixtral-ekfac-all", marks=pytest.mark.slow),
    pytest.param(
        "qwen2_moe", "kfac", "experts", "auto", id="qwen2_moe-kfac-experts", marks=pytest.mark.slow
    ),
    pytest.param(
        "qwen2_moe", "ekfac", "experts", 0.01, id="qwen2_moe-ekfac-experts", marks=pytest.mark.slow
    ),
    pytest.param(
        "qwen2_moe", "ekfac", "all", "auto", id="qwen2_moe-ekfac-all", marks=pytest.mark.slow
    ),
]


@pytest.mark.parametrize(("name", "method", "scope", "damping"), SCORE_CASES)
def test_traker_scores_equal_dense_float64_reference(tmp_path, name, method, scope, damping):
    """8 padded training sequences in batches of 4, 2 queries; experts' blocks per expert."""
    model, task, _, _ = _case(name)
    family = FAMILIES[name]
    train = as_task_batch(task, family.batch(8, seed=3))
    query = as_task_batch(task, family.batch(2, seed=4))
    grad_wrt = _stacked(model) if scope == "experts" else None
    traker, scores = _traker_scores(
        tmp_path, model, task, grad_wrt, train, query, method, damping, 4
    )
    stacked = [x for x in traker.layers if x.param is not None]
    assert len(stacked) == 16
    if scope == "experts":
        assert len(traker.layers) == 16
    ref = _reference_scores(model, task, grad_wrt, train, query, method, damping)
    _assert_scores(traker, scores, ref)


@pytest.mark.parametrize("method", ["ekfac", pytest.param("kfac", marks=pytest.mark.slow)])
def test_factored_rows_score_as_the_dense_reference(tmp_path, method):
    """Short sequences: each expert's few routed rows are stored as factors (``token_factors``).

    Then ``vec(G)`` is never stored: EK-FAC's eigenvalues and the scores are
    taken from each position's rotated ``[a, g]``.
    """
    model, task, _, _ = _case("mixtral")
    family = FAMILIES["mixtral"]
    ids, mask, labels = (t[:, :4].clone() for t in as_task_batch(task, family.batch(8, seed=3)))
    ids[1, 2:], mask[1, 2:], labels[1, 2:] = 0, 0, -100  # one padded row
    train = (ids, mask, labels)
    query = tuple(t[:, :4] for t in as_task_batch(task, family.batch(2, seed=4)))
    grad_wrt = _stacked(model)
    traker, scores = _traker_scores(
        tmp_path, model, task, grad_wrt, train, query, method, "auto", 8
    )
    assert traker.store.has("checkpoints/0/token_factors")
    assert not traker.store.has("checkpoints/0/grads")
    ref = _reference_scores(model, task, grad_wrt, train, query, method, "auto")
    _assert_scores(traker, scores, ref)


# -- an expert no example is routed to ---------------------------------------------------------
class StackedExperts(nn.Module):
    """Four experts in one stacked weight, each called on its routed rows.

    ``layout``: ``"linear"`` (``W [E, d_out, d_in]``, ``F.linear(x, W[e])``),
    ``"transposed"`` (transformers' ``is_transposed``: ``W [E, d_in, d_out]``,
    ``x @ W[e] + B[e]``) or ``"other"`` (``x @ W[e].T``, which is not captured).
    """

    def __init__(self, layout: str = "linear") -> None:
        super().__init__()
        self.layout = layout
        if layout == "transposed":
            self.is_transposed = True
            self.weight = nn.Parameter(torch.randn(4, 5, 3) / 2)
            self.weight_bias = nn.Parameter(torch.randn(4, 3) / 2)
        else:
            self.weight = nn.Parameter(torch.randn(4, 3, 5) / 2)

    def forward(self, x: Tensor, index: Tensor) -> Tensor:
        out = x.new_zeros(x.shape[0], 3)
        for e in range(4):
            rows = (index == e).nonzero()[:, 0]
            if rows.numel() == 0:
                continue
            if self.layout == "linear":
                y = F.linear(x[rows], self.weight[e])
            elif self.layout == "transposed":
                y = x[rows] @ self.weight[e] + self.weight_bias[e]
            else:
                y = x[rows] @ self.weight[e].T
            out = out.index_add(0, rows, y)
        return out


class ToyMoE(nn.Module):
    """Routes each position to the largest of its first three features: expert 3 never runs."""

    def __init__(self, layout: str = "linear") -> None:
        super().__init__()
        self.inp = nn.Linear(5, 5)
        self.experts = StackedExperts(layout)
        self.head = nn.Linear(3, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x).reshape(-1, 5)
        y = self.experts(h, h[:, :3].argmax(-1))
        return self.head(torch.tanh(y)).reshape(*x.shape[:2], 3).mean(1)


@pytest.fixture
def toy() -> Iterator[tuple[nn.Module, tuple[Tensor, Tensor], tuple[Tensor, Tensor]]]:
    register_whole_module(StackedExperts)
    try:
        torch.manual_seed(0)
        model = ToyMoE().double()
        g = torch.Generator().manual_seed(1)
        x = torch.randn(12, 4, 5, generator=g, dtype=F64)
        labels = torch.arange(12) % 3
        yield model, (x[:8], labels[:8]), (x[8:], labels[8:])
    finally:
        WHOLE_MODULES.discard(StackedExperts)


def test_unrouted_expert_gives_zero_rows(toy):
    model, train, _ = toy
    task = ImageClassificationModelOutput()
    featurizer = _featurizer(model, task, None)
    parts, _ = featurizer.layer_parts(train)
    features = featurizer.features([(a, g) for a, g, _ in parts])
    expected = _loop(model, resolve_batch_output(task), train, "experts.weight")
    assert torch.equal(expected[:, 45:], torch.zeros_like(expected[:, 45:]))
    scale = expected.abs().max().item()
    got = _block(featurizer, features, "experts.weight")
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12 * scale)
    unused = {x.name: i for i, x in enumerate(featurizer.layers)}["experts.weight.3"]
    assert parts[unused][0].shape == (8, 0, 5)


@pytest.mark.parametrize(
    ("method", "damping"),
    [
        ("kfac", 0.0),
        ("ekfac", 0.0),
        ("ekfac", "auto"),
        pytest.param("kfac", "auto", marks=pytest.mark.slow),
        pytest.param("kfac", 0.1, marks=pytest.mark.slow),
        pytest.param("ekfac", 0.1, marks=pytest.mark.slow),
    ],
)
def test_unrouted_expert_keeps_scores_finite(tmp_path, toy, method, damping):
    """Its factors are zero: no NaN, also undamped (a zero direction adds nothing)."""
    model, train, query = toy
    task = ImageClassificationModelOutput()
    traker, scores = _traker_scores(tmp_path, model, task, None, train, query, method, damping, 4)
    assert np.isfinite(scores).all() and np.abs(scores).max() > 0
    if damping != 0.0:  # undamped, the reference's dense H is singular
        ref = _reference_scores(model, task, None, train, query, method, damping)
        _assert_scores(traker, scores, ref)


def test_stacked_weights_called_otherwise_are_refused(toy):
    """A stacked weight read without F.linear(x, W[e]) cannot be captured: say what to do."""
    _, train, _ = toy
    torch.manual_seed(0)
    model = ToyMoE("other").double()
    task = ImageClassificationModelOutput()
    layers = find_layers(model, None, None)
    assert any(x.param == "experts.weight" for x in layers)
    with pytest.raises(
        HookComputationError,
        match=r"stacked expert weights \['experts.weight'\] of StackedExperts \('experts'\) "
        r"were not called as F.linear\(x, W\[e\]\).*out of `grad_wrt`.*method='trak'",
    ):
        capture_layers(model, layers, resolve_batch_output(task), train)


def _transposed_blocks(reference: dict[str, Tensor], param: str, experts: int) -> list[Tensor]:
    """Per expert ``[dW[e]ᵀ | dB[e]]``, ``[B, d_out, d_in + 1]``: the layer's features."""
    w, b = reference[param], reference[param + "_bias"]
    return [torch.cat([w[:, e].transpose(1, 2), b[:, e, :, None]], 2) for e in range(experts)]


@pytest.mark.parametrize("method", ["kfac", pytest.param("ekfac", marks=pytest.mark.slow)])
def test_transposed_stacked_weights_with_bias_are_factored(toy, tmp_path, method):
    """``is_transposed`` experts (``x @ W[e] + B[e]``, as gpt-oss) are ``[dW[e]ᵀ | dB[e]]``."""
    _, train, query = toy
    torch.manual_seed(0)
    model = ToyMoE("transposed").double()
    task = ImageClassificationModelOutput()
    featurizer = _featurizer(model, task, None)
    experts = [x for x in featurizer.layers if x.param == "experts.weight"]
    assert [(x.d_in, x.d_out, x.bias, x.transposed) for x in experts] == [(6, 3, True, True)] * 4
    assert experts[0].param_names == ("experts.weight", "experts.weight_bias")
    parts, _ = featurizer.layer_parts(train)
    features = featurizer.features([(a, g) for a, g, _ in parts])
    output = resolve_batch_output(task)
    reference = {
        p: _loop(model, output, train, p) for p in ("experts.weight", "experts.weight_bias")
    }
    reference = {p: r.reshape(8, *model.get_parameter(p).shape) for p, r in reference.items()}
    for x, expected in zip(experts, _transposed_blocks(reference, "experts.weight", 4)):
        got = features[:, x.offset : x.offset + x.width].reshape(expected.shape)
        scale = max(expected.abs().max().item(), 1e-300)
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12 * scale)
    traker, scores = _traker_scores(tmp_path, model, task, None, train, query, method, 0.1, 4)
    ref = _reference_scores(model, task, None, train, query, method, 0.1)
    _assert_scores(traker, scores, ref)


@pytest.mark.slow
def test_gpt_oss_transposed_experts_equal_float64_per_example_grads():
    """gpt-oss: ``x @ W[e] + B[e]`` of ``[E, d_in, d_out]`` weights, against a float64 loop."""
    family = Family(
        "gpt_oss",
        _decoder(
            "GptOssConfig",
            intermediate_size=8,
            num_local_experts=4,
            head_dim=8,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            **SMALL,
        ),
        "GptOssForCausalLM",
        "lm",
    )
    model, task, batch, reference = float64_case(family)
    layers = find_layers(model, None, None)
    caps, _ = capture_layers(model, layers, resolve_batch_output(task), batch)
    stacked = [n for n, p in model.named_parameters() if p.dim() == 3]
    assert len(stacked) == 4 and {x.param for x in layers if x.param} == set(stacked)
    for param in stacked:
        experts = [x for x in layers if x.param == param]
        for x, expected in zip(experts, _transposed_blocks(reference, param, 4)):
            a, g, _ = caps[x.name]
            a = torch.cat([a, torch.ones_like(a[..., :1])], 2)  # zero rows: g = 0 too
            got = torch.bmm(g.transpose(1, 2), a)
            scale = expected.abs().max().item()
            torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10 * scale)


def test_transformers_experts_outside_the_per_expert_layout_are_left_out(caplog):
    """A transformers experts class without ``@use_experts_implementation`` (Llama 4's
    ``bmm`` over every expert) keeps its stacked weights out, logged."""

    class WholeBmmExperts(StackedExperts):
        pass

    WholeBmmExperts.__module__ = "transformers.models.fake.modeling_fake"
    torch.manual_seed(0)
    model = ToyMoE().double()
    model.experts = WholeBmmExperts()
    register_whole_module(WholeBmmExperts)
    try:
        with caplog.at_level(logging.INFO, logger="gradsketch.attribution._layer_capture"):
            layers = find_layers(model, None, None)
        assert [x.name for x in layers] == ["inp", "head"]
        assert "WholeBmmExperts is no @use_experts_implementation class" in caplog.text
        assert "['experts.weight'] are left out" in caplog.text
        model.experts.is_transposed = False  # what the decorator sets
        assert sum(x.param == "experts.weight" for x in find_layers(model, None, None)) == 4
    finally:
        WHOLE_MODULES.discard(WholeBmmExperts)
