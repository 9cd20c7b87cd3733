"""The sampler's working copy: :func:`train_copy` swaps in the fast path's pieces.

See :mod:`gradsketch.slt._fast` for what is swapped and why; :func:`engaged`
says what a copy runs (recorded in every sample store).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gradsketch.slt._fast import _native
from gradsketch.slt._fast._attention import ATTENTION_NAME, swap_attention
from gradsketch.slt._fast._dropout import SeededDropout, dropout_stream
from gradsketch.slt._fast._fused_blocks import FusedRMSNorm, SwiGLU, swap_blocks
from gradsketch.slt._fast._gelu import TanhGELU, is_tanh_gelu
from gradsketch.slt._fast._rotary import swap_rotary, swapped

__all__ = ["FAST_PATHS", "engaged", "train_copy"]

#: Values of ``sample(..., fast_path=...)``: the working copy's pieces and kernels where
#: they engage (CPU), or the model's own modules and torch's operations.
FAST_PATHS = ("auto", "off")


def _swap_modules(model: nn.Module, *, dropout_modules: bool) -> None:
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if is_tanh_gelu(child):
                setattr(parent, name, TanhGELU())
            elif dropout_modules and type(child) is nn.Dropout:
                swapped = SeededDropout(child.p, inplace=child.inplace)
                swapped.train(child.training)
                setattr(parent, name, swapped)


def train_copy(
    model: nn.Module,
    device: torch.device,
    *,
    loss_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor],
    probe: torch.Tensor,
    fast_path: str = "auto",
) -> nn.Module:
    """A deep copy of ``model`` on ``device`` with the faster train-mode pieces (module docstring).

    The pieces are swapped on CPU only, and only with ``fast_path="auto"``
    (``"off"``, or any other device, gives the plain copy: on CUDA sdpa's
    fused kernels and torch's dropout are already fast, and the explicit
    attention would be O(T²) in memory). The attention swap is probed in
    train mode, where it runs: on ``probe`` (a few token rows) every
    attention call with dropout is also computed by the explicit maths
    dropping nothing and by transformers' ``sdpa`` without dropout, which
    must agree; a model whose attention is never called with dropout in
    training (dropout 0), or whose mask code does not follow the interface,
    keeps its own. :func:`engaged` says what was swapped.

    Raises:
        ValueError: for a ``fast_path`` not in :data:`FAST_PATHS`.

    Example:
        >>> from transformers import GPT2Config, GPT2LMHeadModel
        >>> from gradsketch.slt import per_token_loss
        >>> m = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16))
        >>> fast = train_copy(m, torch.device("cpu"), loss_fn=per_token_loss,
        ...                   probe=torch.zeros(1, 4, dtype=torch.long))
        >>> type(fast.transformer.drop).__name__, fast.config._attn_implementation
        ('SeededDropout', 'gradsketch_sdpa')
        >>> m.config._attn_implementation
        'sdpa'
    """
    if fast_path not in FAST_PATHS:
        raise ValueError(
            f"`fast_path` must be one of {list(FAST_PATHS)}, got {fast_path!r}; 'off' runs "
            "the model's own modules with torch's operations."
        )
    work = copy.deepcopy(model).to(device)
    if fast_path == "off" or device.type != "cpu":
        return work
    _swap_modules(work, dropout_modules=True)
    swap_blocks(work)

    def train_mode_probe() -> None:
        # The probe's masks come from a generator of its own: torch's global one is
        # left as it was found (a loss_fn may still draw from it).
        was_training = work.training
        state = torch.random.get_rng_state()
        try:
            with dropout_stream(torch.Generator().manual_seed(0)), torch.inference_mode():
                loss_fn(work.train(), probe.to(device))
        finally:
            torch.random.set_rng_state(state)
            work.train(was_training)

    swap_rotary(work, train_mode_probe)
    swap_attention(work, train_mode_probe)
    return work


def engaged(model: nn.Module) -> dict[str, Any]:
    """What of the fast path a working copy runs: ``{"modules": [...], "kernels": ...}``.

    ``modules``: the pieces :func:`train_copy` swapped in (``"attention"``,
    ``"dropout"``, ``"gelu"``, ``"rmsnorm"``, ``"rotary"``, ``"swiglu"``); ``kernels``:
    ``"native"`` when the train library is loaded and the copy is on CPU
    (float32 tensors then run it, and so does :func:`token_cross_entropy`),
    else ``"torch"``.

    Example:
        >>> engaged(nn.Sequential(SeededDropout(0.1)))["modules"]
        ['dropout']
    """
    names = set()
    for module in model.modules():
        if isinstance(module, SeededDropout):
            names.add("dropout")
        elif isinstance(module, TanhGELU):
            names.add("gelu")
        elif isinstance(module, FusedRMSNorm):
            names.add("rmsnorm")
        elif isinstance(module, SwiGLU):
            names.add("swiglu")
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) == ATTENTION_NAME:
        names.add("attention")
    if swapped(model):
        names.add("rotary")
    on_cpu = all(p.device.type == "cpu" for p in model.parameters())
    native = on_cpu and not _native.plain() and _native.train_library() is not None
    return {"modules": sorted(names), "kernels": "native" if native else "torch"}
