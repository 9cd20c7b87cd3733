"""How a batch becomes stored rows: projected gradients (TRAK) or per-layer factors.

:class:`FeatureMaker` holds what computes a checkpoint's rows: a gradient
computer and a flat projector (``"projected"`` methods: ``P grad f /
sqrt(d)``), or a :class:`KroneckerFeaturizer` (``"per-layer"`` methods: each
factored layer's gradient, from its inputs and output gradients).
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from gradsketch._device import exact_device
from gradsketch.attribution._hook_computer import refuse_wrapped
from gradsketch.attribution._kronecker_features import KroneckerFeaturizer
from gradsketch.attribution._traker_inputs import whole_parameters
from gradsketch.attribution._traker_records import projector_record
from gradsketch.masked import MaskLike
from gradsketch.sketch import (
    CountSketchProjector,
    CudaProjector,
    FactorizedProjector,
    NoOpProjector,
)


def _check_projection(projection: Any) -> tuple[int, int] | None:
    if projection is None:
        return None
    p = tuple(projection)
    if len(p) != 2 or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in p):
        raise ValueError(
            f"`projection` must be (k_in, k_out) positive ints or None, got {projection!r}."
        )
    return int(p[0]), int(p[1])


class FeatureMaker:
    """The rows of a batch under the loaded checkpoint (see the module docstring).

    Args:
        model: the model.
        task: the resolved task.
        method: the method's name (for messages).
        layered: per-layer features (else projected).
        device: where gradients are computed.
        dtype: the features' storage dtype.
        grad_wrt: the differentiated parameters' names (``None``: all).
        seed: the projection's seed.
        sample_seed: seed of ``curvature="sampled"``.
        curvature: per-layer methods' curvature.
        projector: the given projector (or ``None``).
        projection: per-layer ``(k_in, k_out)`` (or ``None``).
        proj_dim: feature dimension of the default flat projector.
        proj_max_batch_size: batch size of the CUDA projector.
        mask: optional ``ParamMask`` of the default flat projector.
        gradient_computer: gradient computer class (projected methods).
        logger: the TRAKer's logger.
    """

    def __init__(
        self,
        model: nn.Module,
        task: Any,
        *,
        method: str,
        layered: bool,
        device: torch.device,
        dtype: torch.dtype,
        grad_wrt: list[str] | None,
        seed: int,
        sample_seed: int,
        curvature: str,
        projector: Any,
        projection: Any,
        proj_dim: int,
        proj_max_batch_size: int,
        mask: MaskLike | None,
        gradient_computer: Any,
        logger: logging.Logger,
    ) -> None:
        self.model, self.task, self.method = model, task, method
        self.layered = layered
        self.device, self.dtype = device, dtype
        self.grad_wrt = grad_wrt
        self.seed = seed
        self.logger = logger
        self.featurizer: KroneckerFeaturizer | None = None
        self.gradient_computer: Any = None
        # Why features cannot be computed yet (a projector on another device).
        self.device_problem: str | None = None
        if layered:
            if mask is not None and not whole_parameters(mask):
                raise ValueError(
                    f"`mask` selects single entries, which method={method!r} cannot restrict "
                    "(its features are whole layers' gradients); pass the layers' names as "
                    "`grad_wrt`, or use method='trak' with the mask."
                )
            self._init_layered(projector, projection, curvature, sample_seed)
        else:
            self._init_projected(projector, proj_dim, proj_max_batch_size, mask, gradient_computer)

    def _init_layered(
        self, projector: Any, projection: Any, curvature: str, sample_seed: int
    ) -> None:
        """Per-layer (Kronecker) features: no gradient computer, no flat projector."""
        refuse_wrapped(self.model)
        seed = self.seed
        if isinstance(projector, FactorizedProjector):
            if projection is None:
                projection = (
                    max(x.k_in for x in projector.layers),
                    max(x.k_out for x in projector.layers),
                )
            seed = int(projector.seed)
        elif projector is not None:
            raise ValueError(
                f"`projector` must be None or a FactorizedProjector with method={self.method!r}, "
                f"got {type(projector).__name__}; per-layer methods project inputs and output "
                "gradients per layer: pass projection=(k_in, k_out)."
            )
        self.projection = _check_projection(projection)
        self.featurizer = KroneckerFeaturizer(
            self.model,
            self.task,
            grad_wrt=self.grad_wrt,
            projection=self.projection,
            projection_seed=seed,
            curvature=curvature,
            sample_seed=sample_seed,
            device=self.device,
            dtype=self.dtype,
        )
        self.layers: list[Any] = list(self.featurizer.layers)
        self.projector = self.featurizer.projector
        self.proj_dim = self.featurizer.feature_dim
        self.grad_dim = self.proj_dim
        self.normalize_factor = 1.0

    def _init_projected(
        self,
        projector: Any,
        proj_dim: int,
        proj_max_batch_size: int,
        mask: MaskLike | None,
        gradient_computer: Any,
    ) -> None:
        """TRAK's features: a gradient computer's per-example gradients, projected."""
        params = dict(self.model.named_parameters())
        self.num_params = sum(p.numel() for p in params.values())
        if self.grad_wrt is not None:
            self.num_params_for_grad = sum(params[n].numel() for n in self.grad_wrt)
        else:
            self.num_params_for_grad = self.num_params
        self.grad_dim = int(mask.numel) if mask is not None else self.num_params_for_grad
        if projector is None:
            projector = self._default_projector(proj_dim, proj_max_batch_size, mask)
        where = getattr(projector, "device", None)
        if where is not None and exact_device(where) != exact_device(self.device):
            # trak accepts this at construction: warn now, refuse where devices would mix.
            self.device_problem = (
                f"`projector` lives on {where} but `device`={str(self.device)!r}; build it "
                f"there (e.g. {type(projector).__name__}(..., device={str(self.device)!r})) "
                "or pass device= its device."
            )
            warnings.warn(
                self.device_problem + " Featurizing and scoring refuse it until then.",
                UserWarning,
                stacklevel=5,
            )
        self.projector = projector
        self.proj_dim = (
            self.grad_dim if isinstance(projector, NoOpProjector) else int(projector.proj_dim)
        )
        self.logger.info("Using %s", type(self.projector).__name__)
        self.layers = []
        self.projection = None
        # TRAK divides by sqrt(d) so XᵀX stays well scaled.
        self.normalize_factor = math.sqrt(self.grad_dim)
        self.gradient_computer = gradient_computer(
            model=self.model,
            task=self.task,
            grad_dim=self.num_params_for_grad,
            dtype=self.dtype,
            device=self.device,
            grad_wrt=self.grad_wrt,
        )

    def _default_projector(
        self, proj_dim: int, proj_max_batch_size: int, mask: MaskLike | None
    ) -> Any:
        """The projector used when none is given (see TRAKer's docstring)."""
        if self.device.type == "cuda":
            return CudaProjector(
                self.grad_dim,
                int(proj_dim),
                self.seed,
                "rademacher",
                self.device,
                proj_max_batch_size,
                mask=mask,
            )
        # One index_add_ pass per batch, tables built once: the fast CPU choice,
        # with exactly proj_dim features whichever gradient computer runs.
        return CountSketchProjector(self.grad_dim, int(proj_dim), self.seed, self.device, mask=mask)

    def projector_record(self) -> dict[str, Any]:
        """The projection's fingerprint for the settings record."""
        if self.layered:
            # The per-layer projection is fixed by its sides and seed.
            projection = None if self.projection is None else list(self.projection)
            seed = None if self.projector is None else int(self.projector.seed)
            return {"kind": "per-layer", "projection": projection, "seed": seed}
        return projector_record(self.projector, self.grad_dim)

    def kronecker(self) -> KroneckerFeaturizer:
        """The per-layer featurizer (per-layer methods only)."""
        assert self.featurizer is not None, "projected methods have no per-layer featurizer"
        return self.featurizer

    def load_weights(self, checkpoint: Any, model_id: int) -> None:
        """Load ``checkpoint`` into the model; projections re-seed by ``model_id``."""
        self.model.load_state_dict(checkpoint)
        self.model.eval()
        if self.featurizer is not None:
            self.featurizer.set_model_id(int(model_id))
            return
        self.gradient_computer.load_model_params(self.model)
        self.projector.set_model_id(int(model_id))

    def features(self, batch: Sequence[Tensor], model_id: int) -> Tensor:
        """``[B, k]`` stored features of a batch (training rows or targets)."""
        if self.featurizer is not None:
            parts, _ = self.featurizer.layer_parts(batch)
            return self.featurizer.features([(a, g) for a, g, _ in parts])
        gc = self.gradient_computer
        if hasattr(gc, "project"):
            phi = gc.project(batch, self.projector, model_id)
        else:
            phi = self.projector.project(gc.compute_per_sample_grad(batch), model_id=model_id)
        return phi / self.normalize_factor

    def token_features(self, batch: Sequence[Tensor], model_id: int) -> Tensor:
        """``[B, T, k]`` features of each target token (``f = Σ_t f_t``)."""
        size = int(batch[0].shape[0])
        count = getattr(self.task, "per_token_length", None)
        length = int(count(batch)) if callable(count) else int(batch[0].shape[1])
        # B targets give B * T per-token rows; a few targets at a time keep
        # each pass at most max(B, T) rows.
        group = max(1, size // length)
        parts = []
        for start in range(0, size, group):
            part = tuple(t[start : start + group] for t in batch)
            expanded = tuple(self.task.per_token_batch(part))
            parts.append(self.features(expanded, model_id))
        return torch.cat(parts).reshape(size, length, -1)

    def free_memory(self) -> None:
        """Release the flat projector's buffers (after featurizing)."""
        if self.featurizer is None:
            self.projector.free_memory()


def storage_dtype(
    layered: bool, method: str, device: torch.device, dtype: torch.dtype | None, half: bool | None
) -> torch.dtype:
    """The features' storage dtype (see TRAKer's docstring)."""
    allowed = (torch.float32, torch.float64) if layered else (torch.float16, torch.float32)
    if dtype is None:
        if half is None:
            half = device.type == "cuda" and not layered
        return torch.float16 if half else torch.float32
    if dtype not in allowed:
        raise ValueError(
            f"`dtype` must be one of {[str(d) for d in allowed]} for method={method!r}, "
            f"got {dtype!r}."
        )
    return dtype


def numpy_dtype(dtype: torch.dtype) -> Any:
    """The numpy scalar type of a torch dtype."""
    return np.dtype(str(dtype).removeprefix("torch.")).type
