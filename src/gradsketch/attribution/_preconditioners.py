"""Preconditioners: the curvature part of attribution, behind one small protocol.

Every attribution method of :class:`~gradsketch.attribution.TRAKer` scores
``score[i, q] = Q_i · φ_iᵀ P⁻¹ φ_q``: stored training features ``φ_i``,
out-to-loss terms ``Q_i``, target features ``φ_q`` and a preconditioner
``P`` fitted on the training rows. The store flow (featurize, finalize,
score, resume, refusal of other settings, sharding) is the same for every
method; what differs is ``P``, which is one :class:`CurvaturePreconditioner`:

* :meth:`~CurvaturePreconditioner.accumulate` sees each featurized batch of training
  rows (K-FAC / EK-FAC add its layers' Kronecker factors);
* :meth:`~CurvaturePreconditioner.finalize` sees the stored training rows once, in
  large blocks (TRAK: ``XᵀX``; EK-FAC: the eigenvalue correction);
* :meth:`~CurvaturePreconditioner.solve` applies ``P⁻¹`` to target features;
* :meth:`~CurvaturePreconditioner.state_dict` / :meth:`~CurvaturePreconditioner.load_state_dict`
  keep what it fitted (arrays), so one fit serves every later query set.

Built in (:data:`CURVATURE_PRECONDITIONERS`): ``"trak"`` (TRAK's ``XᵀX + λI`` of
projected gradients), ``"identity"`` (gradient dot products), ``"kfac"`` and
``"ekfac"`` (per-layer Kronecker curvature, :mod:`gradsketch.attribution._kfac`).
Register your own with :func:`register_curvature_preconditioner`; it then runs through
``TRAKer(..., method=name)`` with every input form, ``per_token``, ``topk``,
``memory_budget`` and ``torch.distributed`` sharding.

Example:
    A diagonal preconditioner (each feature divided by its second moment):

    >>> import tempfile, torch
    >>> from gradsketch.attribution import TRAKer
    >>> @register_curvature_preconditioner("diag")
    ... class Diagonal(CurvaturePreconditioner):
    ...     def finalize(self, train):
    ...         total = torch.zeros(train.width, dtype=torch.float64)
    ...         for _, _, x, _ in train.blocks():
    ...             total += (x.double() ** 2).sum(0)
    ...         self.second = train.reduce(total) / train.size
    ...     def solve(self, targets):
    ...         return targets / (self.second + 1e-3).to(targets)
    ...     def state_dict(self):
    ...         return {"second": self.second.numpy()}
    ...     def load_state_dict(self, state):
    ...         self.second = torch.from_numpy(state["second"])
    >>> model = torch.nn.Linear(4, 3)
    >>> x, y = torch.randn(12, 4), torch.arange(12) % 3
    >>> traker = TRAKer(model, "image_classification", 12, tempfile.mkdtemp(), device="cpu",
    ...                 proj_dim=8, method="diag", progress=False)
    >>> traker.load_checkpoint(model.state_dict(), model_id=0)
    >>> traker.featurize((x, y), num_samples=12)
    >>> traker.finalize_features()
    >>> traker.start_scoring_checkpoint("q", model.state_dict(), model_id=0, num_targets=2)
    >>> traker.score((x[:2], y[:2]), num_samples=2)
    >>> traker.finalize_scores("q").shape
    (12, 2)
    >>> del CURVATURE_PRECONDITIONERS["diag"]
"""

from __future__ import annotations

import functools
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import numpy as np
import torch
from torch import Tensor

from gradsketch.attribution._distributed import RowWindow, all_reduce_sum_, split_over_ranks
from gradsketch.attribution._io import iter_row_blocks, rows_as_tensor
from gradsketch.attribution._kfac import (
    KroneckerEigen,
    KroneckerEigenbasis,
    KroneckerFactors,
)
from gradsketch.attribution._kronecker_features import FactoredRows, split_factored
from gradsketch.attribution._layer_capture import FactoredLayer
from gradsketch.attribution._linalg import damped_inverse, resolve_lambda, xtx_blocked
from gradsketch.attribution._scores import CheckpointGrads

__all__ = [
    "CURVATURE_PRECONDITIONERS",
    "FeatureBatch",
    "CurvaturePreconditioner",
    "PreconditionerSpec",
    "TrainRows",
    "register_curvature_preconditioner",
]

logger = logging.getLogger(__name__)

#: Kinds of stored features a preconditioner can ask for.
FEATURE_KINDS = ("projected", "layers")


@dataclass
class PreconditionerSpec:
    """What a preconditioner is built from (one per checkpoint).

    Attributes:
        feature_dim: stored numbers per row k.
        damping: λ >= 0 or ``"auto"`` (``lambda_reg`` of the TRAKer).
        device: where it computes.
        layers: the factored layers (``"layers"`` features), in feature order.
        curvature: ``"loss"``, ``"output"`` or ``"sampled"`` (layer methods).
        score_computer: TRAK's optional score computer (``"trak"`` only).
        damping_fraction: per-layer methods' ``"auto"``: this fraction of each
            layer's mean eigenvalue (``None``: :data:`LAYER_AUTO_DAMPING_FRACTION`).
    """

    feature_dim: int
    damping: float | str
    device: torch.device
    layers: Sequence[FactoredLayer] = field(default_factory=list)
    curvature: str = "loss"
    score_computer: Any = None
    damping_fraction: float | None = None


@dataclass
class FeatureBatch:
    """One featurized batch of training rows, as :meth:`CurvaturePreconditioner.accumulate` sees it.

    Attributes:
        rows: ``[B]`` training-row indices.
        features: ``[B, k]`` the stored features (``None`` for the built-in
            per-layer methods, which read ``layers`` and where the store keeps
            rank-one rows instead of ``[B, k]``).
        out_to_loss: ``[B]`` Q.
        layers: per factored layer ``(a [B, T, k_in], g [B, T, k_out], g_sampled | None)``
            (``"layers"`` features only, else ``None``).
        token_mask: ``[B, T]`` bool, the real (not padded) positions of the
            batch's sequences, for tasks with a padding mask; else ``None``.
    """

    rows: np.ndarray
    features: Tensor | None
    out_to_loss: Tensor
    layers: Sequence[tuple[Tensor, Tensor, Tensor | None]] | None = None
    token_mask: Tensor | None = None


class TrainRows:
    """One checkpoint's stored training rows that this rank owns, read in large blocks.

    Attributes:
        size: the training-set size n (every rank's rows together).
        width: features per row k.
        tokens: with per-layer rows kept factored (array ``"factored"``: each
            layer's positions of ``[a, g]``, see
            :func:`~gradsketch.attribution._kronecker_features.split_factored`),
            the positions per layer (``None``: one each).
    """

    def __init__(
        self,
        arrays: Mapping[str, Any],
        out_to_loss: Any,
        rows: range,
        *,
        size: int,
        block_rows: int,
        device: torch.device,
        prefetch: bool = True,
        tokens: Sequence[int] | None = None,
    ) -> None:
        self._arrays = arrays
        self.tokens = None if tokens is None else [int(t) for t in tokens]
        self._q = out_to_loss
        self.rows = rows
        self.size = int(size)
        self.width = int(arrays["grads"].shape[1])
        self.block_rows = int(block_rows)
        self.device = device
        self.prefetch = prefetch

    def window(self, name: str = "grads") -> Any:
        """The stored array ``name``'s rows that this rank owns (sliceable, with ``shape``)."""
        array = self._arrays[name]
        if self.rows.start == 0 and self.rows.stop == int(array.shape[0]):
            return array
        return RowWindow(array, self.rows.start, self.rows.stop)

    def blocks(
        self, name: str = "grads", *, dtype: torch.dtype = torch.float32
    ) -> Iterator[tuple[int, int, Tensor, Tensor]]:
        """``(start, stop, x [rows, k], q [rows])`` over this rank's rows (global indices)."""
        q_all = self.window_q()
        for start, stop, x in iter_row_blocks(
            self.window(name),
            self.block_rows,
            device=self.device,
            dtype=dtype,
            prefetch=self.prefetch,
        ):
            q = torch.as_tensor(q_all[start:stop], device=self.device).reshape(-1)
            yield self.rows.start + start, self.rows.start + stop, x, q

    @property
    def names(self) -> tuple[str, ...]:
        """The stored per-row arrays this view reads."""
        return tuple(self._arrays)

    def dtype(self, name: str = "grads") -> np.dtype:
        """The stored dtype of array ``name``."""
        return np.dtype(self._arrays[name].dtype)

    def read(
        self, name: str, start: int, stop: int, *, dtype: torch.dtype = torch.float32
    ) -> Tensor:
        """Rows ``start:stop`` (global indices, inside this rank's rows) of array ``name``."""
        return rows_as_tensor(self._arrays[name], start, stop, device=self.device, dtype=dtype)

    def window_q(self) -> np.ndarray:
        """``[rows]`` float64 Q of this rank's rows."""
        q = self._q[self.rows.start : self.rows.stop]
        return np.asarray(q, dtype=np.float64).reshape(-1)

    @staticmethod
    def reduce(tensor: Tensor) -> Tensor:
        """Sum ``tensor`` over ``torch.distributed`` ranks (in place; identity in one process)."""
        return all_reduce_sum_(tensor)


class CurvaturePreconditioner(ABC):
    """The curvature ``P`` of one checkpoint (see the module docstring).

    Subclasses implement :meth:`finalize` and :meth:`solve` and, to be kept
    in the store, :meth:`state_dict` / :meth:`load_state_dict`; those that
    fit from featurized batches also set ``accumulates = True`` and
    implement :meth:`accumulate` (its state is saved with the rows it
    covers, so a killed run resumes without adding a row twice).

    Class attributes:
        features: ``"projected"`` (one projected, normalised gradient per row:
            TRAK's features) or ``"layers"`` (each factored layer's
            ``vec(sum_t g_t a_tᵀ)``, the inputs of Kronecker curvature).
        accumulates: :meth:`accumulate` is called on each training batch.
        q_per_checkpoint: each checkpoint's scores are weighted by its own Q
            (influence: the training feature is then minus the loss
            gradient); ``False`` averages Q over checkpoints first (TRAK).
        stored_arrays: extra per-row arrays the featurizer stores for
            :meth:`finalize` (``"fisher_grads"``: gradients under sampled labels).
    """

    name: ClassVar[str] = ""
    features: ClassVar[str] = "projected"
    accumulates: ClassVar[bool] = False
    q_per_checkpoint: ClassVar[bool] = False

    def __init__(self, spec: PreconditionerSpec) -> None:
        self.spec = spec

    @property
    def stored_arrays(self) -> tuple[str, ...]:
        """Extra per-row arrays this preconditioner reads in :meth:`finalize`."""
        return ()

    def accumulate(self, batch: FeatureBatch) -> None:  # noqa: B027 - optional hook
        """Add one featurized batch of training rows (only if ``accumulates``)."""

    @abstractmethod
    def finalize(self, train: TrainRows) -> None:
        """Fit from the stored training rows (call ``train.reduce`` on sums across ranks)."""

    @abstractmethod
    def solve(self, targets: Tensor) -> Tensor:
        """``[m, k] -> [m, k]``: ``P⁻¹`` applied to each target row."""

    def state_dict(self) -> dict[str, np.ndarray]:
        """Arrays that restore it (after :meth:`accumulate` or :meth:`finalize`)."""
        return {}

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:  # noqa: B027
        """Restore from :meth:`state_dict`'s arrays."""

    def checkpoint_grads(self, train: Any, targets: Any, out_to_loss: Any) -> CheckpointGrads:
        """The scoring kernel's view of this checkpoint (override to hand it a matrix)."""
        return CheckpointGrads(
            train, targets, out_to_loss, solve=self.solve, q_per_checkpoint=self.q_per_checkpoint
        )


#: Registered preconditioners: ``TRAKer(method=name)``.
CURVATURE_PRECONDITIONERS: dict[str, type[CurvaturePreconditioner]] = {}

_P = TypeVar("_P", bound=type[CurvaturePreconditioner])


def register_curvature_preconditioner(name: str) -> Callable[[_P], _P]:
    """Class decorator: make a :class:`CurvaturePreconditioner` ``TRAKer(method=name)``.

    Raises:
        ValueError: ``name`` is taken, or the class is not a CurvaturePreconditioner
            with a known ``features`` kind.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"`name` must be a non-empty string, got {name!r}.")

    def decorate(cls: _P) -> _P:
        if not (isinstance(cls, type) and issubclass(cls, CurvaturePreconditioner)):
            raise ValueError(
                f"@register_curvature_preconditioner({name!r}) decorates {cls!r}, which is not a "
                "subclass of gradsketch.attribution.CurvaturePreconditioner."
            )
        if cls.features not in FEATURE_KINDS:
            raise ValueError(
                f"{cls.__name__}.features is {cls.features!r}; allowed: {list(FEATURE_KINDS)}."
            )
        if name in CURVATURE_PRECONDITIONERS and CURVATURE_PRECONDITIONERS[name] is not cls:
            raise ValueError(
                f"a preconditioner named {name!r} is registered already "
                f"({CURVATURE_PRECONDITIONERS[name].__name__}); pick another name, or delete "
                f"CURVATURE_PRECONDITIONERS[{name!r}] first."
            )
        cls.name = name
        CURVATURE_PRECONDITIONERS[name] = cls
        return cls

    return decorate


def resolve_method(method: object) -> type[CurvaturePreconditioner]:
    """The registered preconditioner class of ``method``, with a clear error."""
    if not isinstance(method, str) or method not in CURVATURE_PRECONDITIONERS:
        raise ValueError(
            f"`method` must be one of {sorted(CURVATURE_PRECONDITIONERS)}, got {method!r}; "
            "register your own with "
            "@gradsketch.attribution.register_curvature_preconditioner(name)."
        )
    return CURVATURE_PRECONDITIONERS[method]


# -- TRAK ----------------------------------------------------------------------------
@register_curvature_preconditioner("trak")
class GramPreconditioner(CurvaturePreconditioner):
    """TRAK's ``XᵀX + λI`` of the projected training features (Park et al., 2023).

    ``XᵀX`` is streamed over the stored rows in symmetric tiles and summed
    across ranks; the scoring kernel applies the damped inverse to whichever
    side is cheaper, so :meth:`checkpoint_grads` hands it ``XᵀX`` itself.
    """

    def __init__(self, spec: PreconditionerSpec) -> None:
        super().__init__(spec)
        self.xtx: Tensor | None = None

    def finalize(self, train: TrainRows) -> None:
        rows = train.window("grads")
        computer = self.spec.score_computer
        if computer is not None:
            xtx = computer.get_xtx(torch.as_tensor(rows[:], device=train.device).float())
        else:
            xtx = xtx_blocked(
                rows, block_rows=train.block_rows, device=train.device, prefetch=train.prefetch
            )
        self.xtx = train.reduce(xtx)

    def _xtx(self) -> Tensor:
        if self.xtx is None:
            raise RuntimeError("the Gram preconditioner is not finalized; call finalize first.")
        return self.xtx

    def solve(self, targets: Tensor) -> Tensor:
        xtx = self._xtx().to(targets.device, torch.float32)
        inv = damped_inverse(xtx, resolve_lambda(self.spec.damping, xtx))
        return targets @ inv.to(targets.dtype)

    def state_dict(self) -> dict[str, np.ndarray]:
        return {"xtx": self._xtx().float().cpu().numpy()}

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        self.xtx = torch.from_numpy(np.asarray(state["xtx"]))

    def checkpoint_grads(self, train: Any, targets: Any, out_to_loss: Any) -> CheckpointGrads:
        return CheckpointGrads(train, targets, out_to_loss, xtx=self._xtx())


# -- per-layer (Kronecker) methods ----------------------------------------------------
@register_curvature_preconditioner("identity")
class IdentityPreconditioner(CurvaturePreconditioner):
    """``P = I``: plain dot products of the per-layer gradients (TracIn at one checkpoint)."""

    features = "layers"
    q_per_checkpoint = True

    def finalize(self, train: TrainRows) -> None:
        return None

    def solve(self, targets: Tensor) -> Tensor:
        return targets


def _blocks(layers: Sequence[FactoredLayer], x: Tensor) -> Iterator[tuple[int, Tensor]]:
    for i, layer in enumerate(layers):
        yield i, x[:, layer.offset : layer.offset + layer.width]


@register_curvature_preconditioner("kfac")
class KFACPreconditioner(CurvaturePreconditioner):
    """Per-layer ``S ⊗ A`` (Martens & Grosse, 2015), fitted while featurizing.

    ``A`` sums the layer inputs' second moments over tokens and ``S`` the
    output gradients' over examples (weighted by ``|Q|`` for the empirical
    Fisher, ``curvature="loss"``; the sampled-label gradients for
    ``"sampled"``). :meth:`finalize` eigendecomposes both; :meth:`solve` is
    ``(S ⊗ A + λI)⁻¹`` in that eigenbasis, λ resolved per layer.
    """

    features = "layers"
    accumulates = True
    q_per_checkpoint = True

    def __init__(self, spec: PreconditionerSpec) -> None:
        super().__init__(spec)
        self._factors: list[KroneckerFactors] | None = None
        #: Per layer the eigenbasis and the curvature's eigenvalues (after finalize).
        self.eigen: list[KroneckerEigenbasis] | None = None

    @property
    def factors(self) -> list[KroneckerFactors]:
        """Each layer's running sums, allocated on first use (``d_in² + d_out²`` float64 each).

        Lazily: constructing the preconditioner (as the TRAKer does to ask what it
        stores) allocates nothing, so the TRAKer's plan can refuse first.
        """
        if self._factors is None:
            dev = str(self.spec.device)
            self._factors = [
                KroneckerFactors.zeros(x.k_in, x.k_out, device=dev) for x in self.spec.layers
            ]
        return self._factors

    @factors.setter
    def factors(self, value: list[KroneckerFactors]) -> None:
        self._factors = value

    def _damping(self, basis: KroneckerEigenbasis) -> float:
        """The layer's damping: λ, or ``"auto"`` at the spec's fraction of its mean eigenvalue."""
        return basis.damping(self.spec.damping, fraction=self.spec.damping_fraction)

    def accumulate(self, batch: FeatureBatch) -> None:
        assert batch.layers is not None
        q = batch.out_to_loss
        weight = q.abs() if self.spec.curvature == "loss" else None
        mask = batch.token_mask
        for x, f, (a, g, g_sampled) in zip(self.spec.layers, self.factors, batch.layers):
            g = g if g_sampled is None else g_sampled
            if weight is not None:
                g = g * weight.to(g.device, g.dtype).reshape(-1, 1, 1)
            keep = None
            if x.container is not None:
                # Routed rows (an expert's tokens) are zero-padded to the batch's most; the
                # padding leaves A's mean. They are no sequence positions: the mask does not fit.
                keep = (a != 0).any(-1)
            elif mask is not None and mask.shape == a.shape[:2]:
                # Padded positions leave A's mean: a row's curvature is its batch's.
                keep = mask.to(a.device)
            if keep is not None and not bool(keep.all()):
                f.update(a[keep].unsqueeze(0), g[keep].unsqueeze(0))
                f.examples += a.shape[0] - 1
            else:
                f.update(a, g)

    def _reduce_factors(self, train: TrainRows) -> list[KroneckerEigen]:
        for f in self.factors:
            counts = torch.tensor([f.tokens, f.examples], dtype=torch.float64)
            train.reduce(f.a_sum)
            train.reduce(f.g_sum)
            train.reduce(counts)
            f.tokens, f.examples = int(counts[0]), int(counts[1])
        # Sampled-label gradients make S, not the stored ones: keep S's null space.
        low_rank_s = self.spec.curvature != "sampled"

        def decompose(i: int) -> tuple[Tensor, ...]:
            e = self.factors[i].eigen(low_rank_s=low_rank_s)
            return e.q_a, e.alpha, e.q_s, e.s

        # Under torch.distributed each layer's eigh runs on one rank (by d³), then travels.
        costs = [float(f.a_sum.shape[0]) ** 3 + float(f.g_sum.shape[0]) ** 3 for f in self.factors]
        device = self.factors[0].a_sum.device if self.factors else torch.device("cpu")
        return [
            KroneckerEigen(q_a=q_a, alpha=alpha, q_s=q_s, s=s)
            for q_a, alpha, q_s, s in split_over_ranks(decompose, costs, device)
        ]

    def _values(self, eigens: Sequence[KroneckerEigen], train: TrainRows) -> list[Tensor]:
        return [e.kfac_eigenvalues() for e in eigens]

    def finalize(self, train: TrainRows) -> None:
        eigens = self._reduce_factors(train)
        values = self._values(eigens, train)
        self.eigen = [KroneckerEigenbasis(e.q_a, e.q_s, v) for e, v in zip(eigens, values)]

    def _bases(self) -> list[KroneckerEigenbasis]:
        if self.eigen is None:
            raise RuntimeError(f"the {self.name} preconditioner is not finalized.")
        return self.eigen

    def solve(self, targets: Tensor) -> Tensor:
        out = torch.empty_like(targets, dtype=torch.float64)
        for basis, layer in zip(self._bases(), self.spec.layers):
            block = targets[:, layer.offset : layer.offset + layer.width]
            out[:, layer.offset : layer.offset + layer.width] = basis.solve(
                block.double(), self._damping(basis)
            )
        return out.to(targets.dtype)

    def solve_rotated(self, targets: Tensor, rotate: Sequence[bool] | None = None) -> Tensor:
        """``Λ⁻¹ vec(Q_Sᵀ T Q_A)`` per layer: :meth:`solve` without rotating back.

        Scores are then taken against training rows in the same bases
        (``<Rx, Λ⁻¹ R t> = <x, R ᵀ Λ⁻¹ R t>``), which rank-one rows give
        cheaply; computed in the targets' dtype (float64 for float64 stores).
        ``rotate[l]`` False solves layer ``l`` as :meth:`solve` does, rotated
        back (in the targets' dtype), for training rows left as stored.
        """
        out = torch.empty_like(targets)
        for i, (basis, layer) in enumerate(zip(self._bases(), self.spec.layers)):
            block = targets[:, layer.offset : layer.offset + layer.width]
            if rotate is not None and not rotate[i]:
                solved = basis.solve(block, self._damping(basis), work=targets.dtype)
                out[:, layer.offset : layer.offset + layer.width] = solved
                continue
            rotated = basis.solve_rotated(block, self._damping(basis))
            # A reduced basis fills the block's first r_s r_a places, the training rows
            # in it too (FactoredRows.rotated); the rest is 0 on both sides.
            width = rotated.shape[1]
            out[:, layer.offset : layer.offset + width] = rotated
            out[:, layer.offset + width : layer.offset + layer.width] = 0
        return out

    def checkpoint_grads(self, train: Any, targets: Any, out_to_loss: Any) -> CheckpointGrads:
        if isinstance(train, FactoredRows) and self.eigen is not None:
            # Factored rows rotate cheaply: score in the eigenbasis, skip rotating back,
            # except in layers where rotating the targets back costs less.
            rotate = self._rotate_train(train, int(targets.shape[0]))
            return CheckpointGrads(
                train.rotated([b if r else None for b, r in zip(self.eigen, rotate)]),
                targets,
                out_to_loss,
                solve=functools.partial(self.solve_rotated, rotate=rotate),
                q_per_checkpoint=self.q_per_checkpoint,
            )
        return super().checkpoint_grads(train, targets, out_to_loss)

    def _rotate_train(self, train: FactoredRows, targets: int) -> list[bool]:
        """Per layer, whether scoring rotates the training rows (else the targets back).

        Either way the targets are rotated and divided by ``Λ + λ``. Rotating
        ``n`` training rows of ``T`` positions costs ``n T (k_in r_a + k_out r_s)``
        multiply-adds, and expanding them ``n T r_s r_a`` (``n T k_out k_in``
        unrotated); rotating ``m`` targets back costs ``m r_s k_in (r_a + k_out)``.
        At GPT-2's blocks with 4 queries: 16 documents of 128 tokens rotate
        the training rows in every layer, 64 documents rotate the targets back.
        """
        n = int(train.shape[0])
        out = []
        for i, basis in enumerate(self._bases()):
            t = 1 if train.tokens is None else train.tokens[i]
            (k_in, r_a), (k_out, r_s) = basis.q_a.shape, basis.q_s.shape
            train_cost = n * t * (k_in * r_a + k_out * r_s + r_s * r_a - k_out * k_in)
            out.append(train_cost <= targets * r_s * k_in * (r_a + k_out))
        return out

    def state_dict(self) -> dict[str, np.ndarray]:
        state: dict[str, np.ndarray] = {}
        if self.eigen is not None:
            for i, (q_a, q_s, values) in enumerate(self.eigen):
                state[f"q_a_{i}"] = q_a.cpu().numpy()
                state[f"q_s_{i}"] = q_s.cpu().numpy()
                state[f"eigenvalues_{i}"] = values.cpu().numpy()
            return state
        for i, f in enumerate(self.factors):
            state[f"a_sum_{i}"] = f.a_sum.cpu().numpy()
            state[f"g_sum_{i}"] = f.g_sum.cpu().numpy()
        state["tokens"] = np.array([f.tokens for f in self.factors], dtype=np.int64)
        state["examples"] = np.array([f.examples for f in self.factors], dtype=np.int64)
        # Whether each factor's products were all float64 (KroneckerFactors.update).
        state["exact"] = np.array([[f.a_exact, f.g_exact] for f in self.factors], dtype=bool)
        return state

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        dev = self.spec.device
        if "q_a_0" in state:
            self.eigen = [
                KroneckerEigenbasis(
                    torch.from_numpy(np.asarray(state[f"q_a_{i}"])).to(dev),
                    torch.from_numpy(np.asarray(state[f"q_s_{i}"])).to(dev),
                    torch.from_numpy(np.asarray(state[f"eigenvalues_{i}"])).to(dev),
                )
                for i in range(len(self.spec.layers))
            ]
            return
        # Stores written before the flags: not exact, so full eigendecompositions.
        exact = np.asarray(state.get("exact", np.zeros((len(self.spec.layers), 2), dtype=bool)))
        self.factors = [
            KroneckerFactors(
                torch.from_numpy(np.asarray(state[f"a_sum_{i}"])).to(dev),
                torch.from_numpy(np.asarray(state[f"g_sum_{i}"])).to(dev),
                int(state["tokens"][i]),
                int(state["examples"][i]),
                a_exact=bool(exact[i, 0]),
                g_exact=bool(exact[i, 1]),
            )
            for i in range(len(self.spec.layers))
        ]


@register_curvature_preconditioner("ekfac")
class EKFACPreconditioner(KFACPreconditioner):
    """K-FAC's eigenbasis with EK-FAC's eigenvalues (George et al., 2018).

    The eigenvalues are the diagonal of the Fisher in the Kronecker
    eigenbasis, ``Λ = mean_n (Q_Sᵀ G_n Q_A)²``, from one pass over the stored
    rows (weighted by Q for the empirical Fisher; the sampled-label rows for
    ``curvature="sampled"``), summed across ranks. Where every layer sees
    one position per example (MLPs, classifier heads), ``G_n = g aᵀ`` and
    ``Λ = mean_n (Q_Sᵀ g)² ⊗ (Q_Aᵀ a)²``: one GEMM over the ``rank_one``
    rows, ``k_in + k_out`` numbers per layer and row instead of a rotation
    of ``k_out k_in`` (``k_out k_in (k_in + k_out)`` flops per row). Where
    rows are kept as ``T`` positions of factors (``token_factors``), each
    position's factors are rotated, ``Q_Sᵀ G_n Q_A = (g Q_S)ᵀ (a Q_A)``:
    ``T (k_in² + k_out² + k_out k_in)`` flops per row.
    """

    @property
    def stored_arrays(self) -> tuple[str, ...]:
        return ("rank_one", "fisher_grads") if self.spec.curvature == "sampled" else ("rank_one",)

    def _values(self, eigens: Sequence[KroneckerEigen], train: TrainRows) -> list[Tensor]:
        layers = self.spec.layers
        sampled = self.spec.curvature == "sampled"
        weighted = self.spec.curvature == "loss"
        sums = [
            torch.zeros(e.eigenvalues.numel(), dtype=torch.float64, device=train.device)
            for e in eigens
        ]
        if "factored" in train.names:
            # Rotate each position's factors, (g Q_S)ᵀ (a Q_A): T (k_in² + k_out²) + T k_out k_in
            # per row instead of a rotation of vec(G) (k_out k_in (k_in + k_out)).
            work = torch.float64 if train.dtype("factored") == np.float64 else torch.float32
            for _, _, x, q in train.blocks("factored", dtype=work):
                w = q.to(work).reshape(-1, 1, 1)
                parts = split_factored(x, layers, train.tokens, sampled=sampled)
                for i, (a, g, gs) in enumerate(parts):
                    g = gs if sampled and gs is not None else g
                    g = g * w if weighted else g
                    sums[i] += eigens[i].rotated_squares(a, g)
            return [train.reduce(s) / train.size for s in sums]
        dense = "fisher_grads" if sampled else "grads"
        work = torch.float64 if train.dtype(dense) == np.float64 else torch.float32
        for _, _, x, q in train.blocks(dense, dtype=work):
            w = q.to(work).reshape(-1, 1)
            for i, block in _blocks(layers, x):
                rot = eigens[i].rotate_rows(block)
                if weighted:
                    rot = rot * w
                sums[i] += (rot * rot).sum(0, dtype=torch.float64)
        return [train.reduce(s) / train.size for s in sums]
