"""TRAK's score computers: XᵀX, X(XᵀX + λI)⁻¹ and the score matmul.

Kept for scripts that call them directly; :class:`TRAKer` and
:func:`trak_scores` use the streamed kernel of :mod:`._scores`, which never
forms ``X(XᵀX + λI)⁻¹`` when applying the inverse to the targets is cheaper.

Deliberate difference: traker's ``BasicScoreComputer`` divides the inverse by
its mean absolute entry; these return ``X(XᵀX + λI)⁻¹`` exactly as the
docstrings say (see :mod:`gradsketch.attribution._scores`).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod

import torch
from torch import Tensor

from gradsketch._checks import positive_int
from gradsketch.attribution._linalg import damped_solver, resolve_lambda, xtx_blocked
from gradsketch.attribution._scores import check_lambda


class AbstractScoreComputer(ABC):
    """Three steps from projected gradients X ``[n, k]`` to scores (TRAK's interface).

    Args:
        dtype: dtype of returned features.
        device: where to multiply.
    """

    def __init__(self, dtype: torch.dtype, device: torch.device | str) -> None:
        self.dtype = dtype
        self.device = device

    @abstractmethod
    def get_xtx(self, grads: Tensor) -> Tensor:
        """``[k, k]``: XᵀX."""

    @abstractmethod
    def get_x_xtx_inv(self, grads: Tensor, xtx: Tensor) -> Tensor:
        """``[n, k]``: X (XᵀX + λI)⁻¹."""

    @abstractmethod
    def get_scores(self, features: Tensor, target_grads: Tensor, accumulator: Tensor) -> None:
        """``accumulator [n, m] += features @ target_gradsᵀ``."""


class BasicSingleBlockScoreComputer(AbstractScoreComputer):
    """Everything in one block, float32 inverse: the readable reference.

    Example:
        >>> x = torch.randn(20, 4, generator=torch.Generator().manual_seed(0))
        >>> sc = BasicSingleBlockScoreComputer(torch.float32, "cpu")
        >>> acc = torch.zeros(20, 2)
        >>> sc.get_scores(sc.get_x_xtx_inv(x, sc.get_xtx(x)), x[:2], acc)
        >>> acc.shape
        torch.Size([20, 2])
    """

    def __init__(
        self, dtype: torch.dtype, device: torch.device | str, *args: object, **kwargs: object
    ) -> None:
        super().__init__(dtype, device)
        self.lambda_reg = check_lambda(kwargs.get("lambda_reg", 0.0))

    def get_xtx(self, grads: Tensor) -> Tensor:
        """``grads.T @ grads`` in float32."""
        g = grads.float()
        return g.T @ g

    def get_x_xtx_inv(self, grads: Tensor, xtx: Tensor) -> Tensor:
        """``X (XᵀX + λI)⁻¹`` with ``torch.linalg.inv`` in float32."""
        lam = resolve_lambda(self.lambda_reg, xtx.float())
        eye = torch.eye(xtx.shape[0], dtype=torch.float32, device=xtx.device)
        return (grads.float() @ torch.linalg.inv(xtx.float() + lam * eye)).to(self.dtype)

    def get_scores(self, features: Tensor, target_grads: Tensor, accumulator: Tensor) -> None:
        """``accumulator += features @ target_gradsᵀ`` (on the accumulator's device)."""
        accumulator += (features.float() @ target_grads.float().T).to(accumulator)


class BasicScoreComputer(AbstractScoreComputer):
    """Block-wise products with a symmetric XᵀX and a float64-factorised inverse.

    Args:
        dtype: dtype of returned features.
        device: where to multiply.
        CUDA_MAX_DIM_SIZE: rows per block (TRAK's name).
        logging_level: level of this computer's logger.
        lambda_reg: ridge damping λ >= 0, or ``"auto"``.

    Example:
        >>> x = torch.randn(30, 4, generator=torch.Generator().manual_seed(0))
        >>> sc = BasicScoreComputer(torch.float32, "cpu", CUDA_MAX_DIM_SIZE=7)
        >>> torch.allclose(sc.get_xtx(x), x.T @ x, atol=1e-5)
        True
    """

    def __init__(
        self,
        dtype: torch.dtype,
        device: torch.device | str,
        CUDA_MAX_DIM_SIZE: int = 20_000,
        logging_level: int = logging.INFO,
        lambda_reg: float | str = 0.0,
    ) -> None:
        super().__init__(dtype, device)
        positive_int("CUDA_MAX_DIM_SIZE", CUDA_MAX_DIM_SIZE, fix="pass the rows per block")
        self.CUDA_MAX_DIM_SIZE = CUDA_MAX_DIM_SIZE
        self.logger = logging.getLogger("ScoreComputer")
        self.logger.setLevel(logging_level)
        self.lambda_reg = check_lambda(lambda_reg)

    def get_xtx(self, grads: Tensor) -> Tensor:
        """XᵀX in float32 from symmetric tiles, ``CUDA_MAX_DIM_SIZE`` rows at a time."""
        return xtx_blocked(
            grads, block_rows=self.CUDA_MAX_DIM_SIZE, device=torch.device(self.device)
        )

    def get_x_xtx_inv(self, grads: Tensor, xtx: Tensor) -> Tensor:
        """``X (XᵀX + λI)⁻¹``, block by block (no mean-abs rescaling, unlike traker).

        The rows are solved against the Cholesky factor (:func:`damped_solver`:
        the flops of the product with the inverse, without forming it).
        """
        dev = torch.device(self.device)
        lam = resolve_lambda(self.lambda_reg, xtx.float())
        solve = damped_solver(xtx.to(dev, torch.float32), lam)
        out = torch.empty(grads.shape[0], xtx.shape[1], dtype=self.dtype, device=dev)
        for start in range(0, grads.shape[0], self.CUDA_MAX_DIM_SIZE):
            stop = start + self.CUDA_MAX_DIM_SIZE
            out[start:stop] = solve(grads[start:stop].to(dev, torch.float32)).to(self.dtype)
        return out

    def get_scores(self, features: Tensor, target_grads: Tensor, accumulator: Tensor) -> None:
        """``accumulator += features @ target_gradsᵀ``, block by block, in place."""
        dev = torch.device(self.device)
        t = target_grads.to(dev, torch.float32)
        for start in range(0, features.shape[0], self.CUDA_MAX_DIM_SIZE):
            stop = start + self.CUDA_MAX_DIM_SIZE
            block = features[start:stop].to(dev, torch.float32) @ t.T
            accumulator[start:stop] += block.to(accumulator)
