"""The sampler's working copy: seeded 16-bit dropout, explicit attention, fused GELU."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from _slt_helpers import tiny_gpt2, tiny_llama, tiny_neox, token_data
from torch import nn
from torch.nn import functional as F

from gradsketch._processes import run_jobs
from gradsketch.slt import _fast as tf
from gradsketch.slt import per_token_loss
from gradsketch.slt._fast import _attention, _copy, _dropout, _native
from gradsketch.slt._fast._native import train_status

CPU = torch.device("cpu")


def _hoeffding(n: int, delta: float = 1e-6) -> float:
    """Half-width t with P(|mean - p| >= t) <= delta for n independent Bernoulli draws.

    Hoeffding: P(|p_hat - p| >= t) <= 2 exp(-2 n t^2), so t = sqrt(ln(2 / delta) / (2 n)).
    """
    return math.sqrt(math.log(2 / delta) / (2 * n))


@pytest.fixture(params=["native", "torch"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test of the dropout and GELU runs on the native kernels and on torch's path."""
    if request.param == "native":
        if _native.native_kernels() is None:
            pytest.skip(f"native kernels unavailable: {train_status().reason}")
    else:
        monkeypatch.setattr(_native, "native_kernels", lambda: None)
    return str(request.param)


# ------------------------------------------------------------------ dropout
def test_dropout_is_reproducible_from_its_stream_and_depends_on_it(backend: str) -> None:
    x = torch.randn(64, 33)
    with tf.dropout_stream(torch.Generator().manual_seed(3)):
        a = tf.dropout(x, 0.3)
    with tf.dropout_stream(torch.Generator().manual_seed(3)):
        b = tf.dropout(x, 0.3)
    with tf.dropout_stream(torch.Generator().manual_seed(4)):
        c = tf.dropout(x, 0.3)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_kept_elements_are_scaled_exactly_and_dropped_ones_are_zero(backend: str) -> None:
    """Kept: x * (65536 / (65536 - q)) in float32, bit for bit; dropped: exactly 0."""
    x = torch.randn(10_000) + 5.0  # no zeros in x: a zero output means dropped
    p = 0.1
    q = round(p * 65536)
    with tf.dropout_stream(torch.Generator().manual_seed(0)):
        y = tf.dropout(x, p)
    kept = y != 0
    scale = torch.tensor(65536 / (65536 - q), dtype=torch.float32)
    assert torch.equal(y[kept], x[kept] * scale)
    assert 0 < int(kept.sum()) < x.numel()


def test_drop_rate_is_q_over_65536_in_every_16_bit_lane(backend: str) -> None:
    """Each element takes one of the four 16-bit lanes of a 64-bit word; every lane must
    drop with probability q / 65536 (``random_()`` without bounds leaves the top lane's
    sign bit 0, which would make lane 3 never drop; a weak hash would bias a lane). Per
    lane n = 250,000 draws; with delta = 1e-6 Hoeffding's half-width is
    sqrt(ln(2e6) / 5e5) = 0.0054 (module helper)."""
    n_lane = 250_000
    p = 0.3
    q = round(p * 65536)
    with tf.dropout_stream(torch.Generator().manual_seed(1)):
        y = tf.dropout(torch.ones(4 * n_lane), p)
    dropped = (y == 0).view(n_lane, 4).double().mean(0)
    tol = _hoeffding(n_lane)
    assert torch.all((dropped - q / 65536).abs() < tol), dropped


def test_expectation_is_exact_and_the_gradient_is_the_mask(backend: str) -> None:
    x = torch.randn(5, 7, requires_grad=True)
    with tf.dropout_stream(torch.Generator().manual_seed(2)):
        y = tf.dropout(x, 0.25)
    y.sum().backward()
    assert x.grad is not None
    # Per element, the gradient is the factor applied to x: 0 or the keep scale.
    np.testing.assert_allclose(
        (x.grad * x).detach().numpy(), y.detach().numpy(), rtol=1e-6, atol=1e-7
    )
    # E[mask] = (1 - q/65536) * 65536 / (65536 - q) = 1 exactly (in float64).
    q = round(0.25 * 65536)
    assert (1 - q / 65536) * 65536 / (65536 - q) == pytest.approx(1.0, abs=1e-15)


def test_dropout_edges(backend: str) -> None:
    x = torch.randn(3)
    assert tf.dropout(x, 0.0) is x
    assert tf.dropout(x, 1e-7) is x  # rounds to q = 0
    with pytest.raises(ValueError, match=r"`p` must be in \[0, 1\), got 1.0"):
        tf.dropout(x, 1.0)
    layer = tf.SeededDropout(0.5)
    assert layer.eval()(x) is x
    with tf.dropout_stream(torch.Generator().manual_seed(0)):
        assert not torch.equal(layer.train()(torch.ones(100)), torch.ones(100))


def test_the_backward_pass_recomputes_the_forward_mask_also_for_strided_gradients(
    backend: str,
) -> None:
    x = torch.randn(6, 10, requires_grad=True)
    with tf.dropout_stream(torch.Generator().manual_seed(5)):
        y = tf.dropout(x, 0.4)
    g = torch.randn(10, 6).T  # not contiguous
    (y * g).sum().backward()
    factor = torch.where(y != 0, y / x, torch.zeros(())).detach()
    assert x.grad is not None
    np.testing.assert_allclose(x.grad.numpy(), (g * factor).numpy(), rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------- GELU
def test_tanh_gelu_matches_float64_forward_and_backward(backend: str) -> None:
    """Against 0.5 x (1 + tanh(sqrt(2/pi)(x + 0.044715 x^3))) in float64 on [-12, 12]
    (both tails, the exp clamp): float32 rounding of the result and of e^t bounds the
    forward error by a few ulp of max(|y|, 1) and the derivative's (at most ~1.13) by
    a few 1e-7; 2e-6 leaves a margin that torch's own kernel also meets."""
    x = torch.linspace(-12, 12, 200_001, requires_grad=True)
    y = tf.TanhGELU()(x)
    y.backward(torch.ones_like(y))
    xd = x.detach().double().requires_grad_()
    ref = 0.5 * xd * (1 + torch.tanh(math.sqrt(2 / math.pi) * (xd + 0.044715 * xd**3)))
    ref.sum().backward()
    assert x.grad is not None and xd.grad is not None
    forward_err = (y.detach().double() - ref.detach()).abs() / ref.detach().abs().clamp_min(1.0)
    assert float(forward_err.max()) < 2e-6
    assert float((x.grad.double() - xd.grad).abs().max()) < 2e-6


def test_tanh_gelu_takes_other_dtypes_and_strides_through_torch() -> None:
    x = torch.randn(8, 6, dtype=torch.float64)
    assert torch.equal(tf.TanhGELU()(x), F.gelu(x, approximate="tanh"))
    strided = torch.randn(6, 8).T
    np.testing.assert_allclose(
        tf.TanhGELU()(strided).numpy(), F.gelu(strided, approximate="tanh").numpy(), atol=1e-6
    )


def test_the_tanh_gelus_are_swapped_and_the_erf_gelu_is_not() -> None:
    from transformers import activations

    names = ["NewGELUActivation", "FastGELUActivation", "GELUTanh"]
    net = nn.Sequential(
        *(getattr(activations, n)() for n in names if hasattr(activations, n)),
        nn.GELU(approximate="tanh"),
        nn.GELU(),
        nn.Dropout(0.1),
    )
    _copy._swap_modules(net, dropout_modules=True)
    kinds = [type(m) for m in net]
    assert kinds[:-2] == [tf.TanhGELU] * (len(net) - 2)
    assert kinds[-2:] == [nn.GELU, tf.SeededDropout]


# ------------------------------------------------------------ cross-entropy
def test_token_cross_entropy_matches_float64_with_ignored_rows(backend: str) -> None:
    """Loss and gradient against float64 ``cross_entropy`` (rows of 256 logits up to |12|:
    float32 log-sum-exp rounding is a few ulp of the loss, ~1e-6 here), ignored rows 0."""
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(300, 256, generator=gen) * 4).requires_grad_()
    targets = torch.randint(0, 256, (300,), generator=gen)
    targets[::7] = -100
    weights = torch.randn(300, generator=gen)
    loss = tf.token_cross_entropy(logits, targets)
    (loss * weights).sum().backward()
    ref_logits = logits.detach().double().requires_grad_()
    ref = F.cross_entropy(ref_logits, targets, reduction="none")
    (ref * weights.double()).sum().backward()
    assert logits.grad is not None and ref_logits.grad is not None
    np.testing.assert_allclose(loss.detach().double().numpy(), ref.detach().numpy(), atol=1e-5)
    np.testing.assert_allclose(logits.grad.double().numpy(), ref_logits.grad.numpy(), atol=1e-6)
    assert torch.all(loss[::7] == 0) and torch.all(logits.grad[::7] == 0)


# ---------------------------------------------------------------- attention
def _reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    allowed: torch.Tensor | None = None,
    additive: torch.Tensor | None = None,
    mask_factor: torch.Tensor | None = None,
    scale: float,
) -> torch.Tensor:
    """Float64 attention: explicit heads loop over grouped key/value heads; [b, q, h, d]."""
    q, k, v = q.double(), k.double(), v.double()
    groups = q.shape[1] // k.shape[1]
    out = torch.empty(q.shape[0], q.shape[2], q.shape[1], q.shape[3], dtype=torch.float64)
    for h in range(q.shape[1]):
        scores = q[:, h] @ k[:, h // groups].transpose(-1, -2) * scale
        if additive is not None:
            scores = scores + additive[:, 0].double()
        if allowed is not None:
            scores = scores.masked_fill(~allowed[:, 0], -math.inf)
        weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # no key seen: 0, as sdpa
        if mask_factor is not None:
            weights = weights * mask_factor[:, h].double()
        out[:, :, h] = weights @ v[:, h // groups]
    return out


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("q_len", [6, 9])
def test_attention_math_matches_float64_without_dropout(
    kv_heads: int, q_len: int, backend: str
) -> None:
    """No mask and causal (queries aligned to the last keys, as sdpa's is_causal with a
    cache), a boolean mask, an additive float mask; grouped-query heads when kv_heads < 4."""
    gen = torch.Generator().manual_seed(0)
    b, h, k_len, d = 2, 4, 9, 8
    q = torch.randn(b, h, q_len, d, generator=gen)
    k = torch.randn(b, kv_heads, k_len, d, generator=gen)
    v = torch.randn(b, kv_heads, k_len, d, generator=gen)
    causal = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)
    allowed = causal.expand(b, 1, q_len, k_len).clone()
    allowed[1, 0, :, 0] = False  # a padded first key in the second row (its query sees none)
    additive = torch.randn(b, 1, q_len, k_len, generator=gen)
    cases: list[tuple[Any, dict[str, Any]]] = [
        (None, {"allowed": causal.expand(b, 1, q_len, k_len)}),
        (allowed, {"allowed": allowed}),
        (additive, {"additive": additive}),
    ]
    for mask, ref_kw in cases:
        got = _attention._attention_math(q, k, v, mask, 0.0, 0.3, True)
        want = _reference_attention(q, k, v, scale=0.3, **ref_kw)
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)


def test_attention_math_applies_the_streams_dropout_mask_to_the_weights(backend: str) -> None:
    """The weights' mask is the one ``dropout`` draws first from the same stream (natively:
    the same hash of the same seed and element index, in the fused softmax kernel)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 5, 4, generator=gen) for _ in range(3))
    with tf.dropout_stream(torch.Generator().manual_seed(9)):
        got = _attention._attention_math(q, k, v, None, 0.2, None, True)
    with tf.dropout_stream(torch.Generator().manual_seed(9)):
        factor = tf.dropout(torch.ones(2, 2, 5, 5), 0.2)
    causal = torch.ones(5, 5, dtype=torch.bool).tril().expand(2, 1, 5, 5)
    want = _reference_attention(q, k, v, allowed=causal, mask_factor=factor, scale=0.5)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "q_len", "k_len"), [(4, 4, 9, 9), (4, 2, 5, 7), (2, 1, 3, 1030)]
)
def test_attention_with_dropout_matches_float64_forward_and_backward(
    heads: int, kv_heads: int, q_len: int, k_len: int, causal: bool, backend: str
) -> None:
    """Query laid out as GPT-2's (a head-major view of one packed projection), key as a
    ``[b, t, h, d]`` view, value contiguous; grouped-query heads; rows longer than the
    native kernels' 1024-column blocks. Output and the gradients of the three leaves
    against a float64 per-head loop with the mask :func:`dropout` draws from the same
    stream; without autograd the output is the same bits."""
    gen = torch.Generator().manual_seed(1)
    b, d, p = 2, 6, 0.2
    leaves = [
        torch.randn(b, q_len, 3 * heads * d, generator=gen),
        torch.randn(b, k_len, kv_heads, d, generator=gen),
        torch.randn(b, kv_heads, k_len, d, generator=gen),
    ]

    def views(packed: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
        q = packed[..., : heads * d].view(b, q_len, heads, d).transpose(1, 2)
        return [q, k.transpose(1, 2), v]

    with tf.dropout_stream(torch.Generator().manual_seed(7)):
        factor = tf.dropout(torch.ones(b, heads, q_len, k_len), p)
    ours = [t.clone().requires_grad_() for t in leaves]
    with tf.dropout_stream(torch.Generator().manual_seed(7)):
        got = _attention._attention_math(*views(*ours), None, p, 0.4, causal)
    with torch.no_grad(), tf.dropout_stream(torch.Generator().manual_seed(7)):
        assert torch.equal(_attention._attention_math(*views(*leaves), None, p, 0.4, causal), got)
    ref = [t.double().requires_grad_() for t in leaves]
    allowed = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)
    want = _reference_attention(
        *views(*ref),
        allowed=allowed.expand(b, 1, q_len, k_len) if causal else None,
        mask_factor=factor,
        scale=0.4,
    )
    np.testing.assert_allclose(got.detach().numpy(), want.detach().numpy(), rtol=1e-5, atol=1e-6)
    weights = torch.randn(got.shape, generator=gen, dtype=torch.float64)
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    for mine, theirs in zip(ours, ref):
        assert mine.grad is not None and theirs.grad is not None
        np.testing.assert_allclose(mine.grad.numpy(), theirs.grad.numpy(), rtol=1e-5, atol=1e-5)


def test_fused_attention_is_the_same_bits_on_more_threads_and_declines_strided_heads() -> None:
    """The native kernel shares batches among threads: each batch's work is the same
    whatever the count. A head dimension without unit stride (BLAS cannot read it in
    place) is left to torch's path, which still gives the answer."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(3, 2, 7, 5, generator=gen, requires_grad=True) for _ in range(3))
    results = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            with tf.dropout_stream(torch.Generator().manual_seed(3)):
                out = _attention._attention_math(q, k, v, None, 0.3, None, True)
            grads = torch.autograd.grad(out.sum(), (q, k, v))
            results.append((out, *grads))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(*results))
    strided = torch.randn(3, 2, 7, 10, generator=gen)[..., ::2]
    assert _attention._fused_attention(strided, k, v, 0.3, 0.5, True) is None
    with tf.dropout_stream(torch.Generator().manual_seed(3)):
        got = _attention._attention_math(strided, k, v, None, 0.3, 0.5, True)
    assert got.shape == (3, 7, 2, 5)


def test_fused_attention_through_scipys_sgemm(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where torch exports no ``sgemm_`` the kernels take SciPy's: the same attention."""
    from gradsketch import _native_build

    if _native.native_kernels() is None:
        pytest.skip(f"native kernels unavailable: {train_status().reason}")
    scipy_gemm = _native_build.find_sgemm(torch_first=False)
    assert scipy_gemm is not None
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 4, 6, 8, generator=gen) for _ in range(3))
    k, v = k[:, :2], v[:, :2]  # grouped-query heads
    outs = []
    for gemm in (_native_build.blas_sgemm(), scipy_gemm):
        monkeypatch.setattr(_attention, "blas_sgemm", lambda gemm=gemm: gemm)
        with tf.dropout_stream(torch.Generator().manual_seed(5)):
            outs.append(_attention._attention_math(q, k, v, None, 0.25, None, True))
    np.testing.assert_allclose(outs[1].numpy(), outs[0].numpy(), rtol=1e-5, atol=1e-6)


def test_attention_without_dropout_is_sdpa_itself() -> None:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 5, 4, generator=gen) for _ in range(3))
    module = nn.Module()
    for training in (False, True):  # eval mode (transformers passes 0 there), or p = 0
        module.train(training)
        got, _ = tf.attention(module, q, k, v, None, dropout=0.0, scaling=0.5)
        want, _ = sdpa_attention_forward(module, q, k, v, None, dropout=0.0, scaling=0.5)
        assert torch.equal(got, want)


# ---------------------------------------------------------------- the copy
MODELS = {
    "gpt2": lambda: tiny_gpt2(dropout=0.1),
    "llama-gqa": lambda: _with_attention_dropout(tiny_llama(), 0.1),
    "neox": lambda: _with_attention_dropout(tiny_neox(), 0.1),
}


def _with_attention_dropout(model: nn.Module, p: float) -> nn.Module:
    model.config.attention_dropout = p
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            value = module.attention_dropout
            if isinstance(value, nn.Dropout):
                value.p = p
            else:
                module.attention_dropout = p
    return model


def _ids(model: nn.Module, rows: int = 3) -> torch.Tensor:
    return token_data(rows) % model.config.vocab_size


@pytest.mark.parametrize("name", sorted(MODELS))
def test_train_copy_leaves_the_model_alone_and_keeps_its_eval_function(name: str) -> None:
    model = MODELS[name]()
    types = [type(m) for m in model.modules()]
    ids = _ids(model)
    work = tf.train_copy(model, CPU, loss_fn=per_token_loss, probe=ids[:1])
    assert [type(m) for m in model.modules()] == types
    assert model.config._attn_implementation == "sdpa"
    assert work.config._attn_implementation == tf.ATTENTION_NAME
    assert not any(type(m) is nn.Dropout for m in work.modules())
    with torch.no_grad():
        want = per_token_loss(model.eval(), ids).double()
        got = per_token_loss(work.eval(), ids).double()
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_train_mode_copy_with_masks_of_ones_is_the_models_eval_function(
    name: str, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With every dropout probability 1e-7 (q = round(p * 65536) = 0: masks all ones) the
    copy in train mode still takes the explicit attention path (dropout > 0: masks,
    grouped heads, scaling, the fused native softmax) and must compute the model's
    dropout-free function."""
    model = MODELS[name]()
    ids = _ids(model)
    work = _with_attention_dropout(
        tf.train_copy(model, CPU, loss_fn=per_token_loss, probe=ids[:1]), 1e-7
    )
    for module in work.modules():
        if isinstance(module, tf.SeededDropout):
            module.p = 1e-7
    calls: list[int] = []
    explicit = _attention._attention_math

    def spy(*args: Any) -> torch.Tensor:
        calls.append(1)
        return explicit(*args)

    monkeypatch.setattr(_attention, "_attention_math", spy)
    with torch.no_grad():
        want = per_token_loss(model.eval(), ids).double()
        got = per_token_loss(work.train(), ids).double()
    assert calls  # the attention went through the explicit path
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)


def test_train_mode_loss_has_the_expectation_of_torch_dropout() -> None:
    """Mean train-mode loss over N = 300 forward passes, copy against model (torch's
    dropout): both estimate E[loss] under the same dropout law (up to the 2**-17 rounding
    of p), so their difference over its standard error sqrt(s1^2/N + s2^2/N) is about
    N(0, 1); |z| < 5 fails by chance with probability 6e-7."""
    model = tiny_gpt2(dropout=0.1)
    ids = _ids(model, rows=2)
    work = tf.train_copy(model, CPU, loss_fn=per_token_loss, probe=ids[:1])
    n = 300
    torch.manual_seed(0)
    with torch.no_grad(), tf.dropout_stream(torch.Generator().manual_seed(0)):
        ours = torch.stack([per_token_loss(work.train(), ids).mean() for _ in range(n)])
        theirs = torch.stack([per_token_loss(model.train(), ids).mean() for _ in range(n)])
    se = math.sqrt(float(ours.var()) / n + float(theirs.var()) / n)
    z = (float(ours.mean()) - float(theirs.mean())) / se
    assert abs(z) < 5, z
    assert float(ours.std()) > 0  # dropout is on


def test_global_generator_detection() -> None:
    model = tiny_gpt2(dropout=0.1)
    ids = _ids(model, rows=1)
    work = tf.train_copy(model, CPU, loss_fn=per_token_loss, probe=ids)
    state = torch.random.get_rng_state()
    assert tf.uses_global_generator(model, per_token_loss, ids)
    assert not tf.uses_global_generator(work, per_token_loss, ids)
    assert torch.equal(state, torch.random.get_rng_state())  # the check restores it
    model.eval()
    tf.uses_global_generator(model, per_token_loss, ids)
    assert not model.training


def test_stream_draws_counts_whole_seeds_and_nothing_else() -> None:
    """The count of seeds leaves a stream where the forward pass would; a pass that takes
    other than whole seeds from it, or draws from torch's global generator, has none."""
    model = tiny_gpt2(dropout=0.1)
    ids = _ids(model, rows=2)
    work = tf.train_copy(model, CPU, loss_fn=per_token_loss, probe=ids)
    count = tf.stream_draws(lambda: per_token_loss(work.train(), ids))
    assert count is not None and count > 0
    ran, skipped = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    with tf.dropout_stream(ran), torch.inference_mode():
        per_token_loss(work, ids)
    tf.skip_seeds(skipped, count)
    assert torch.equal(ran.get_state(), skipped.get_state())
    state = torch.random.get_rng_state()
    assert tf.stream_draws(lambda: per_token_loss(model.train(), ids)) is None
    assert torch.equal(state, torch.random.get_rng_state())  # restored
    assert tf.stream_draws(lambda: torch.rand(3, generator=_dropout.stream())) is None
    stream = _dropout.stream
    assert (
        tf.stream_draws(lambda: [_dropout.draw_seed(stream()) for _ in range(9)], limit=8) is None
    )


def test_a_model_whose_mask_code_disagrees_keeps_its_attention(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """If the copy's eval-mode loss moves when attention is swapped, the swap is undone."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def wrong(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        out, _ = sdpa_attention_forward(*args, **kwargs)
        return out + 1.0, None

    _attention._register()
    monkeypatch.setitem(AttentionInterface._global_mapping, tf.ATTENTION_NAME, wrong)
    model = tiny_gpt2(dropout=0.1)
    work = tf.train_copy(model, CPU, loss_fn=per_token_loss, probe=_ids(model, rows=1))
    assert work.config._attn_implementation == "sdpa"
    assert work.training == model.training


def _loss_with_global_dropout(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.dropout(per_token_loss(model, ids), 0.5, training=True)


def test_the_swap_check_is_deterministic_for_a_random_loss() -> None:
    """A loss drawing from the global generator even in eval mode sees the same draws in
    both checked passes (else the swap would depend on whether two dropout masks happen
    to coincide, and processes would disagree), and the generator is left as found."""
    model = tiny_gpt2(dropout=0.1)
    ids = _ids(model, rows=2)
    for seed in range(5):
        torch.manual_seed(seed)
        state = torch.random.get_rng_state()
        work = tf.train_copy(model, CPU, loss_fn=_loss_with_global_dropout, probe=ids)
        assert work.config._attn_implementation == tf.ATTENTION_NAME
        assert torch.equal(state, torch.random.get_rng_state())


# ------------------------------------------------------------------ threads
def _chain_like(shared: int, job: int) -> tuple[int, float]:
    gen = torch.Generator().manual_seed(shared + job)
    with tf.dropout_stream(gen):
        return job, float(tf.dropout(torch.ones(1000), 0.5).sum())


def test_jobs_in_threads_give_the_results_of_one_by_one() -> None:
    one = dict(run_jobs(_chain_like, [0, 1, 2, 3], cores=1, shared=7))
    two = dict(run_jobs(_chain_like, [0, 1, 2, 3], cores=2, shared=7, backend="threads"))
    assert one == two
    with pytest.raises(ValueError, match=r"`backend` must be one of"):
        list(run_jobs(_chain_like, [0], cores=1, shared=7, backend="fork"))


def _failing(shared: int, job: int) -> int:
    if job == 1:
        raise RuntimeError("job 1 failed")
    return job


def test_a_failing_thread_job_raises_here() -> None:
    with pytest.raises(RuntimeError, match="job 1 failed"):
        list(run_jobs(_failing, [0, 1, 2], cores=2, shared=0, backend="threads"))


# ------------------------------------------------------------------ fast_path
def test_fast_path_off_is_the_models_own_train_function() -> None:
    """``fast_path="off"``: the model's own modules, and under ``fast_kernels(False)``
    torch's cross-entropy: from the same global seed the same bits as the model itself."""
    model = tiny_gpt2(dropout=0.1)
    ids = _ids(model)
    work = tf.train_copy(model, CPU, loss_fn=per_token_loss, probe=ids[:1], fast_path="off")
    assert [type(m) for m in work.modules()] == [type(m) for m in model.modules()]
    assert work.config._attn_implementation == "sdpa"
    assert tf.engaged(work)["modules"] == []
    with tf.fast_kernels(False):
        assert tf.engaged(work) == {"modules": [], "kernels": "torch"}
        torch.manual_seed(3)
        got = per_token_loss(work.train(), ids)
    torch.manual_seed(3)
    logits = model.train()(ids).logits[:, :-1]
    want = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
    ).view(ids.shape[0], -1)
    assert torch.equal(got, want)


def test_fast_kernels_false_gives_torchs_cross_entropy_bits() -> None:
    gen = torch.Generator().manual_seed(0)
    logits, targets = torch.randn(7, 50, generator=gen), torch.randint(0, 50, (7,), generator=gen)
    with tf.fast_kernels(False):
        got = tf.token_cross_entropy(logits, targets)
        assert _native.native_kernels() is None
    assert torch.equal(got, F.cross_entropy(logits, targets, reduction="none"))


def test_fast_path_errors() -> None:
    model = tiny_gpt2()
    with pytest.raises(ValueError, match=r"`fast_path` must be one of \['auto', 'off'\], got 'on'"):
        tf.train_copy(model, CPU, loss_fn=per_token_loss, probe=_ids(model, 1), fast_path="on")


@pytest.mark.parametrize(
    "device",
    [
        pytest.param(torch.device("meta"), id="meta"),
        pytest.param(
            torch.device("cuda"),
            id="cuda",
            marks=pytest.mark.gpu,
        ),
    ],
)
def test_off_cpu_nothing_is_swapped(device: torch.device) -> None:
    """CPU-only: on CUDA sdpa keeps its fused kernels (the explicit maths would be O(T^2))."""
    model = tiny_gpt2(dropout=0.1)
    work = tf.train_copy(model, device, loss_fn=per_token_loss, probe=_ids(model, 1))
    assert work.config._attn_implementation == "sdpa"
    assert tf.engaged(work) == {"modules": [], "kernels": "torch"}
    assert all(p.device.type == device.type for p in work.parameters())


def test_attention_is_probed_in_train_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """An explicit attention that is wrong only in training (where it runs; eval mode is
    sdpa itself) is caught by the probe and the swap undone."""
    explicit = _attention._attention_math

    def off_by_a_bit(*args: Any) -> torch.Tensor:
        return explicit(*args) + 1e-3

    monkeypatch.setattr(_attention, "_attention_math", off_by_a_bit)
    model = tiny_gpt2(dropout=0.1)
    work = tf.train_copy(model, CPU, loss_fn=per_token_loss, probe=_ids(model, 1))
    assert work.config._attn_implementation == "sdpa"
    assert "attention" not in tf.engaged(work)["modules"]
    monkeypatch.setattr(_attention, "_attention_math", explicit)
    work = tf.train_copy(model, CPU, loss_fn=per_token_loss, probe=_ids(model, 1))
    assert tf.engaged(work)["modules"] == ["attention", "dropout", "gelu"]


def test_attention_without_dropout_in_training_is_not_swapped() -> None:
    """Llama's attention dropout is 0: the replacement would be sdpa itself, so it stays."""
    model = tiny_llama()
    work = tf.train_copy(model, CPU, loss_fn=per_token_loss, probe=_ids(model, 1))
    assert work.config._attn_implementation == "sdpa"
    assert "attention" not in tf.engaged(work)["modules"]


def test_a_transformers_without_the_interfaces_keeps_sdpa(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A transformers without ``masking_utils`` (before 4.53): the copy keeps sdpa and says
    why, not ImportError. The model is built first (its own imports need the module)."""
    import sys

    model = tiny_gpt2(dropout=0.1)
    monkeypatch.setattr(_attention, "_REGISTERED", False)
    monkeypatch.setitem(sys.modules, "transformers.masking_utils", None)
    with caplog.at_level("WARNING", logger=_attention.__name__):
        work = tf.train_copy(model, CPU, loss_fn=per_token_loss, probe=_ids(model, 1))
    assert work.config._attn_implementation == "sdpa"
    assert tf.engaged(work)["modules"] == ["dropout", "gelu"]
    assert "transformers>=5.0" in caplog.text and "keeps sdpa" in caplog.text


# ------------------------------------------------------------------ one hash
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_native_and_torch_dropout_draw_the_same_mask(
    p: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One counter-based hash (:func:`dropout_bits`) in C and in torch: bit-equal outputs,
    forward and backward, from the same stream (odd sizes: partial blocks of four)."""
    if _native.native_kernels() is None:
        pytest.skip(f"native kernels unavailable: {train_status().reason}")
    x = torch.randn(3, 1037, generator=torch.Generator().manual_seed(1))
    outs, grads = [], []
    for native in (True, False):
        with monkeypatch.context() as patch:
            if not native:
                patch.setattr(_native, "native_kernels", lambda: None)
            leaf = x.clone().requires_grad_(True)
            with tf.dropout_stream(torch.Generator().manual_seed(7)):
                y = tf.dropout(leaf, p)
            y.backward(torch.ones_like(y))
            outs.append(y.detach())
            grads.append(leaf.grad)
    assert torch.equal(outs[0], outs[1]) and torch.equal(grads[0], grads[1])
    assert 0 < int((outs[0] == 0).sum()) < x.numel()


def test_dropout_bits_are_the_c_kernels_lanes() -> None:
    """``gs_dropout_f32`` keeps element i exactly when ``dropout_bits(seed, n)[i] >= q``."""
    if _native.native_kernels() is None:
        pytest.skip(f"native kernels unavailable: {train_status().reason}")
    kernel = _native.native_kernels()["dropout"]  # type: ignore[index]
    n = 4099
    ones = torch.ones(n)
    for seed in (1, 2**63 + 5, 2**64 - 1, 123456789):
        q, scale = _dropout.drop_rule(0.3)
        out = torch.empty(n)
        kernel(ones.data_ptr(), out.data_ptr(), n, seed, q, scale)
        assert torch.equal(tf.dropout_bits(seed, n) >= q, out != 0), seed


def test_native_and_torch_attention_drop_the_same_weights(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fused kernel and torch's path with the same stream: the same output up to float
    rounding (another mask would move it by O(1))."""
    if _native.native_kernels() is None:
        pytest.skip(f"native kernels unavailable: {train_status().reason}")
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 4, 6, 8, generator=gen) for _ in range(3))
    k, v = k[:, :2], v[:, :2]  # grouped-query heads
    outs = []
    for native in (True, False):
        with monkeypatch.context() as patch:
            if not native:
                patch.setattr(_native, "native_kernels", lambda: None)
            with tf.dropout_stream(torch.Generator().manual_seed(5)):
                outs.append(_attention._attention_math(q, k, v, None, 0.25, None, True))
    np.testing.assert_allclose(outs[1].numpy(), outs[0].numpy(), rtol=1e-5, atol=1e-6)
