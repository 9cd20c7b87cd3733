"""The sampler's working copy of a model: the same train-mode function, faster on CPU.

SGMCMC chains run the model in train mode, as devinterp does, so every
forward pass draws dropout masks, and on CPU the train-mode forward of a
Hugging Face model spends about as much time in element-wise operations as
in its matrix products. :func:`train_copy` returns a deep copy (the
caller's model is never changed) whose pieces compute the same function
with fewer passes over memory:

* ``nn.Dropout`` modules become :class:`SeededDropout` (:func:`dropout`):
  a mask keeps an element with probability ``1 - q / 65536``, ``q =
  round(p * 65536)``, from 16 random bits per element, and scales kept ones
  by ``65536 / (65536 - q)``, so the output's expectation is exactly the
  input; the drop probability differs from ``p`` by at most ``2**-17``
  (``p = 0.1``: ``0.1000061``). torch's ``bernoulli_`` draws a double per
  element instead.
* Attention with dropout (PyTorch's fused kernels take none on CPU, so
  ``sdpa`` falls back to its slower math path) runs :func:`attention`:
  on CPU float32, one native kernel per batch and head computes the scores
  with BLAS ``sgemm`` from query, key and value where they lie (the
  head-major views of a projection: no copies), then scale, causal mask,
  softmax and dropout in cache, then the values into the ``[b, q, h, d]``
  output; elsewhere the same in torch operations. Without dropout (eval
  mode, or models whose attention dropout is 0) it is ``sdpa`` itself. It
  replaces ``"sdpa"`` (transformers' default) only if the copy's eval-mode
  loss still equals the model's (checked).
* transformers' ``gelu_new``, ``gelu_fast`` and ``gelu_pytorch_tanh``
  activations and ``nn.GELU(approximate="tanh")`` (five element-wise ops,
  or one slow ``tanh`` kernel) become :class:`TanhGELU`: the same function
  as ``x * sigmoid(2u)``.
* Llama-style RMSNorm and SwiGLU MLP modules become
  :mod:`gradsketch.slt._fast._fused_blocks`' one-pass versions (where a probe
  gives the module's own output).
* The rotary embedding of queries and keys (transformers'
  ``apply_rotary_pos_emb``) runs :mod:`gradsketch.slt._fast._rotary`'s one-pass
  kernel, the same bits as the model's own (where the train-mode probe
  shows them).
* :func:`token_cross_entropy` (used by
  :func:`~gradsketch.slt.per_token_loss`) reads the logits once.

On contiguous CPU float32 tensors these run the native kernels of
``csrc/gs_train.c`` (a library of their own, :mod:`gradsketch.slt._fast._native`),
forward and backward, with errors against float64 no larger than torch's
own kernels'. Where autograd records nothing (observable passes) the
kernels run without autograd nodes. Elsewhere (other dtypes or devices, no
C compiler, ``GRADSKETCH_NATIVE_TRAIN=0`` or ``GRADSKETCH_NATIVE=0``) torch's
operations compute the same, with the same dropout masks: the bits are one
counter-based hash (:func:`dropout_bits`, SplitMix64 of the element's index
under one seed per call drawn from the stream) in C and in torch, so a
backward pass recomputes its mask instead of storing it, and a seed gives
the same chains with and without a C compiler.

Every dropout mask of the copy comes from the generator installed by
:func:`dropout_stream` in the calling thread (torch's default generator
when none is), so a chain's masks depend on its seed only: chains may run
in threads of one process and give the bits they give one after another
(:func:`uses_global_generator` tells whether anything else in a model's
forward still draws from torch's global generator). Timings:
``benchmarks/RESULTS.md``.

One module per piece, each on :mod:`~gradsketch.slt._fast._native` (the
library and its ctypes bindings, which every piece asks for its kernels):
``_dropout``, ``_attention``, ``_gelu``, ``_cross_entropy``, ``_fused_blocks``
and ``_rotary``; ``_copy`` builds the working copy from them.
"""

from gradsketch.slt._fast._attention import ATTENTION_NAME, attention
from gradsketch.slt._fast._copy import FAST_PATHS, engaged, train_copy
from gradsketch.slt._fast._cross_entropy import token_cross_entropy
from gradsketch.slt._fast._dropout import (
    SeededDropout,
    dropout,
    dropout_bits,
    dropout_stream,
    skip_seeds,
    stream_draws,
    uses_global_generator,
)
from gradsketch.slt._fast._gelu import TanhGELU
from gradsketch.slt._fast._native import fast_kernels, train_status

__all__ = [
    # the working copy
    "FAST_PATHS",
    "train_copy",
    "engaged",
    "fast_kernels",
    "train_status",
    # its pieces
    "ATTENTION_NAME",
    "attention",
    "SeededDropout",
    "TanhGELU",
    "token_cross_entropy",
    # dropout streams
    "dropout",
    "dropout_bits",
    "dropout_stream",
    "skip_seeds",
    "stream_draws",
    "uses_global_generator",
]
