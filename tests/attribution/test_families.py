"""Attribution on every Hugging Face family, against float64 loops of single examples.

The family matrix (:mod:`helpers.hf_families`: tiny configs, 2 layers, width
64, right-padded batches): per-example gradients of both computers, their
count-sketched features, TRAKer end to end with ``"trak"`` and ``"ekfac"``,
bf16 models, and the layouts the hooks must read (OPT's ``[B * T, d]`` MLP,
mixture-of-experts routers and experts, T5's relative position bias shared
by every example, ViT's patch convolution). A few families run by default;
the whole matrix runs under ``-m matrix`` (``make test-matrix``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor, nn

transformers = pytest.importorskip("transformers")

from gradsketch.attribution import (  # noqa: E402
    FunctionalGradientComputer,
    HookGradientComputer,
    ImageClassificationModelOutput,
    TRAKer,
)
from gradsketch.attribution._capture import is_vmap_trace_failure as _is_vmap_trace_failure  # noqa: E402
from gradsketch.attribution._layer_capture import capture_layers, find_layers  # noqa: E402
from gradsketch.attribution._layers import (  # noqa: E402
    WHOLE_MODULES,
    HookComputationError,
    register_whole_module,
)
from gradsketch.attribution._lm import BatchFormatError, Seq2SeqLMModelOutput  # noqa: E402
from gradsketch.attribution._lm_data import as_loader, as_task_batch  # noqa: E402
from gradsketch.attribution._modelout import resolve_batch_output, resolve_task  # noqa: E402
from gradsketch.sketch import CountSketchProjector, FactorizedProjector  # noqa: E402
from helpers.hf_families import (  # noqa: E402
    BY_NAME,
    FAMILIES,
    SEQ,
    Family,
    float64_case,
    loop_reference,
)
from helpers.launch import one_thread  # noqa: E402

F64 = torch.float64
#: Families of the default run: flattened rows (OPT), an autograd.Function vmap
#: cannot transform (BLOOM), a mixture of experts (Mixtral), seq2seq (T5 with its
#: shared position bias, BART) and a vision model that vmap traces (ViT).
DEFAULT = ("opt", "bloom", "mixtral", "t5", "bart", "vit")
#: The functional computer hands these over to the hooks on the first batch.
HOOKS_ONLY = [f for f in FAMILIES if not f.vmap]
#: vmap warns that it loops over CPU flash attention (exact, only slower); under
#: `filterwarnings = error` that warning would be a failure to trace.
VMAP_SDPA = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")


def _params(families: list[Family], default: tuple[str, ...] = DEFAULT) -> list[Any]:
    """One case per family; those outside ``default`` run under ``-m matrix``."""
    return [
        pytest.param(f, id=f.name, marks=() if f.name in default else pytest.mark.matrix)
        for f in families
    ]


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Models this small run fastest on one thread (and do not fight for shared cores)."""
    with one_thread():
        yield


@functools.cache
def _reference(name: str) -> tuple[nn.Module, Any, tuple[Tensor, ...], dict[str, Tensor]]:
    """A family's float64 model, task, 4-example batch and per-example loop gradients."""
    return float64_case(BY_NAME[name])


def _assert_grads_equal(
    actual: dict[str, Tensor], expected: dict[str, Tensor], rtol: float
) -> None:
    """Every parameter, in model order; tolerance relative to the largest gradient entry.

    Some parameters have (near) zero gradients by symmetry (a key bias under
    softmax, an unused pooler), so each is compared against the scale of the
    whole gradient rather than its own.
    """
    assert list(actual) == list(expected)
    scale = max(g.abs().max().item() for g in expected.values())
    assert scale > 0
    for name, ref in expected.items():
        torch.testing.assert_close(
            actual[name],
            ref,
            rtol=rtol,
            atol=rtol * scale,
            msg=lambda m, n=name: f"{n}: {m}",
        )


# -- (a) per-example gradients -------------------------------------------------------
@pytest.mark.parametrize("family", _params(FAMILIES))
def test_hook_per_example_grads_equal_float64_loop(family):
    model, task, batch, reference = _reference(family.name)
    with HookGradientComputer(model, task) as gc:
        grads = gc.compute_per_sample_grad(batch)
    _assert_grads_equal(grads, reference, family.rtol)


@VMAP_SDPA
@pytest.mark.parametrize("family", _params([f for f in FAMILIES if f.vmap]))
def test_functional_per_example_grads_equal_float64_loop_where_vmap_traces(family):
    model, task, batch, reference = _reference(family.name)
    gc = FunctionalGradientComputer(model, task)
    grads = gc.compute_per_sample_grad(batch)
    assert gc.hooks is None, "vmap traced this family before; it now hands over to the hooks"
    _assert_grads_equal(grads, reference, family.rtol)


@pytest.mark.parametrize("family", _params(HOOKS_ONLY))
def test_functional_hands_over_to_hooks_with_one_logged_reason(family, caplog):
    """Whatever vmap raises (data-dependent masks, BLOOM's autograd.Function), one warning."""
    model, task, batch, reference = _reference(family.name)
    gc = FunctionalGradientComputer(model, task)
    with caplog.at_level(logging.WARNING, logger="gradsketch.attribution._gradient_computers"):
        first = gc.compute_per_sample_grad(batch)
        gc.compute_per_sample_grad(batch)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert f"cannot trace {type(model).__name__}" in warnings[0].getMessage()
    assert gc.hooks is not None and gc.hooks.vmap_failure
    gc.hooks.remove_hooks()
    _assert_grads_equal(first, reference, family.rtol)


def test_bloom_vmap_failure_is_not_worded_as_one():
    """BLOOM's error under vmap names no vmap; it still hands the model to the hooks."""
    exc = RuntimeError(
        "In order to use an autograd.Function with functorch transforms (vmap, grad, ...), "
        "it must override the setup_context staticmethod."
    )
    assert _is_vmap_trace_failure(exc)
    assert not _is_vmap_trace_failure(KeyboardInterrupt())


# -- (b) projected features ------------------------------------------------------------
@VMAP_SDPA
@pytest.mark.parametrize("family", _params(FAMILIES))
def test_count_sketch_features_equal_projected_float64_grads(family):
    model, task, batch, reference = _reference(family.name)
    grad_dim = sum(p.numel() for p in model.parameters())
    projector = CountSketchProjector(grad_dim, 64, 11, "cpu")
    expected = projector.project(reference, model_id=0)
    scale = expected.abs().max().item()
    for computer in (FunctionalGradientComputer, HookGradientComputer):
        gc = computer(model, task)
        got = gc.project(batch, projector, model_id=0)
        torch.testing.assert_close(got, expected, rtol=family.rtol, atol=family.rtol * scale)
        hooks = gc if isinstance(gc, HookGradientComputer) else gc.hooks
        if hooks is not None:
            hooks.remove_hooks()


@pytest.mark.parametrize(
    "name",
    [
        "vit",
        "opt",
        "t5",
        pytest.param("switch", marks=pytest.mark.matrix),
        pytest.param("mixtral", marks=pytest.mark.matrix),
    ],
)
def test_factorized_features_equal_the_projected_float64_grads(name):
    """Kronecker-factored projection through the hooks equals the dense map of the float64 grads.

    ViT's patch Conv2d sits in a module with parameters of its own (cls token,
    positions) and is factorized; OPT's MLP sees [B * T, d]; T5's attention
    adopted the position bias; Switch's experts are hooked as one container and
    their factorized layers are projected from their per-example gradients.
    """
    model, task, batch, reference = _reference(name)
    projector = FactorizedProjector.from_model(model, k_in=4, k_out=3, seed=5, rest_proj_dim=16)
    layers = {layer.name for layer in projector.layers}
    if name == "vit":
        assert "vit.embeddings.patch_embeddings.projection" in layers
    if name == "switch":
        assert any(".experts.expert_" in n for n in layers)
    with HookGradientComputer(model, task) as gc:
        fast = gc.project(batch, projector, model_id=0)
    dense = projector.project(reference, model_id=0)
    torch.testing.assert_close(fast, dense, rtol=1e-7, atol=1e-7 * dense.abs().max().item())


# -- (c) TRAKer end to end -----------------------------------------------------------------
@VMAP_SDPA
@pytest.mark.parametrize("method", ["trak", "ekfac"])
@pytest.mark.parametrize("computer", [FunctionalGradientComputer, HookGradientComputer])
@pytest.mark.parametrize("family", _params(FAMILIES, default=("opt", "vit")))
def test_traker_end_to_end_gives_finite_scores(family, computer, method, tmp_path):
    """16 training and 4 query examples in tuple batches of 8: scores [16, 4], finite."""
    model = family.build(torch.float32)
    train, query = family.batch(16, seed=3), family.batch(4, seed=4)
    train, query = (
        tuple(t.float() if t.is_floating_point() else t for t in b) for b in (train, query)
    )
    traker = TRAKer(
        model,
        family.task,
        16,
        save_dir=tmp_path,
        gradient_computer=computer,
        method=method,
        proj_dim=32,
        device="cpu",
        lambda_reg=1e-2,
        progress=False,
        logging_level=logging.WARNING,
    )
    if method == "ekfac" and family.name in ("mixtral", "qwen2_moe"):
        # Every expert of the stacked [E, d_out, d_in] weights is a factored layer.
        assert sum(x.param is not None for x in traker.layers) == 2 * 2 * 4
    traker.load_checkpoint(model.state_dict(), model_id=0)
    for start in (0, 8):
        traker.featurize(tuple(t[start : start + 8] for t in train), num_samples=8)
    traker.finalize_features()
    traker.start_scoring_checkpoint("queries", model.state_dict(), model_id=0, num_targets=4)
    traker.score(query, num_samples=4)
    scores = np.asarray(traker.finalize_scores("queries"))
    assert scores.shape == (16, 4)
    assert np.isfinite(scores).all() and np.abs(scores).max() > 0


# -- (d) bf16 ------------------------------------------------------------------------------
@pytest.mark.parametrize("family", _params([BY_NAME[n] for n in ("opt", "mixtral", "t5")]))
def test_bf16_features_follow_the_float64_gradients(family):
    """A bf16 model's features (float32) are the float64 ones to bf16 accuracy.

    bf16 keeps 8 bits of mantissa (relative rounding 2^-9 ≈ 2e-3 per operation);
    through two layers, attention and the sums over tokens the projected
    gradients agree to a few 1e-2 of their largest entry.
    """
    _, task, batch, reference = _reference(family.name)
    model = family.build(torch.bfloat16)
    low = tuple(t.to(torch.bfloat16) if t.is_floating_point() else t for t in batch)
    grad_dim = sum(p.numel() for p in model.parameters())
    projector = CountSketchProjector(grad_dim, 64, 11, "cpu")
    with HookGradientComputer(model, task) as gc:
        got = gc.project(low, projector, model_id=0)
    expected = projector.project(reference, model_id=0)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    scale = expected.abs().max().item()
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=6e-2 * scale)


# -- (e) the layouts the hooks read ---------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "module", "rows"),
    [
        ("opt", "model.decoder.layers.0.fc1", SEQ),  # hidden.reshape(-1, d) before the MLP
        ("mixtral", "model.layers.0.mlp.gate", SEQ),  # the router sees every token as a row
        ("t5", "encoder.block.0.layer.0.SelfAttention", 1),  # adopted the shared position bias
    ],
    ids=["opt-fc1", "mixtral-router", "t5-attention"],
)
def test_flattened_and_adopted_modules(name, module, rows):
    model, task, batch, _ = _reference(name)
    with HookGradientComputer(model, task) as gc:
        capture = gc._run(batch)
        calls = [c for c in capture.calls if c.unit.name == module]
        units = {u.name: u for u in gc._units}
    assert calls and sorted(set(calls[0].rows.values())) == sorted({1, rows})
    if name == "t5":
        # It owns the bias alone; its projections keep their rules.
        assert units[module].fallback and list(units[module].params) == [
            "relative_attention_bias.weight"
        ]
        assert f"{module}.relative_attention_bias" not in units
        assert not units[f"{module}.q"].fallback


def test_experts_containers_are_hooked_whole():
    model, task, _, _ = _reference("switch")
    with HookGradientComputer(model, task) as gc:
        experts = [u for u in gc._units if u.name.endswith("mlp.experts")]
    assert experts and all(u.fallback for u in experts)
    assert any(".expert_0.wi.weight" in n for u in experts for n in u.params.values())
    assert type(experts[0].module) in WHOLE_MODULES


@pytest.mark.parametrize(
    "name",
    [
        "opt",
        "switch",
        "mixtral",
        pytest.param("qwen2_moe", marks=pytest.mark.matrix),
    ],
)
def test_layer_capture_reads_flattened_and_routed_rows(name):
    """sum_t g_t a_tᵀ of every captured layer is its float64 per-example weight gradient.

    OPT's fc1 / fc2 see [B * T, d]; Switch's experts see the tokens their
    router picked, captured by running the container once per example;
    Mixtral's and Qwen2-MoE's stacked experts ``W [E, d_out, d_in]`` are one
    layer per ``W[e]``, whose gradient is the slice ``dW[:, e]``.
    """
    model, task, batch, reference = _reference(name)
    layers = find_layers(model, None, None)
    if name != "opt":
        assert any(x.container is not None for x in layers)
    if name in ("mixtral", "qwen2_moe"):
        stacked = [n for n, p in model.named_parameters() if p.dim() == 3]
        assert stacked and {x.param for x in layers if x.param is not None} == set(stacked)
    caps, root = capture_layers(model, layers, resolve_batch_output(task), batch)
    assert root is not None
    scale = max(g.abs().max().item() for g in reference.values())
    checked = 0
    for layer in layers:
        weight = f"{layer.name}.weight" if layer.param is None else layer.param
        if weight not in reference:  # tied to the embedding: its part only
            continue
        expected = reference[weight] if layer.param is None else reference[weight][:, layer.expert]
        a, g, _ = caps[layer.name]
        got = torch.bmm(g.transpose(1, 2), a.to(g.dtype))
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9 * scale)
        checked += 1
    assert checked >= len(layers) - 1


# -- seq2seq task ------------------------------------------------------------------------------
def test_seq2seq_batches_from_dicts_tuples_and_datasets():
    datasets = pytest.importorskip("datasets")
    task = resolve_task("seq2seq_lm")
    assert isinstance(task, Seq2SeqLMModelOutput)
    ids, labels = torch.tensor([[5, 6, 7], [8, 9, 0]]), torch.tensor([[3, 4], [5, -100]])
    canonical = task.as_batch({"input_ids": ids, "labels": labels})
    assert [tuple(t.shape) for t in canonical] == [(2, 3), (2, 3), (2, 2), (2, 2)]
    assert torch.equal(canonical[1], torch.ones_like(ids))
    assert all(
        torch.equal(a, b)
        for a, b in zip(canonical, task.as_batch((ids, torch.ones_like(ids), labels)))
    )
    rows = datasets.Dataset.from_dict(
        {"input_ids": [[5, 6, 7], [8, 9]], "labels": [[3, 4], [5]], "text": ["a", "b"]}
    )
    (loaded,) = list(as_loader(rows, task, batch_size=2))
    _, mask2, labels2, dmask2 = task.as_batch(loaded)
    assert torch.equal(dmask2, torch.ones_like(labels2))
    assert torch.equal(labels2, torch.tensor([[3, 4], [5, -100]]))
    assert torch.equal(mask2, torch.tensor([[1, 1, 1], [1, 1, 0]]))


def test_seq2seq_per_token_rows_sum_to_the_sequence():
    """Per-token rows keep the whole target for the decoder; their outputs add up to f."""
    model, task, batch, _ = _reference("bart")
    rows = task.per_token_batch(batch)
    length = task.per_token_length(batch)
    assert rows[0].shape[0] == batch[0].shape[0] * length
    with torch.no_grad():
        whole = task.get_batch_output(model, *batch)
        tokens = task.get_batch_output(model, *rows).reshape(-1, length)
    torch.testing.assert_close(tokens.sum(1), whole)


def test_seq2seq_out_to_loss_is_one_and_loss_is_minus_the_output():
    model, task, batch, _ = _reference("t5")
    weights = dict(model.named_parameters())
    q = task.get_out_to_loss_grad(model, weights, {}, batch)
    assert torch.equal(q, torch.ones(batch[0].shape[0], 1))
    ids, mask, labels, _ = batch
    with torch.no_grad():
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        f = task.get_batch_output(model, *batch)
    # Hugging Face's loss is the mean over target tokens of -log p.
    torch.testing.assert_close(-f.sum() / (labels != -100).sum(), loss)


# -- errors ------------------------------------------------------------------------------------
class Gathered(nn.Module):
    """A toy mixture of experts: the expert sees the tokens with a positive first feature."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.expert = nn.Linear(4, 3)
        self.head = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        flat = h.reshape(-1, 4)
        picked = (flat[:, 0] > 0).nonzero()[:, 0]
        out = self.head(flat).index_add(0, picked, self.expert(flat[picked]))
        return out.reshape(*x.shape[:-1], 3).mean(1)


def _gathered_case() -> tuple[nn.Module, tuple[Tensor, Tensor]]:
    torch.manual_seed(0)
    model = Gathered().double()
    x = torch.randn(3, 5, 4, dtype=F64)
    # 7 routed rows: no multiple of the batch, so no shape passes for the examples.
    x[:, :, 0] = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0]).repeat(3, 1)
    x[1, 2, 0] = x[2, 4, 0] = -1.0
    return model, (x, torch.tensor([0, 1, 2]))


def test_gathered_rows_under_the_root_are_refused_with_ways_out():
    model, batch = _gathered_case()
    with torch.no_grad():
        model.inp.weight.copy_(torch.eye(4, dtype=F64))
        model.inp.bias.zero_()
    with pytest.raises(
        HookComputationError,
        match=r"module 'expert' \(Linear\) returned shape \(7, 3\) for a batch of 3; .*"
        r"root of Gathered sees the examples apart\. Ways out: leave its parameters "
        r"\(\['expert.weight', 'expert.bias'\]\) out of `grad_wrt`.*FunctionalGradientComputer",
    ):
        HookGradientComputer(model, ImageClassificationModelOutput()).compute_per_sample_grad(batch)


def test_hooks_standing_in_for_vmap_do_not_send_the_user_back_to_it():
    model, batch = _gathered_case()
    with torch.no_grad():
        model.inp.weight.copy_(torch.eye(4, dtype=F64))
        model.inp.bias.zero_()
    gc = FunctionalGradientComputer(model, ImageClassificationModelOutput())
    with pytest.raises(
        HookComputationError,
        match=r"FunctionalGradientComputer handed this model to the hooks because "
        r"torch.func.vmap cannot trace it \(\w+: .*\)",
    ):
        gc.compute_per_sample_grad(batch)


def test_registered_container_makes_gathered_rows_exact():
    """With the whole model's body registered as a container, the same model works."""

    class Body(nn.Module):
        def __init__(self, inner: Gathered) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: Tensor) -> Tensor:
            return self.inner(x)

    model, batch = _gathered_case()
    wrapped = nn.Sequential(Body(model))
    register_whole_module(Body)
    try:
        task = ImageClassificationModelOutput()
        with HookGradientComputer(wrapped, task) as gc:
            got = gc.compute_per_sample_grad(batch)
        expected = loop_reference(wrapped, task, batch)
        _assert_grads_equal(got, expected, 1e-10)
    finally:
        WHOLE_MODULES.discard(Body)


def test_layer_capture_refuses_gathered_rows_with_ways_out():
    model, batch = _gathered_case()
    with torch.no_grad():
        model.inp.weight.copy_(torch.eye(4, dtype=F64))
        model.inp.bias.zero_()
    task = ImageClassificationModelOutput()
    layers = find_layers(model, None, None)
    with pytest.raises(
        HookComputationError,
        match=r"layer 'expert' of Gathered returned shape \(7, 3\) for a batch of 3.*"
        r"Leave its parameters out of `grad_wrt`.*register_whole_module.*method='trak'",
    ):
        capture_layers(model, layers, resolve_batch_output(task), batch)


class DirectRead(nn.Module):
    """Reads its child's weight without calling the child (as relative-position tables do)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(4, 3)
        self.head = nn.Linear(3, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(x[:, :3] + self.table.weight.sum(0))


def test_parameter_read_outside_its_module_is_adopted_or_refused():
    model = nn.Sequential(nn.Sequential(DirectRead())).double()
    task = ImageClassificationModelOutput()
    batch = (torch.randn(3, 4, dtype=F64), torch.tensor([0, 1, 2]))
    with HookGradientComputer(model, task) as gc:
        got = gc.compute_per_sample_grad(batch)
        assert any("0.0.table.weight" in u.params.values() for u in gc._units if u.name == "0.0")
    _assert_grads_equal(got, loop_reference(model, task, batch), 1e-10)
    with pytest.raises(
        HookComputationError,
        match=r"module 'table' \(Embedding\) was never called but its parameter 'table.weight' "
        r"has a gradient",
    ):
        HookGradientComputer(DirectRead().double(), task).compute_per_sample_grad(batch)


SEQ2SEQ_ERRORS = [
    (
        "no-labels",
        {"input_ids": torch.ones(2, 3, dtype=torch.long)},
        r"`batch` for seq2seq_lm has no 'labels' \(the target token ids\); it has keys "
        r"\['input_ids'\]",
    ),
    (
        "tuple-length",
        (torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long)),
        r"`batch` for seq2seq_lm has 2 entries; expected \(input_ids, attention_mask, labels\)",
    ),
    (
        "labels-batch",
        {"input_ids": torch.ones(2, 3, dtype=torch.long), "labels": torch.ones(3, 2)},
        r"`input_ids` must be \[batch, source_len\] and `labels` \[batch, target_len\], got "
        r"shapes \(2, 3\) and \(3, 2\)",
    ),
    (
        "decoder-mask",
        {
            "input_ids": torch.ones(2, 3, dtype=torch.long),
            "labels": torch.ones(2, 2, dtype=torch.long),
            "decoder_attention_mask": torch.ones(2, 3),
        },
        r"`decoder_attention_mask` has shape \(2, 3\) but must match \(2, 2\)",
    ),
]


@pytest.mark.parametrize(
    ("batch", "match"), [e[1:] for e in SEQ2SEQ_ERRORS], ids=[e[0] for e in SEQ2SEQ_ERRORS]
)
def test_seq2seq_batch_errors(batch, match):
    with pytest.raises(BatchFormatError, match=match):
        Seq2SeqLMModelOutput.as_batch(batch)


def test_seq2seq_dataset_without_labels_is_refused():
    datasets = pytest.importorskip("datasets")
    rows = datasets.Dataset.from_dict({"input_ids": [[5, 6, 7]]})
    with pytest.raises(BatchFormatError, match=r"needs 'labels' \(and reads \['input_ids'"):
        as_loader(rows, Seq2SeqLMModelOutput(), batch_size=2)


def test_dict_batch_for_a_tuple_task_lists_the_dict_tasks():
    with pytest.raises(BatchFormatError, match=r"'language_modeling', 'seq2seq_lm', "):
        as_task_batch(ImageClassificationModelOutput(), {"pixel_values": torch.zeros(1)})


def test_register_whole_module_refuses_non_modules():
    with pytest.raises(TypeError, match=r"`module_types` must be nn.Module subclasses, got 3"):
        register_whole_module(3)  # type: ignore[arg-type]


def test_factorized_layer_of_another_type_is_refused():
    """A projector laid out on a Linear, used on a model with a Bilinear of the same names."""
    projector = FactorizedProjector.from_model(nn.Sequential(nn.Linear(3, 2)), seed=0)
    model = nn.Sequential(nn.Bilinear(3, 3, 2))
    with (
        HookGradientComputer(model, ImageClassificationModelOutput()) as gc,
        pytest.raises(
            ValueError,
            match=r"`projector` factorizes layer '0', but the model has a Bilinear there "
            r"\(types with Kronecker factors: .*Linear",
        ),
    ):
        gc.project((torch.zeros(1, 3), torch.tensor([0])), projector, model_id=0)


@pytest.mark.parametrize(
    ("method", "dtype", "rtol"), [("trak", torch.float32, 1e-4), ("ekfac", torch.float64, 1e-6)]
)
def test_seq2seq_per_token_scores_sum_to_the_whole_targets(tmp_path, method, dtype, rtol):
    """TRAKer counts a seq2seq target's tokens on the decoder side (per_token_length), and
    f = Σ_t f_t. EK-FAC's damped inverse amplifies float32 rounding of the token features
    (2.6e-4 of the largest score measured), so it is checked in float64, where the sum is
    exact up to the float32 scores' own rounding (6.5e-8)."""
    family = BY_NAME["bart"]
    model = family.build(dtype)
    train, queries = family.batch(6, seed=1, dtype=dtype), family.batch(2, seed=2, dtype=dtype)
    traker = TRAKer(
        model,
        "seq2seq_lm",
        6,
        save_dir=tmp_path,
        device="cpu",
        proj_dim=32,
        method=method,
        lambda_reg="auto",
        dtype=dtype,
        progress=False,
    )
    traker.load_checkpoint(model.state_dict(), model_id=0)
    traker.featurize(train, num_samples=6)
    traker.finalize_features()
    traker.start_scoring_checkpoint(
        "q", model.state_dict(), model_id=0, num_targets=2, per_token=True
    )
    traker.score(queries, num_samples=2)
    whole = np.asarray(traker.finalize_scores("q"))
    tokens = traker.finalize_scores("q", per_token=True)
    assert tokens.shape == (6, 2, queries[2].shape[1])
    np.testing.assert_allclose(tokens.sum(-1), whole, rtol=rtol, atol=rtol * np.abs(whole).max())
