"""The working copy's rotary embedding (``gradsketch.slt._fast._rotary``): the model's own bits.

``gs_rotary_f32`` rounds each product and each sum as torch's element-wise
kernels do (no fused multiply-add), so the rotated queries and keys, and
their gradients, equal transformers' ``x * cos + rotate_half(x) * sin``
exactly on every CPU: the tests compare bit for bit, and against float64
for the maths itself.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import pytest
import torch
from _slt_helpers import tiny_gpt2, tiny_llama, tiny_neox, tiny_qwen2, token_data

from gradsketch.slt import _fast as tf
from gradsketch.slt._data import per_token_loss
from gradsketch.slt._fast import _rotary
from gradsketch.slt._fast._native import train_library
from helpers.hf_families import DECODERS_BY_NAME

transformers = pytest.importorskip("transformers")
native = pytest.mark.skipif(train_library() is None, reason="no C compiler: no native kernels")


def _reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dim: int) -> torch.Tensor:
    """The formula in float64: the first ``r`` values of each head rotate in halves."""
    x, cos, sin = x.double(), cos.double().unsqueeze(dim), sin.double().unsqueeze(dim)
    r = cos.shape[-1]
    lo, hi, rest = x[..., : r // 2], x[..., r // 2 : r], x[..., r:]
    c1, c2, s1, s2 = cos[..., : r // 2], cos[..., r // 2 :], sin[..., : r // 2], sin[..., r // 2 :]
    return torch.cat((lo * c1 - hi * s1, hi * c2 + lo * s2, rest), dim=-1)


CASES = [
    # (x's shape before the view, heads dim, rotary width, cos batch): a Llama layout
    # ([b, t, h, d] memory seen as [b, h, t, d]), GPT-NeoX's partial rotation, heads
    # second, a cos shared by the batch, and head widths of the switch's cases and not.
    pytest.param((3, 5, 4, 16), 1, 16, 3, id="llama-layout"),
    pytest.param((3, 5, 4, 16), 1, 4, 3, id="partial"),
    pytest.param((3, 5, 2, 32), 2, 32, 1, id="heads-second-shared-cos"),
    pytest.param((2, 7, 3, 12), 1, 12, 2, id="odd-width"),
    pytest.param((2, 3, 2, 128), 1, 64, 2, id="wide"),
]


def _case(shape: tuple[int, ...], dim: int, rot: int, cos_batch: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    b, t, h, d = shape
    memory = torch.randn(b, t, h, d, generator=g)
    x = memory.transpose(1, 2) if dim == 1 else memory  # heads at `dim`, tokens at 3 - dim
    cos = torch.randn(cos_batch, t, rot, generator=g)
    sin = torch.randn(cos_batch, t, rot, generator=g)
    return x, cos, sin


@native
@pytest.mark.parametrize(("shape", "dim", "rot", "cos_batch"), CASES)
def test_kernel_is_torchs_formula_bit_for_bit_forward_and_backward(
    shape: tuple[int, ...], dim: int, rot: int, cos_batch: int
) -> None:
    """Forward: the torch twin's bits, and float64's values to float32 rounding. Backward:
    the bits of autograd through the twin (two products and a sum per element)."""
    x, cos, sin = _case(shape, dim, rot, cos_batch)
    xa = x.detach().clone().requires_grad_(True)
    xb = x.detach().clone().requires_grad_(True)
    got = _rotary.rotary(xa, cos, sin, dim)
    want = _rotary._torch_rotary(xb, cos, sin, dim)
    assert torch.equal(got, want)
    torch.testing.assert_close(got.double(), _reference(x, cos, sin, dim), rtol=1e-6, atol=1e-6)
    grad = torch.randn(got.shape, generator=torch.Generator().manual_seed(1))
    got.backward(grad)
    want.backward(grad)
    assert torch.equal(xa.grad, xb.grad)
    # The transpose in float64: <R x, g> = <x, R^T g> for the rotation R.
    transposed = torch.autograd.functional.vjp(
        lambda v: _reference(v, cos, sin, dim), x.double(), grad.double()
    )[1]
    torch.testing.assert_close(xa.grad.double(), transposed, rtol=1e-6, atol=1e-6)


def test_off_the_kernel_the_torch_twin_runs() -> None:
    """float64 (and any device or dtype the kernel does not take): torch's operations."""
    x, cos, sin = (t.double() for t in _case((2, 3, 2, 8), 1, 8, 2))
    torch.testing.assert_close(_rotary.rotary(x, cos, sin), _reference(x, cos, sin, 1))
    with tf.fast_kernels(False):
        y32 = _case((2, 3, 2, 8), 1, 8, 2)
        assert torch.equal(_rotary.rotary(*y32), _rotary._torch_rotary(*y32, 1))


def _grads(work: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Loss and gradients of a train-mode pass, dropout masks from one seed."""
    work.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # OPT's functional dropout draws from torch's generator
    with tf.dropout_stream(torch.Generator().manual_seed(0)):
        loss = per_token_loss(work, ids)
    loss.mean().backward()
    return loss.detach(), [p.grad.clone() for p in work.parameters() if p.grad is not None]


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per call of the rotary kernel (forward or backward) during the test."""
    calls: list[int] = []
    real = _rotary._rotary_kernel

    def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(_rotary, "_rotary_kernel", counting)
    return calls


def _assert_same(
    fused: tuple[torch.Tensor, list[torch.Tensor]], own: tuple[torch.Tensor, list[torch.Tensor]]
) -> None:
    """The same loss and the same gradients, bit for bit."""
    assert torch.equal(fused[0], own[0])
    assert len(fused[1]) == len(own[1])
    for a, b in zip(fused[1], own[1]):
        assert torch.equal(a, b)


def _without_rotary(work: torch.nn.Module) -> list[tuple[dict[int, Any], dict[int, Any]]]:
    """Take the copy's rotary switch (its two forward hooks) off; :func:`_put_back` restores."""
    taken = []
    for hooks, fn in (
        (work._forward_pre_hooks, _rotary._enter),
        (work._forward_hooks, _rotary._leave),
    ):
        mine = {k: h for k, h in hooks.items() if h is fn}
        for key in mine:
            del hooks[key]
        taken.append((hooks, mine))
    return taken


def _put_back(taken: list[tuple[dict[int, Any], dict[int, Any]]]) -> None:
    for hooks, mine in taken:
        hooks.update(mine)


@native
@pytest.mark.parametrize(
    "build", [tiny_llama, tiny_qwen2, tiny_neox], ids=["llama", "qwen2", "neox"]
)
def test_the_working_copy_rotates_with_the_kernel_and_the_models_bits(
    build: Any, kernel_calls: list[int]
) -> None:
    """Train mode, float32: the copy's loss and every gradient with the kernel equal those
    with transformers' own rotation bit for bit, and the kernel did run."""
    model = build().train()
    ids = token_data(6) % 64
    work = tf.train_copy(model, torch.device("cpu"), loss_fn=per_token_loss, probe=ids[:1])
    assert "rotary" in tf.engaged(work)["modules"]
    kernel_calls.clear()  # the probe's
    fused = _grads(work, ids)
    assert len(kernel_calls) == 8  # forward and backward of q and k in 2 layers
    taken = _without_rotary(work)
    assert "rotary" not in tf.engaged(work)["modules"]
    _assert_same(fused, _grads(work, ids))
    _put_back(taken)


@native
def test_only_the_accepted_copy_in_its_own_forward_takes_the_kernel(
    kernel_calls: list[int],
) -> None:
    """The wrapper in transformers' module calls the original for the model itself, for a
    copy under ``fast_kernels(False)`` and in another thread's plain forward."""
    model = tiny_llama().train()
    ids = token_data(4) % 64
    work = tf.train_copy(model, torch.device("cpu"), loss_fn=per_token_loss, probe=ids[:1])
    module = sys.modules[type(model.model.layers[0].self_attn).__module__]
    assert getattr(module, _rotary.FUNCTION).__gradsketch_original__ is not None
    kernel_calls.clear()  # the probe's
    with torch.no_grad():
        per_token_loss(model, ids)
        assert kernel_calls == []
        with tf.fast_kernels(False):
            per_token_loss(work, ids)
        assert kernel_calls == []
        thread = threading.Thread(target=lambda: per_token_loss(model, ids))
        thread.start()
        thread.join()
        assert kernel_calls == []
        per_token_loss(work, ids)
        assert len(kernel_calls) == 4  # q and k of 2 layers


def test_a_model_without_rotary_keeps_its_own_and_gets_no_hooks() -> None:
    model = tiny_gpt2()
    ids = token_data(4) % 64
    work = tf.train_copy(model, torch.device("cpu"), loss_fn=per_token_loss, probe=ids[:1])
    assert "rotary" not in tf.engaged(work)["modules"]
    assert not _rotary.swapped(work)
    assert not _rotary.swap_rotary(torch.nn.Linear(2, 2), lambda: None)


def test_a_failing_probe_keeps_the_models_rotation() -> None:
    model = tiny_llama().train()

    def probe() -> None:
        raise RuntimeError("the probe's loss fails")

    assert not _rotary.swap_rotary(model, probe)
    assert not _rotary.swapped(model)


#: Decoder families whose ``apply_rotary_pos_emb`` is the half-split rotation the kernel
#: computes (GPT-NeoX, Phi and StableLM on part of each head); the others have no rotary
#: embedding (GPT-2, GPT-Neo, BLOOM, OPT, BigCode) or rotate interleaved pairs (GPT-J).
HALF_SPLIT = {
    "gpt_neox", "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi",
    "phi3", "falcon", "falcon_grouped", "olmo", "stablelm", "mixtral", "qwen2_moe",
}  # fmt: skip


@native
# transformers 5.0's GPT BigCode module calls torch.jit.script at import (make test-oldest).
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("name", sorted(DECODERS_BY_NAME))
def test_every_decoder_family_rotates_with_its_own_bits(name: str) -> None:
    """Every decoder family of the attribution matrix: the kernel engages exactly on the
    half-split families, and the copy's loss and gradients are the model's rotation's."""
    model = DECODERS_BY_NAME[name].build(torch.float32).train()
    ids = token_data(4) % 64
    work = tf.train_copy(model, torch.device("cpu"), loss_fn=per_token_loss, probe=ids[:1])
    engaged = "rotary" in tf.engaged(work)["modules"]
    assert engaged == (name in HALF_SPLIT)
    fused = _grads(work, ids)
    taken = _without_rotary(work)
    _assert_same(fused, _grads(work, ids))
    _put_back(taken)
