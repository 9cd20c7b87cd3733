"""Seeded dropout of the working copy: masks from a counter-based hash, seeds from a stream.

A mask keeps an element with probability ``1 - q / 65536``, ``q = round(p *
65536)``, from 16 random bits per element, and scales kept ones by ``65536 /
(65536 - q)``, so the output's expectation is exactly the input; the drop
probability differs from ``p`` by at most ``2**-17`` (``p = 0.1``:
``0.1000061``). torch's ``bernoulli_`` draws a double per element instead.
The bits are one counter-based hash (:func:`dropout_bits`, SplitMix64 of the
element's index under one seed per call drawn from the stream) in C and in
torch, so a backward pass recomputes its mask instead of storing it, and a
seed gives the same chains with and without a C compiler.

Every mask comes from the generator installed by :func:`dropout_stream` in
the calling thread (torch's default generator when none is), so a chain's
masks depend on its seed only: chains may run in threads of one process
and give the bits they give one after another (:func:`uses_global_generator`
tells whether anything else in a model's forward still draws from torch's
global generator).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from gradsketch.slt._fast import _native

__all__ = [
    "SeededDropout",
    "draw_seed",
    "drop_rule",
    "dropout",
    "dropout_bits",
    "dropout_stream",
    "skip_seeds",
    "stream",
    "stream_draws",
    "uses_global_generator",
]

_BITS = 65536  # 16 random bits per element
#: This thread's dropout generator (:func:`dropout_stream`), in ``.generator``.
_STREAM = threading.local()


def drop_rule(p: float) -> tuple[int, float]:
    """``(q, scale)``: drop when 16 random bits are below ``q``; scale kept elements.

    ``q = round(p * 65536)`` and ``scale = 65536 / (65536 - q)``, so the
    expectation is exact (:func:`dropout`; the fused attention kernel too).
    """
    q = round(p * _BITS)
    return q, _BITS / (_BITS - q)


def stream() -> torch.Generator | None:
    """The :func:`dropout_stream` generator of the calling thread (None: torch's default)."""
    return getattr(_STREAM, "generator", None)


def draw_seed(generator: torch.Generator | None) -> int:
    """One 64-bit seed for a native kernel's hash, drawn from ``generator``."""
    word = torch.empty((), dtype=torch.int64).random_(-(2**63), None, generator=generator)
    return int(word) % 2**64


def _dropout_kernel(x: torch.Tensor, seed: int, q: int, scale: float, fn: Any) -> torch.Tensor:
    y = torch.empty_like(x)
    fn(x.data_ptr(), y.data_ptr(), x.numel(), seed, q, scale)
    return y


class _NativeDropout(torch.autograd.Function):
    """``gs_dropout_f32`` forward; backward applies the same (seed-determined) mask."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seed: int, q: int, scale: float, fn: Any) -> Any:
        ctx.args = (seed, q, scale, fn)
        return _dropout_kernel(x, seed, q, scale, fn)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        seed, q, scale, fn = ctx.args
        return _dropout_kernel(grad.contiguous(), seed, q, scale, fn), None, None, None, None


@contextlib.contextmanager
def dropout_stream(generator: torch.Generator | None) -> Iterator[None]:
    """Draw every :func:`dropout` mask of this thread from ``generator`` inside the block.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> with dropout_stream(g):
        ...     a = dropout(torch.ones(8), 0.5)
        >>> with dropout_stream(torch.Generator().manual_seed(0)):
        ...     b = dropout(torch.ones(8), 0.5)
        >>> torch.equal(a, b)
        True
    """
    before = stream()
    _STREAM.generator = generator
    try:
        yield
    finally:
        _STREAM.generator = before


def dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    """``x`` with each element zeroed with probability ``q / 65536`` (``q = round(p * 65536)``).

    Kept elements are scaled by ``65536 / (65536 - q)``, so ``E[dropout(x)] =
    x`` exactly. The mask is :func:`dropout_bits` of one seed drawn from the
    thread's :func:`dropout_stream` generator, the same on the native kernel
    (CPU float32) and on torch's operations, and independent of ``x``'s
    values; gradients flow through the kept elements (with the same scale),
    as ``torch.nn.functional.dropout``'s do.

    Example:
        >>> y = dropout(torch.ones(4, 4), 0.25)
        >>> sorted({round(v, 4) for v in y.flatten().tolist()} - {0.0})
        [1.3333]
    """
    if not 0.0 <= p < 1.0:
        raise ValueError(f"`p` must be in [0, 1), got {p!r}; pass a dropout probability.")
    q, scale = drop_rule(p)
    if q == 0:
        return x
    generator = stream()
    kernels = _native.native_for(x)
    if kernels is not None:
        args = (x, draw_seed(generator), q, scale, kernels["dropout"])
        return _NativeDropout.apply(*args) if _native.tracked(x) else _dropout_kernel(*args)  # type: ignore[no-any-return]
    keep = dropout_bits(draw_seed(generator), x.numel(), x.device).view(x.shape) >= q
    return x * keep.to(x.dtype).mul_(scale)


def _signed(value: int) -> int:
    """The int64 with the bits of the uint64 ``value``."""
    value %= 2**64
    return value - 2**64 if value >= 2**63 else value


_MIX = (_signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB))
_GOLDEN = _signed(0x9E3779B97F4A7C15)


def _shift_right(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 ``z`` read as uint64 (torch's ``>>`` is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def dropout_bits(seed: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16 mask bits of elements ``0 .. n - 1`` under ``seed``: int32 ``[n]`` in [0, 65536).

    Element ``i``'s are lane ``i % 4`` (little-endian 16-bit lanes) of
    SplitMix64's output function of ``seed + (i // 4) * 0x9E3779B97F4A7C15``
    (Steele, Lea and Flood 2014), in uint64 arithmetic: the counter-based
    hash of ``gs_train.c`` (``gs_lanes``), so the torch fallback and the
    native kernels drop the same elements for the same seed.

    Example:
        >>> dropout_bits(1, 4).tolist()
        [1509, 4107, 5661, 22162]
    """
    blocks = torch.arange((n + 3) // 4, dtype=torch.int64, device=device)
    z = blocks * _GOLDEN + _signed(seed)  # int64 products wrap as uint64's do
    z = (z ^ _shift_right(z, 30)) * _MIX[0]
    z = (z ^ _shift_right(z, 27)) * _MIX[1]
    z = z ^ _shift_right(z, 31)
    # Lane l of word b is bits 16 l .. 16 l + 15: element 4 b + l.
    lanes = torch.stack([_shift_right(z, 16 * lane) & 0xFFFF for lane in range(4)], dim=1)
    return lanes.reshape(-1)[:n].to(torch.int32)


class SeededDropout(nn.Dropout):
    """``nn.Dropout`` drawing its masks through :func:`dropout` (same ``p``, same ``inplace``).

    Example:
        >>> layer = SeededDropout(0.1).eval()
        >>> torch.equal(layer(torch.ones(3)), torch.ones(3))
        True
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return input
        return dropout(input, self.p)


def skip_seeds(generator: torch.Generator, count: int) -> None:
    """Draw ``count`` dropout seeds from ``generator`` and drop them (see :func:`stream_draws`)."""
    for _ in range(count):
        draw_seed(generator)


def stream_draws(
    forward: Callable[[], Any], device: torch.device | str = "cpu", *, limit: int = 4096
) -> int | None:
    """How many dropout seeds ``forward()`` draws from the thread's :func:`dropout_stream`.

    None when it draws from torch's global generator, or takes from the
    stream other than whole seeds (or more than ``limit``): then no count of
    :func:`skip_seeds` leaves the stream where ``forward()`` would.

    Example:
        >>> net = nn.Sequential(nn.Embedding(4, 4), SeededDropout(0.5), SeededDropout(0.5))
        >>> stream_draws(lambda: net.train()(torch.zeros(1, 3, dtype=torch.long)))
        2
        >>> stream_draws(lambda: nn.Dropout(0.5).train()(torch.ones(3)))  # global generator
    """
    probe = torch.Generator(device=device).manual_seed(0)
    cuda = torch.cuda.is_available() and torch.device(device).type == "cuda"
    if _draws_globally(forward, probe, cuda=cuda):
        return None
    after = probe.get_state()
    replay = torch.Generator(device=device).manual_seed(0)
    for count in range(limit + 1):
        if torch.equal(replay.get_state(), after):
            return count
        draw_seed(replay)
    return None


def _draws_globally(forward: Callable[[], Any], stream: torch.Generator, *, cuda: bool) -> bool:
    """Whether ``forward()`` on ``stream`` draws from torch's global generator.

    Run in inference mode; the CPU generator is checked, and the current CUDA
    one with ``cuda``. Their states are restored.
    """
    before = torch.random.get_rng_state()
    before_cuda = torch.cuda.get_rng_state() if cuda else None
    try:
        with dropout_stream(stream), torch.inference_mode():
            forward()
        return not torch.equal(before, torch.random.get_rng_state()) or (
            before_cuda is not None and not torch.equal(before_cuda, torch.cuda.get_rng_state())
        )
    finally:
        torch.random.set_rng_state(before)
        if before_cuda is not None:
            torch.cuda.set_rng_state(before_cuda)


def uses_global_generator(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor],
    probe: torch.Tensor,
) -> bool:
    """Whether a train-mode ``loss_fn(model, probe)`` draws from torch's global CPU generator.

    Chains may share a process only when it does not (their dropout then
    comes from each chain's own :func:`dropout_stream`).

    Example:
        >>> net = nn.Sequential(nn.Embedding(4, 4), SeededDropout(0.5))
        >>> loss = lambda m, ids: m(ids).sum(-1)[:, 1:]
        >>> uses_global_generator(net, loss, torch.zeros(1, 3, dtype=torch.long))
        False
        >>> uses_global_generator(nn.Sequential(nn.Embedding(4, 4), nn.Dropout(0.5)), loss,
        ...                       torch.zeros(1, 3, dtype=torch.long))
        True
    """
    was_training = model.training
    try:
        stream = torch.Generator(device=probe.device)
        return _draws_globally(lambda: loss_fn(model.train(), probe), stream, cuda=False)
    finally:
        model.train(was_training)
