"""The working copy's RMSNorm and SwiGLU blocks: native kernels against float64, swaps exact.

Tolerances: every kernel computes in float32 with a few roundings per element
(a row reduction of d = 64 terms for RMSNorm), so its error against the
float64 reference is a small multiple of float32's unit roundoff 6e-8 times
the values' scale; ``rtol = atol = 2e-5`` leaves a factor of about 100 for
the reduction and the exponential's few-ulp error, and is still a
thousand times tighter than a wrong formula (a missing factor, a wrong
sign) would pass.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _slt_helpers import tiny_gpt2, tiny_llama, tiny_qwen2, token_data
from torch import nn
from torch.nn import functional as F

from gradsketch.slt import _fast as tf
from gradsketch.slt import per_token_loss, sample
from gradsketch.slt._fast._fused_blocks import FusedRMSNorm, SwiGLU, rms_norm, swap_blocks, swiglu
from gradsketch.slt._fast._native import train_library

TOL: dict[str, Any] = dict(rtol=2e-5, atol=2e-5)
native = pytest.mark.skipif(train_library() is None, reason="no C compiler: no native kernels")


def _rms_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@native
def test_rms_norm_kernel_matches_float64_forward_and_backward() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 7, 64, generator=gen) * 3
    w = torch.randn(64, generator=gen)
    g = torch.randn(5, 7, 64, generator=gen)
    x32, w32 = x.clone().requires_grad_(), w.clone().requires_grad_()
    y32 = rms_norm(x32, w32, 1e-6)
    assert y32.grad_fn is not None and "Native" in type(y32.grad_fn).__name__
    (y32 * g).sum().backward()
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    y64 = _rms_ref(x64, w64, 1e-6)
    (y64 * g.double()).sum().backward()
    torch.testing.assert_close(y32.double(), y64.detach(), **TOL)
    assert x32.grad is not None and w32.grad is not None
    assert x64.grad is not None and w64.grad is not None
    torch.testing.assert_close(x32.grad.double(), x64.grad, **TOL)
    # dw sums 35 rows: its scale is the sum's, so compare relative to it.
    torch.testing.assert_close(w32.grad.double(), w64.grad, rtol=2e-5, atol=2e-5 * 35)
    with torch.inference_mode():
        torch.testing.assert_close(rms_norm(x, w, 1e-6), y32.detach(), rtol=0, atol=0)


@native
@pytest.mark.parametrize("packed", [False, True], ids=["apart", "halves-of-one-product"])
def test_swiglu_kernel_matches_float64_forward_and_backward(packed: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    gu = torch.randn(3, 5, 2 * 48, generator=gen) * 4
    g = torch.randn(3, 5, 48, generator=gen)
    leaf = gu.clone().requires_grad_()
    if packed:
        gate, up = leaf[..., :48], leaf[..., 48:]
    else:
        gate, up = leaf[..., :48].contiguous(), leaf[..., 48:].contiguous()
    y = swiglu(gate, up)
    assert y.grad_fn is not None and "Native" in type(y.grad_fn).__name__
    (y * g).sum().backward()
    ref = gu.double().requires_grad_()
    y64 = F.silu(ref[..., :48]) * ref[..., 48:]
    (y64 * g.double()).sum().backward()
    torch.testing.assert_close(y.double(), y64.detach(), **TOL)
    assert leaf.grad is not None and ref.grad is not None
    torch.testing.assert_close(leaf.grad.double(), ref.grad, **TOL)
    with torch.inference_mode():
        torch.testing.assert_close(swiglu(gate, up), y.detach(), rtol=0, atol=0)


def test_torch_twins_are_the_reference_formulas_in_float64() -> None:
    """Without kernels (float64 tensors) the twins are the textbook formulas, exactly."""
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(4, 16, generator=gen, dtype=torch.float64), torch.randn(16).double()
    # Llama's RMSNorm computes in float32 whatever the input's dtype; so does the twin.
    want = w * _rms_ref(x.float(), torch.ones(16), 1e-5).double()
    torch.testing.assert_close(rms_norm(x, w, 1e-5), want, rtol=0, atol=0)
    gate, up = x[:, :8], x[:, 8:]
    torch.testing.assert_close(swiglu(gate, up), F.silu(gate) * up, rtol=0, atol=0)


@pytest.mark.parametrize("build", [tiny_llama, tiny_qwen2], ids=["llama", "qwen2"])
def test_swap_keeps_names_order_and_the_function(build) -> None:  # type: ignore[no-untyped-def]
    """Float64 (torch twins): the swapped model's loss and gradients are the model's own."""
    model = build().double().train()
    work = copy.deepcopy(model)
    assert swap_blocks(work) == ["rmsnorm", "swiglu"]
    assert [n for n, _ in work.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert any(isinstance(m, FusedRMSNorm) for m in work.modules())
    assert any(isinstance(m, SwiGLU) for m in work.modules())
    ids = token_data(6) % 64
    want, got = per_token_loss(model, ids), per_token_loss(work, ids)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    want.mean().backward()
    got.mean().backward()
    for (name, p), q in zip(model.named_parameters(), work.parameters()):
        assert p.grad is not None and q.grad is not None, name
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-10, atol=1e-12, msg=name)


@native
def test_train_copy_engages_the_blocks_and_matches_the_model_in_float32() -> None:
    model = tiny_llama().train()
    ids = token_data(8) % 64
    work = tf.train_copy(model, torch.device("cpu"), loss_fn=per_token_loss, probe=ids[:1])
    assert tf.engaged(work) == {"modules": ["rmsnorm", "rotary", "swiglu"], "kernels": "native"}
    with torch.inference_mode():
        want, got = per_token_loss(model, ids), per_token_loss(work, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    plain = tf.train_copy(
        model, torch.device("cpu"), loss_fn=per_token_loss, probe=ids[:1], fast_path="off"
    )
    assert tf.engaged(plain)["modules"] == []
    gpt2 = tf.train_copy(tiny_gpt2(), torch.device("cpu"), loss_fn=per_token_loss, probe=ids[:1])
    assert not {"rmsnorm", "swiglu"} & set(tf.engaged(gpt2)["modules"])


class OnePlusRMSNorm(nn.Module):
    """Gemma's form, ``(1 + w) * norm(x)``: another function, which must keep its module."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d))
        self.eps = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (1 + self.weight) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class GeluMLP(nn.Module):
    """A gated MLP whose activation is not SiLU: not a SwiGLU."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(4, 8), nn.Linear(4, 8)
        self.down_proj, self.act_fn = nn.Linear(8, 4), nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def test_other_forms_keep_their_own_modules() -> None:
    net = nn.Sequential(OnePlusRMSNorm(4), GeluMLP())
    assert swap_blocks(net) == []
    assert type(net[0]) is OnePlusRMSNorm and type(net[1]) is GeluMLP


@native
def test_same_seed_same_chains_and_the_store_names_the_blocks(tmp_path: Path) -> None:
    """On the fast path (native blocks) a seed fixes the chains bit for bit, and the store's
    ``gradsketch_fast_path`` lists the blocks; ``"off"`` lists none."""
    data = token_data(16) % 64
    kw: dict[str, Any] = dict(
        lr=1e-4, n_beta=20.0, localization=100.0, num_chains=2, num_draws=3, batch_size=4,
        batches_per_draw=1, num_init_loss_batches=2, device="cpu",
    )  # fmt: skip
    runs = [
        sample(tiny_llama(), data, {"train": data}, output_path=tmp_path / f"{i}.zarr", **kw)
        for i in range(2)
    ]
    first, second = (r.dataset for r in runs)
    for name in ("init_loss", "sampling_loss", "sampling_loss_micro", "loss_train"):
        np.testing.assert_array_equal(first[name].values, second[name].values, err_msg=name)
    record = first.attrs["gradsketch_fast_path"]
    assert {"rmsnorm", "swiglu"} <= set(record[0]["modules"])
    off = sample(tiny_llama(), data, {"train": data}, output_path=tmp_path / "off.zarr",
                 fast_path="off", **kw)  # fmt: skip
    assert off.dataset.attrs["gradsketch_fast_path"][0]["modules"] == []
