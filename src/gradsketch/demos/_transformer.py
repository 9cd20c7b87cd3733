"""A small pre-norm transformer classifier whose every weight sits in a hookable layer.

Attention runs through four ``nn.Linear`` maps (q, k, v, o) rather than
``nn.MultiheadAttention``, so :class:`~gradsketch.attribution.HookGradientComputer`
and :class:`~gradsketch.sketch.FactorizedProjector` cover the whole model with
their Linear, Embedding and LayerNorm rules (no ``torch.func`` fallback). Used
by the featurization benchmark and the hook tests; built in code, nothing is
downloaded.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TransformerBlock", "TransformerClassifier"]


class TransformerBlock(nn.Module):
    """Pre-norm block: causal multi-head attention through Linear q/k/v/o, then a GELU MLP.

    Args:
        width: model width (divisible by ``heads``).
        heads: attention heads.
        mlp_ratio: hidden width of the MLP as a multiple of ``width``.
    """

    def __init__(self, width: int, heads: int, mlp_ratio: int = 4) -> None:
        super().__init__()
        if width <= 0 or heads <= 0 or width % heads:
            raise ValueError(
                f"`width`={width} must be a positive multiple of `heads`={heads}; "
                "e.g. width=256, heads=4."
            )
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.q, self.k = nn.Linear(width, width), nn.Linear(width, width)
        self.v, self.o = nn.Linear(width, width), nn.Linear(width, width)
        self.fc1 = nn.Linear(width, mlp_ratio * width)
        self.fc2 = nn.Linear(mlp_ratio * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.ln1(x)

        def split(z: torch.Tensor) -> torch.Tensor:
            return z.view(b, t, self.heads, d // self.heads).transpose(1, 2)

        q, k, v = split(self.q(h)), split(self.k(h)), split(self.v(h))
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = (q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)).masked_fill(
            ~causal, float("-inf")
        )
        x = x + self.o((att.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TransformerClassifier(nn.Module):
    """``[batch, seq]`` tokens to ``[batch, classes]`` logits.

    Token and position embeddings, ``layers`` :class:`TransformerBlock` modules, a
    final LayerNorm, mean pooling over the sequence and a linear head.

    Example:
        >>> model = TransformerClassifier(vocab=11, width=8, seq=5, layers=1, heads=2, classes=3)
        >>> model(torch.zeros(4, 5, dtype=torch.long)).shape
        torch.Size([4, 3])
    """

    def __init__(
        self,
        vocab: int = 1000,
        width: int = 256,
        seq: int = 64,
        layers: int = 4,
        heads: int = 4,
        mlp_ratio: int = 4,
        classes: int = 10,
    ) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.blocks = nn.Sequential(
            *[TransformerBlock(width, heads, mlp_ratio) for _ in range(layers)]
        )
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[-1], device=tokens.device).expand_as(tokens)
        x = self.blocks(self.tok(tokens) + self.pos(positions))
        return self.head(self.ln(x).mean(-2))
