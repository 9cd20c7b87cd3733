"""TRAKer: TRAK's front end on a resumable zarr store with memory-bounded scoring."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import filelock
import numpy as np
import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from gradsketch._checks import positive_int
from gradsketch._device import exact_device, to_device
from gradsketch._hash import TensorDigest
from gradsketch._settings import SettingsMismatchError, read_record, write_record
from gradsketch._store import RowStore, StoreIntegrityError, default_chunk_rows
from gradsketch.attribution import _layout as layout
from gradsketch.attribution._distributed import (
    all_gather_columns,
    barrier,
    chunk_shard,
    column_shard,
    owned_mask,
    rank_and_world,
    rank_zero_first,
    require_same_across_ranks,
    shard_checkpoint_targets,
    shard_loader,
    shardable_size,
)
from gradsketch.attribution._gradient_computers import (
    FunctionalGradientComputer,
)
from gradsketch.attribution._hook_computer import refuse_wrapped
from gradsketch.attribution._integrity import (
    check_batch_rows,
    check_finite_rows,
    check_weights,
    damage_report,
    load_npz,
)
from gradsketch.attribution._io import default_block_rows, rows_as_tensor
from gradsketch.attribution._kronecker_features import (
    CURVATURES,
    FactoredRows,
    KroneckerFeaturizer,
)
from gradsketch.attribution._linalg import damped_inverse, resolve_lambda
from gradsketch.attribution._lm_data import as_loader, as_task_batch, check_token_batch
from gradsketch.attribution._lm_params import select_parameters
from gradsketch.attribution._modelout import AbstractModelOutput, resolve_task
from gradsketch.attribution._preconditioners import (
    FeatureBatch,
    GramPreconditioner,
    KFACPreconditioner,
    Preconditioner,
    PreconditionerSpec,
    TrainRows,
    resolve_method,
)
from gradsketch.attribution._scores import (
    MEMORY_BUDGET_FIX,
    CheckpointGrads,
    check_lambda,
    ensemble_scores,
    score_checkpoints,
)
from gradsketch.attribution._topk import TopK, topk_checkpoints
from gradsketch.errors import GradsketchError
from gradsketch.masked import MaskLike
from gradsketch.sketch import (
    CountSketchProjector,
    CudaProjector,
    FactorizedProjector,
    NoOpProjector,
)

#: Per-layer rows kept dense only where a layer sees several positions per example.
_DENSE_ROWS = ("grads", "fisher_grads")


def _whole_parameters(mask: Any) -> bool:
    """Whether a ParamMask selects whole parameters only (names, not entries)."""
    return all(c in (0, mask[n].numel()) for n, c in mask.counts().items())


def _atomic_save(path: Path, arrays: Mapping[str, np.ndarray]) -> None:
    """``np.savez`` to a hidden temporary file, then rename: a kill never leaves a torn file."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)  # type: ignore[arg-type]
    os.replace(tmp, path)


class ModelIDException(GradsketchError, RuntimeError, AssertionError):
    """A checkpoint (model id) is missing, incomplete or inconsistent.

    TRAK's name; also an AssertionError, which trak 0.3.2 raises and its users catch.
    """


@dataclass
class TRAKSettings:
    """What determines the stored features; saved as ``settings.json`` in ``save_dir``.

    Attributes:
        train_set_size: number of training rows n.
        proj_dim: feature dimension k.
        projector: the projector's fingerprint (without the checkpoint id).
        model: fingerprint of the architecture (parameter names, shapes, dtypes).
        task: the model output class.
        grad_wrt: differentiated parameters (``None``: all).
        dtype: storage dtype of features.
        normalize: features are divided by ``sqrt(num_coordinates)``.
        method: the preconditioner (``"trak"``, ``"identity"``, ``"kfac"``,
            ``"ekfac"`` or a registered one).
        curvature: whose second moment per-layer curvature is (``"loss"``,
            ``"output"``, ``"sampled"``).
        sample_seed: seed of the labels drawn for ``curvature="sampled"``.
        layers: the factored layers whose features are stored (per-layer methods).
    """

    train_set_size: int
    proj_dim: int
    projector: dict[str, Any] = field(default_factory=dict)
    model: str = ""
    task: str = ""
    grad_wrt: list[str] | None = None
    dtype: str = "float32"
    normalize: float = 1.0
    method: str = "trak"
    curvature: str = "loss"
    sample_seed: int = 0
    layers: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ("train_set_size", "proj_dim"):
            value = getattr(self, name)
            positive_int(name, value)
        if self.dtype not in ("float16", "float32", "float64"):
            raise ValueError(
                f"`dtype` must be 'float16', 'float32' or 'float64', got {self.dtype!r}."
            )
        if self.curvature not in CURVATURES:
            raise ValueError(
                f"`curvature` must be one of {list(CURVATURES)}, got {self.curvature!r}."
            )


def model_fingerprint(model: nn.Module) -> str:
    """Hash of the architecture: parameter and buffer names, shapes and dtypes."""
    digest = TensorDigest()
    for kind, items in (("p", model.named_parameters()), ("b", model.named_buffers())):
        for name, t in items:
            digest.text(f"{kind}:{name}:{tuple(t.shape)}:{t.dtype};")
    return digest.hexdigest()


def checkpoint_fingerprint(state: Mapping[str, Any]) -> str:
    """Hash of a checkpoint's values (so a model id cannot silently change weights)."""
    digest = TensorDigest()
    for name in sorted(state):
        value = state[name]
        digest.text(name)
        if isinstance(value, Tensor):
            digest.tensor(value)
        else:
            digest.text(repr(value))
    return digest.hexdigest()


def _projector_record(projector: Any, grad_dim: int) -> dict[str, Any]:
    if isinstance(projector, NoOpProjector):
        return {"kind": "noop", "input_dim": grad_dim, "output_dim": grad_dim}
    fp = getattr(projector, "fingerprint", None)
    if fp is None:
        return {
            "kind": type(projector).__name__,
            "proj_dim": int(projector.proj_dim),
            "seed": int(getattr(projector, "seed", -1)),
        }
    record = fp.to_dict()
    record.pop("model_id", None)
    return record


def _resolve_inds(inds: Any, num_samples: int | None, last: int, n: int, what: str) -> np.ndarray:
    if (inds is None) == (num_samples is None):
        raise ValueError(
            f"{what}: pass exactly one of `inds` (row indices) or `num_samples` (rows follow the "
            f"previous batch), got inds={inds!r}, num_samples={num_samples!r}."
        )
    if num_samples is not None:
        idx = np.arange(last, last + int(num_samples), dtype=np.int64)
    else:
        idx = np.asarray(inds.cpu() if isinstance(inds, Tensor) else inds, dtype=np.int64)
        idx = idx.reshape(-1)
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise IndexError(
            f"{what}: rows {idx.min()}..{idx.max()} fall outside [0, {n}); check `inds` / "
            f"`num_samples` against the size given to the TRAKer ({n})."
        )
    if np.unique(idx).size != idx.size:
        raise ValueError(f"{what}: `inds` has repeated rows; each row is written once.")
    return idx


def _batch_rows(
    task: Any,
    batch: Any,
    inds: Any,
    num_samples: int | None,
    last: int,
    n: int,
    what: str,
    device: torch.device,
) -> tuple[tuple[Tensor, ...], np.ndarray]:
    """``batch`` as the task's tuple on ``device``, and its rows.

    The rows are ``inds``, or ``num_samples`` after ``last``. A CPU batch
    reaches a CUDA model without the caller moving it.
    """
    batch = to_device(as_task_batch(task, batch), device)
    idx = _resolve_inds(inds, num_samples, last, n, what)
    check_batch_rows(batch, idx, "inds" if num_samples is None else "num_samples", what)
    return batch, idx


def _check_per_token(task: Any, per_token: bool) -> None:
    """Refuse ``per_token=True`` for a task without per-token outputs."""
    if per_token and not callable(getattr(task, "per_token_batch", None)):
        raise ValueError(
            f"`per_token`=True needs a task with per-token outputs (a `per_token_batch` "
            f"method, as 'language_modeling' has); {type(task).__name__} has none."
        )


class TRAKer:
    """TRAK data attribution (Park et al., ICML 2023), API-compatible with ``trak.TRAKer``.

    Features ``phi = P grad f(z; θ) / sqrt(d)`` are stored per checkpoint in a
    zarr store under ``save_dir``; scores are
    ``(1/C Σ_c Φ_c (Φ_cᵀΦ_c + λI)⁻¹ φ_c,targetᵀ) ⊙ mean_c Q_c`` (see
    :func:`trak_scores` for the differences from traker).

    Beyond traker: featurization resumes after a crash (rows are flagged done
    only after their data is written, and only missing rows are recomputed);
    reopening ``save_dir`` with other settings is refused with both shown;
    ``memory_budget`` bounds the working memory of ``finalize_features`` and
    ``finalize_scores`` (larger score matrices go to a zarr array on disk);
    ``lambda_reg="auto"`` picks a damping. Hugging Face models: the
    ``"language_modeling"`` task, dict batches and ``datasets.Dataset``
    inputs, weights chosen by name pattern (a LoRA model's adapters by
    default), per-token target scores (``per_token=True``), and :meth:`topk`,
    which streams the scores into the top proponents and opponents of each
    target without forming the ``[n, m]`` matrix.

    Args:
        model: the model.
        task: a task name (``"image_classification"``, ``"text_classification"``,
            ``"language_modeling"``) or an :class:`AbstractModelOutput`.
        train_set_size: number of training rows n.
        save_dir: directory of the store.
        load_from_save_dir: resume from rows already in ``save_dir``; ``False``
            recomputes every row of each loaded checkpoint.
        device: where gradients are computed (default: CUDA if available).
        gradient_computer: gradient computer class.
        projector: projector instance (default: :class:`CountSketchProjector`
            on CPU, :class:`CudaProjector` on CUDA: exactly ``proj_dim``
            features whichever gradient computer runs; pass
            :meth:`FactorizedProjector.from_budget` to the hook computer to
            never form a per-example gradient of a Linear / Conv2d layer, at
            the cost of noisier inner products).
        saver: must be ``None`` (features are stored in zarr).
        score_computer: optional TRAK score-computer class; ``None`` uses the
            streamed kernel of :func:`trak_scores`.
        proj_dim: feature dimension k when ``projector`` is None (an upper
            bound for the factorized default, whose layout may not reach it).
        logging_level: level of the TRAKer's logger.
        use_half_precision: store float16 features (default: on CUDA only).
        proj_max_batch_size: batch size of the CUDA projector.
        projector_seed: seed of the default projector.
        grad_wrt: parameters to differentiate: names or fnmatch patterns (a
            list, or one string of ``|``-separated patterns such as
            ``"*.q_proj.weight|*.v_proj.weight"``) or a whole-parameter
            :class:`~gradsketch.masked.ParamMask`. ``None``: all parameters,
            or only the trainable ones when some are frozen (a ``peft`` LoRA
            model's adapters). Recorded, as names, in the store's settings.
        lambda_reg: ridge damping λ >= 0, or ``"auto"``; ``None`` (default):
            0 for ``"trak"`` (trak's default) and ``"identity"``, ``"auto"``
            for ``"kfac"``, ``"ekfac"`` and registered per-layer methods.
        memory_budget: bytes of working memory for finalize steps (``None``:
            unbounded).
        mask: optional :class:`gradsketch.masked.ParamMask` for the default
            projector (only the selected entries are projected; only the
            parameters it selects entries of are differentiated).
        precision: GEMM precision of scoring (``"float32"``, ``"bf16x3"``, ``"auto"``).
        progress: show tqdm bars.
        chunk_rows: rows per chunk of the stored features (default: about
            1 MiB per chunk). Chunks are the unit of resuming and of sharding
            across ``torch.distributed`` ranks; an existing store keeps its own.
        method: the preconditioner (:data:`PRECONDITIONERS`): ``"trak"``
            (default: XᵀX of the projected gradients), ``"identity"``,
            ``"kfac"``, ``"ekfac"`` (per-layer Kronecker curvature of every
            Linear / Conv2d / ``Conv1D`` layer; ``lambda_reg`` is the damping,
            ``"auto"`` 0.3 of each layer's mean eigenvalue), or one
            registered with :func:`register_preconditioner`. Every method
            takes every input form, ``grad_wrt``, ``per_token``, :meth:`topk`,
            ``memory_budget`` and ``torch.distributed`` sharding.
            ``"replay"``: exact metagradients through a replayed training run
            (with ``replay=``; arguments of projected features refused).
        curvature: per-layer methods: ``"loss"`` (empirical Fisher),
            ``"output"`` or ``"sampled"`` (true Fisher, labels drawn from the
            model, seeded by ``sample_seed``); TRAK accepts only ``"loss"``.
            See :mod:`gradsketch.attribution._kronecker_features`.
        projection: per-layer methods: ``(k_in, k_out)`` projects each layer's
            inputs and output gradients (LoGra), or ``None`` for exact
            per-layer gradients.
        sample_seed: seed of ``curvature="sampled"`` (default: ``projector_seed``).
        dtype: storage dtype of the features (default: float16 on CUDA for
            TRAK, else float32; per-layer methods also take float64).
        replay: with ``method="replay"``, the run to replay: a
            :class:`~gradsketch.attribution.ReplaySettings` or a
            :class:`~gradsketch.attribution.ReplayAttributor`. The same calls
            then give exact metagradients through training (MAGIC); see
            :class:`~gradsketch.attribution._replay_traker.ReplayTRAKer`.

    Distributed: when a ``torch.distributed`` process group is initialised
    (``torchrun``), each rank featurizes and computes target features only for
    its :func:`~gradsketch.attribution.chunk_shard` of the rows (whole chunks,
    so ranks write disjoint chunk files of the same store), XᵀX is summed
    with ``all_reduce``, and scoring splits the targets' columns across ranks.
    Every rank calls the same methods in the same order; ``finalize_scores``
    returns the full scores on every rank. Each rank skips rows outside its
    shard, so give every rank every batch (the TRAK loop, or
    ``featurize_loader`` which re-batches an in-order ``DataLoader``) or
    exactly the rows of its :class:`~gradsketch.attribution.ChunkShardSampler`;
    torch's ``DistributedSampler`` interleaves rows and leaves rows undone.
    With a batch size that divides ``chunk_rows`` the stored features are
    bit-identical to a one-process run.

    Example:
        >>> import tempfile
        >>> model = torch.nn.Linear(4, 3)
        >>> x, y = torch.randn(12, 4), torch.arange(12) % 3
        >>> traker = TRAKer(model, "image_classification", 12, save_dir=tempfile.mkdtemp(),
        ...                 device="cpu", proj_dim=8, progress=False, logging_level=logging.WARNING)
        >>> traker.load_checkpoint(model.state_dict(), model_id=0)
        >>> traker.featurize((x, y), num_samples=12)
        >>> traker.finalize_features()
        >>> traker.start_scoring_checkpoint("test", model.state_dict(), model_id=0, num_targets=2)
        >>> traker.score((x[:2], y[:2]), num_samples=2)
        >>> traker.finalize_scores("test").shape
        (12, 2)
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> TRAKer:
        # method="replay" scores by metagradients through training: its own class, same calls.
        if cls is TRAKer and kwargs.get("method") == "replay":
            from gradsketch.attribution._replay_traker import ReplayTRAKer

            return super().__new__(ReplayTRAKer)
        return super().__new__(cls)

    def __init__(
        self,
        model: nn.Module,
        task: AbstractModelOutput | str,
        train_set_size: int,
        save_dir: str | Path = "./trak_results",
        load_from_save_dir: bool = True,
        device: torch.device | str | None = None,
        gradient_computer: Any = FunctionalGradientComputer,
        projector: Any = None,
        saver: Any = None,
        score_computer: Any = None,
        proj_dim: int = 2048,
        logging_level: int = logging.INFO,
        use_half_precision: bool | None = None,
        proj_max_batch_size: int = 32,
        projector_seed: int = 0,
        grad_wrt: Iterable[str] | None = None,
        lambda_reg: float | str | None = None,
        *,
        memory_budget: int | None = None,
        mask: MaskLike | None = None,
        precision: str = "float32",
        progress: bool = True,
        chunk_rows: int | None = None,
        method: str = "trak",
        curvature: str = "loss",
        projection: tuple[int, int] | None = None,
        sample_seed: int | None = None,
        dtype: torch.dtype | None = None,
        replay: Any = None,
    ) -> None:
        if replay is not None:
            raise ValueError(
                f"`replay` is the replayable run of method='replay', but method={method!r}; "
                "pass method='replay', or drop `replay`."
            )
        self.logger = logging.getLogger("gradsketch.attribution.TRAKer")
        self.logger.setLevel(logging_level)
        self.method = method
        self._precond_cls = resolve_method(method)
        self.layered = self._precond_cls.features == "layers"
        if curvature not in CURVATURES:
            raise ValueError(f"`curvature` must be one of {list(CURVATURES)}, got {curvature!r}.")
        if not self.layered and curvature != "loss":
            raise ValueError(
                f"`curvature`={curvature!r} needs a per-layer method ('identity', 'kfac', "
                f"'ekfac'); method={method!r} preconditions with its own matrix of the projected "
                "features. Pass method='ekfac' (or another per-layer method), or leave "
                "curvature='loss'."
            )
        if saver is not None:
            raise ValueError(
                f"`saver`={saver!r} is not supported: gradsketch stores features in a resumable "
                "zarr store under `save_dir`. Pass saver=None."
            )
        if score_computer is not None and method != "trak":
            raise ValueError(
                f"`score_computer` is TRAK's own kernel; method={method!r} scores with its "
                "preconditioner. Pass score_computer=None."
            )
        positive_int("memory_budget", memory_budget, optional=True, fix=MEMORY_BUDGET_FIX)
        self.model = model
        self.task = resolve_task(task)
        positive_int("train_set_size", train_set_size)
        self.train_set_size = int(train_set_size)
        self.device = torch.device(
            device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
        )
        self.dtype = self._resolve_dtype(dtype, use_half_precision)
        if lambda_reg is None:  # TRAK's 0; the per-layer methods' evidence-chosen "auto"
            lambda_reg = "auto" if self.layered and method != "identity" else 0.0
        self.lambda_reg = check_lambda(lambda_reg)
        if self.layered and method != "identity" and self.lambda_reg == 0:
            self.logger.warning(
                "TRAKer(method=%r, lambda_reg=0): no damping, so directions of near-zero "
                "curvature dominate the scores; pass lambda_reg='auto' (0.3 of each layer's "
                "mean eigenvalue) or a positive number.",
                method,
            )
        self.memory_budget = memory_budget
        self.precision = precision
        self.progress = progress
        self.load_from_save_dir = bool(load_from_save_dir)
        if self.layered and mask is not None and not _whole_parameters(mask):
            raise ValueError(
                f"`mask` selects single entries, which method={method!r} cannot restrict (its "
                "features are whole layers' gradients); pass the layers' names as `grad_wrt`, "
                "or use method='trak' with the mask."
            )
        self.grad_wrt = select_parameters(model, grad_wrt, mask)
        self.proj_seed = projector_seed
        self.sample_seed = projector_seed if sample_seed is None else int(sample_seed)
        if self.layered:
            self._init_layered(projector, projection, curvature)
        else:
            if projection is not None:
                raise ValueError(
                    f"`projection`={projection!r} projects each layer's inputs and output "
                    f"gradients for the per-layer methods; method={method!r} takes `projector` "
                    "or `proj_dim`. Pass projection=None."
                )
            self._init_projected(
                projector, proj_dim, proj_max_batch_size, mask, gradient_computer, score_computer
            )
            self.score_computer = (
                None
                if score_computer is None
                else score_computer(
                    dtype=self.dtype,
                    device=self.device,
                    logging_level=logging_level,
                    lambda_reg=self.lambda_reg,
                )
            )
        self.settings = TRAKSettings(
            train_set_size=self.train_set_size,
            proj_dim=self.proj_dim,
            projector=self._projector_record(),
            model=model_fingerprint(model),
            task=type(self.task).__name__,
            grad_wrt=self.grad_wrt,
            dtype=str(self.dtype).removeprefix("torch."),
            normalize=self.normalize_factor,
            method=method,
            curvature=curvature,
            sample_seed=self.sample_seed if curvature == "sampled" else 0,
            layers=[x.name for x in self.layers],
        )
        # An instance to ask what it stores beside the features.
        self._stored_arrays = self._new_preconditioner().stored_arrays
        if self.layered and "rank_one" not in self._stored_arrays:
            # Rows whose layers each see one position keep [a, g], not vec(g aᵀ).
            self._stored_arrays = (*self._stored_arrays, "rank_one")
        self.save_dir = Path(save_dir).resolve()
        if self.save_dir.exists() and not self.save_dir.is_dir():
            raise NotADirectoryError(
                f"`save_dir`={str(save_dir)!r} is a file, not a directory; pass the path of a "
                "directory (it is created if missing)."
            )
        # Rank 0 writes the settings record; the others then compare with it.
        with rank_zero_first():
            self.store = RowStore(self.save_dir, self.settings, what="TRAK store")
        positive_int("chunk_rows", chunk_rows, optional=True, fix="pass None for ~1 MiB chunks")
        self._dense_chunk_rows = chunk_rows or default_chunk_rows(
            (self.proj_dim,), np.dtype(self._np_dtype)
        )
        self._chunk_rows = self._dense_chunk_rows
        if chunk_rows is None and "rank_one" in self._stored_arrays:
            # Rank-one rows are narrow: ~1 MiB chunks of them, made of whole dense
            # chunks, so writers splitting rows by chunk never share a dense chunk.
            narrow = default_chunk_rows(
                (self.featurizer.row_width("rank_one"),), np.dtype(self._np_dtype)
            )
            self._chunk_rows *= max(1, narrow // self._dense_chunk_rows)
        self._owned: np.ndarray | None = None
        self._exp_owned: np.ndarray | None = None
        self.ckpt_loaded: int | None = None
        self._done: np.ndarray | None = None
        self._dense = not self.layered
        self._tokens: list[int] | None = None
        self._last_ind = 0
        self._exp: str | None = None
        self._exp_model_id: int | None = None
        self._exp_done: np.ndarray | None = None
        self._exp_per_token = False
        self._last_ind_target = 0
        self._precond: Preconditioner | None = None
        self._covered: np.ndarray | None = None
        self._covered_any: np.ndarray | None = None
        self._rows_since_save = 0
        self._ckpt_lock: filelock.BaseFileLock | None = None
        self.scores: Any = None

    # -- set-up ----------------------------------------------------------------
    @property
    def _np_dtype(self) -> Any:
        return np.dtype(str(self.dtype).removeprefix("torch.")).type

    @property
    def _q_dtype(self) -> Any:
        # Per-layer methods keep Q in float64 (it weighs EK-FAC's squared rows).
        return np.float64 if self.layered else np.float32

    def _resolve_dtype(self, dtype: torch.dtype | None, half: bool | None) -> torch.dtype:
        """The features' storage dtype (see the class docstring)."""
        allowed = (torch.float32, torch.float64) if self.layered else (torch.float16, torch.float32)
        if dtype is None:
            if half is None:
                half = self.device.type == "cuda" and not self.layered
            if half and self.layered:
                raise ValueError(
                    f"`use_half_precision`=True is not supported by method={self.method!r}: its "
                    "features' squares feed the curvature. Pass use_half_precision=False."
                )
            return torch.float16 if half else torch.float32
        if dtype not in allowed:
            raise ValueError(
                f"`dtype` must be one of {[str(d) for d in allowed]} for method={self.method!r}, "
                f"got {dtype!r}."
            )
        return dtype

    def _init_layered(
        self, projector: Any, projection: tuple[int, int] | None, curvature: str
    ) -> None:
        """Per-layer (Kronecker) features: no gradient computer, no flat projector."""
        refuse_wrapped(self.model)
        seed = self.proj_seed
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
        if projection is not None:
            p = tuple(projection)
            if len(p) != 2 or any(
                isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in p
            ):
                raise ValueError(
                    f"`projection` must be (k_in, k_out) positive ints or None, got {projection!r}."
                )
            projection = (int(p[0]), int(p[1]))
        self.featurizer = KroneckerFeaturizer(
            self.model,
            self.task,
            grad_wrt=self.grad_wrt,
            projection=projection,
            projection_seed=seed,
            curvature=curvature,
            sample_seed=self.sample_seed,
            device=self.device,
            dtype=self.dtype,
        )
        self.projection = projection
        self.layers: list[Any] = list(self.featurizer.layers)
        self.projector = self.featurizer.projector
        self.proj_dim = self.featurizer.feature_dim
        self.grad_dim = self.proj_dim
        self.normalize_factor = 1.0
        self.gradient_computer: Any = None
        self.score_computer = None

    def _init_projected(
        self,
        projector: Any,
        proj_dim: int,
        proj_max_batch_size: int,
        mask: MaskLike | None,
        gradient_computer: Any,
        score_computer: Any,
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
            raise ValueError(
                f"`projector` lives on {where} but `device`={str(self.device)!r}; build it "
                f"there (e.g. {type(projector).__name__}(..., device={str(self.device)!r})) "
                "or pass device= its device."
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

    def _projector_record(self) -> dict[str, Any]:
        if self.layered:
            # The per-layer projection is fixed by its sides and seed.
            projection = None if self.projection is None else list(self.projection)
            seed = None if self.projector is None else int(self.projector.seed)
            return {"kind": "per-layer", "projection": projection, "seed": seed}
        return _projector_record(self.projector, self.grad_dim)

    def _new_preconditioner(self) -> Preconditioner:
        spec = PreconditionerSpec(
            feature_dim=self.proj_dim,
            damping=self.lambda_reg,
            device=self.device,
            layers=self.layers,
            curvature=self.settings.curvature,
            score_computer=self.score_computer,
        )
        return self._precond_cls(spec)

    def _default_projector(
        self, proj_dim: int, proj_max_batch_size: int, mask: MaskLike | None
    ) -> Any:
        """The projector used when none is given (see the class docstring)."""
        if self.device.type == "cuda":
            return CudaProjector(
                self.grad_dim,
                int(proj_dim),
                self.proj_seed,
                "rademacher",
                self.device,
                proj_max_batch_size,
                mask=mask,
            )
        # One index_add_ pass per batch, tables built once: the fast CPU choice,
        # with exactly proj_dim features whichever gradient computer runs.
        return CountSketchProjector(
            self.grad_dim, int(proj_dim), self.proj_seed, self.device, mask=mask
        )

    def _ckpt_record(self, model_id: int) -> dict[str, Any]:
        path = self.save_dir / layout.checkpoint_record(model_id)
        fix = (
            "delete that file and rerun: load_checkpoint writes it again, the stored rows are "
            "checked and kept, and finalize_features runs again."
        )
        return read_record(path, fix=fix) if path.exists() else {}

    def _write_ckpt_record(self, model_id: int, record: Mapping[str, Any]) -> None:
        path = self.save_dir / layout.checkpoint_record(model_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_record(path, record)

    @property
    def model_ids(self) -> list[int]:
        """Checkpoints present in the store."""
        return layout.checkpoint_ids(self.save_dir)

    def _load_weights(self, checkpoint: Mapping[str, Any], model_id: int) -> None:
        self.model.load_state_dict(checkpoint)
        self.model.eval()
        if self.layered:
            self.featurizer.set_model_id(int(model_id))
            return
        self.gradient_computer.load_model_params(self.model)
        self.projector.set_model_id(int(model_id))

    # -- accumulated preconditioner state (per rank, saved with the rows it covers) ------
    def _accumulated_path(self, model_id: int, rank: int) -> Path:
        return self.save_dir / layout.checkpoint_dir(model_id) / f"accumulated.{rank}.npz"

    def _accumulated_files(self, model_id: int) -> list[Path]:
        folder = self.save_dir / layout.checkpoint_dir(model_id)
        # Exactly accumulated.<rank>.npz: never another rank's file being written.
        return sorted(p for p in folder.glob("accumulated.*.npz") if p.name.split(".")[1].isdigit())

    def _read_accumulated(self, model_id: int) -> tuple[Preconditioner, np.ndarray, np.ndarray]:
        """The accumulated preconditioner and covered rows of this rank, and every rank's.

        Raises:
            SettingsMismatchError: the store's accumulated state was written by
                another number of ranks.
        """
        rank, world = rank_and_world()
        n = self.train_set_size
        precond = self._new_preconditioner()
        mine = np.zeros(n, dtype=bool)
        every = np.zeros(n, dtype=bool)
        for path in self._accumulated_files(model_id):
            z, problem = load_npz(path)
            if z is None or "__world__" not in z or "__covered__" not in z:
                # Recomputed: its rows count as not yet in the statistics.
                self.logger.warning(
                    "curvature statistics `%s` are damaged (%s); discarding them: featurize "
                    "adds their rows again.",
                    path,
                    problem or "incomplete",
                )
                with self.store.lock.held():
                    path.unlink(missing_ok=True)
                continue
            written_by = int(z["__world__"])
            if written_by != world:
                raise SettingsMismatchError(
                    f"model id {model_id} in `{self.save_dir}` has curvature statistics "
                    f"accumulated by {written_by} process(es), but this run has {world}. "
                    f"Resume with {written_by}, or pass load_from_save_dir=False to refit."
                )
            covered = z["__covered__"].astype(bool)
            every |= covered
            if path == self._accumulated_path(model_id, rank):
                mine = covered
                precond.load_state_dict({k: v for k, v in z.items() if not k.startswith("__")})
        return precond, mine, every

    # -- one featurizing process per checkpoint, intact rows ------------------------------
    def _hold_checkpoint(self, model_id: int) -> None:
        """Accumulating methods: hold ``model_id``'s featurizing lock (one process at a time).

        Their curvature statistics live in one file per rank that a second
        process would overwrite, so a second process featurizing the same
        checkpoint waits here until the first moves on (or exits).
        """
        self._release_checkpoint()
        if not self._precond_cls.accumulates:
            return
        rank, _ = rank_and_world()
        folder = self.save_dir / layout.checkpoint_dir(model_id)
        folder.mkdir(parents=True, exist_ok=True)
        lock = filelock.FileLock(
            str(folder / f".featurize.{rank}.lock"), thread_local=False, is_singleton=True
        )
        try:
            lock.acquire(timeout=0)
        except filelock.Timeout:
            self.logger.warning(
                "model id %d in `%s` is being featurized by another process; waiting until it "
                "loads another checkpoint, finalizes or exits (curvature statistics are "
                "accumulated by one process per checkpoint).",
                model_id,
                self.save_dir,
            )
            lock.acquire()
        self._ckpt_lock = lock

    def _release_checkpoint(self) -> None:
        lock, self._ckpt_lock = self._ckpt_lock, None
        if lock is not None:
            lock.release()

    def _row_arrays(self, model_id: int) -> list[str]:
        """The stored per-row arrays of ``model_id`` (those that exist)."""
        names = dict.fromkeys(
            ("grads", "out_to_loss", "features", *self._stored_arrays, "token_factors")
        )
        if self.store.has(layout.checkpoint_array(model_id, "grads")):
            # Dense rows stored: every row is there (NaN rank-one rows mark them).
            names.pop("rank_one", None)
            names.pop("token_factors", None)
        elif self.store.has(layout.checkpoint_array(model_id, "token_factors")):
            names.pop("rank_one", None)
        arrays = [layout.checkpoint_array(model_id, name) for name in names]
        return [a for a in arrays if self.store.has(a)]

    def _damaged(self, done: str, arrays: list[str]) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """Damaged rows per array and all of them, unflagged in ``done`` for recomputation."""
        found = self.store.damaged_rows(arrays, done)
        if not found:
            return {}, np.zeros(0, dtype=np.int64)
        rows = np.unique(np.concatenate(list(found.values())))
        self.store.unflag(done, rows)
        return found, rows

    def _repair_rows(self, model_id: int) -> None:
        """Unflag training rows whose stored data are missing or damaged; featurize redoes them."""
        assert self._done is not None
        if not self._done.any():
            return
        done = layout.checkpoint_array(model_id, "done")
        found, rows = self._damaged(done, self._row_arrays(model_id))
        if rows.size:
            self.logger.warning(
                "%s",
                damage_report(
                    found,
                    self.save_dir,
                    f"model id {model_id}",
                    f"These {rows.size} row(s) were unflagged and are featurized again.",
                ),
            )
            self._done[rows] = False

    def _require_intact_rows(self, model_id: int) -> None:
        """Refuse (and unflag) training rows of ``model_id`` that are missing or damaged."""
        done = layout.checkpoint_array(model_id, "done")
        found, rows = self._damaged(done, self._row_arrays(model_id))
        if rows.size:
            raise StoreIntegrityError(
                damage_report(
                    found,
                    self.save_dir,
                    f"model id {model_id}",
                    f"They were unflagged: call load_checkpoint(<its state dict>, "
                    f"model_id={model_id}) and featurize again (only these rows are "
                    "recomputed), then finalize_features().",
                )
            )

    def _require_intact_targets(self, exp_name: str, model_id: int) -> None:
        """Refuse (and unflag) target rows of ``exp_name`` that are missing or damaged."""
        target = functools.partial(layout.target_array, exp_name, model_id)
        arrays = [a for a in (target("grads"), target("token_grads")) if self.store.has(a)]
        found, rows = self._damaged(target("done"), arrays)
        if rows.size:
            raise StoreIntegrityError(
                damage_report(
                    found,
                    self.save_dir,
                    f"experiment {exp_name!r}, model id {model_id}",
                    f"They were unflagged: call start_scoring_checkpoint({exp_name!r}, <its state "
                    f"dict>, model_id={model_id}, ...) and score the targets again (only these "
                    "rows are recomputed), then finalize_scores().",
                )
            )

    def _save_accumulated(self) -> None:
        """Write the loaded checkpoint's accumulated state, if rows were added since."""
        if self.ckpt_loaded is None or self._precond is None or not self._rows_since_save:
            return
        assert self._covered is not None
        rank, world = rank_and_world()
        arrays = dict(self._precond.state_dict())
        arrays["__covered__"] = self._covered.astype(np.uint8)
        arrays["__world__"] = np.array(world, dtype=np.int64)
        _atomic_save(self._accumulated_path(self.ckpt_loaded, rank), arrays)
        self._rows_since_save = 0

    def load_checkpoint(self, checkpoint: Mapping[str, Any], model_id: int) -> None:
        """Load a checkpoint for featurizing; resumes rows already stored for ``model_id``.

        Raises:
            SettingsMismatchError: ``model_id`` was featurized from other weights.
        """
        self._save_accumulated()  # the previous checkpoint's, before they are replaced
        check_weights(checkpoint, model_id)
        sha = checkpoint_fingerprint(checkpoint)
        require_same_across_ranks("(model_id, checkpoint fingerprint)", (int(model_id), sha))
        world = rank_and_world()[1]
        n, k = self.train_set_size, self.proj_dim
        arr = functools.partial(layout.checkpoint_array, model_id)
        self._hold_checkpoint(model_id)
        with rank_zero_first() as first:
            record = self._ckpt_record(model_id)
            if record and record.get("checkpoint") != sha:
                raise SettingsMismatchError(
                    f"model id {model_id} in `{self.save_dir}` was featurized from a checkpoint "
                    f"with fingerprint {record.get('checkpoint')!r}, but the given checkpoint has "
                    f"{sha!r}. Use a new model_id for new weights, or another save_dir."
                )
            if not record:
                record = {"checkpoint": sha, "finalized": False}
                self._write_ckpt_record(model_id, record)
            if not self.layered:
                self.store.require_array(
                    arr("grads"), (n, k), self._np_dtype, chunk_rows=self._chunk_rows
                )
            # Per-layer methods create the dense rows when a batch needs them.
            rows_q = self.store.require_array(
                arr("out_to_loss"), (n, 1), self._q_dtype, chunk_rows=self._chunk_rows
            )
            for extra in self._stored_arrays:
                if extra in _DENSE_ROWS:
                    continue
                width = self.featurizer.row_width(extra)
                self.store.require_array(
                    arr(extra), (n, width), self._np_dtype, chunk_rows=self._chunk_rows
                )
            self.store.require_done(arr("done"), n, chunk_rows=self._chunk_rows)
            if first and not self.load_from_save_dir:
                self.store.array(arr("done"))[:] = np.zeros(n, dtype=np.uint8)
                for path in self._accumulated_files(model_id):
                    path.unlink()
                self._write_ckpt_record(model_id, {"checkpoint": sha, "finalized": False})
            if self.layered and first and world > 1 and not self.store.has(arr("grads")):
                # Ranks featurize at once, so the row form cannot be picked by whichever
                # batch comes first: dense rows under torch.distributed (stored ones rewritten).
                self._tokens = self._ckpt_record(model_id).get("tokens")
                self._require_dense(model_id)
        # The stored chunking decides the shards (a resumed store keeps its own).
        self._owned = owned_mask(n, int(rows_q.chunks[0]))
        self._done = self.store.done_rows(arr("done"))
        self._repair_rows(model_id)
        self._dense = not self.layered or self.store.has(arr("grads"))
        self._tokens = None if self._dense else self._ckpt_record(model_id).get("tokens")
        self._precond, self._covered, self._covered_any = None, None, None
        if self._precond_cls.accumulates:
            self._precond, self._covered, self._covered_any = self._read_accumulated(model_id)
        if self._done.any() or (self._covered_any is not None and self._covered_any.any()):
            self.logger.info(
                "model id %d: resuming, %d of %d rows already featurized%s",
                model_id,
                int(self._done.sum()),
                n,
                ""
                if self._covered_any is None
                else f", {int(self._covered_any.sum())} in the curvature statistics",
            )
        self._load_weights(checkpoint, model_id)
        self.ckpt_loaded = int(model_id)
        self._last_ind = 0
        self._rows_since_save = 0

    def _features(self, batch: Sequence[Tensor], model_id: int) -> Tensor:
        """``[B, k]`` stored features of a batch (training rows or targets)."""
        if self.layered:
            parts, _ = self.featurizer.layer_parts(batch)
            return self.featurizer.features([(a, g) for a, g, _ in parts])
        gc = self.gradient_computer
        if hasattr(gc, "project"):
            phi = gc.project(batch, self.projector, model_id)
        else:
            phi = self.projector.project(gc.compute_per_sample_grad(batch), model_id=model_id)
        return phi / self.normalize_factor

    def _train_rows(
        self, batch: Sequence[Tensor], idx: np.ndarray
    ) -> tuple[Tensor | None, Tensor, Any, dict[str, Tensor]]:
        """Features, Q, per-layer parts (or None) and extra stored rows of training rows.

        Features are ``None`` where rank-one rows stand for them.
        """
        if not self.layered:
            projected = self._features(batch, int(self.ckpt_loaded or 0))
            return projected, self.gradient_computer.compute_loss_grad(batch), None, {}
        sampled = self.settings.curvature == "sampled" and (
            self._precond_cls.accumulates or bool(self._stored_arrays)
        )
        parts, q = self.featurizer.layer_parts(batch, idx if sampled else None)
        mode = self._row_mode(self.featurizer.token_counts(parts))
        if mode == "dense":
            phi = self.featurizer.features([(a, g) for a, g, _ in parts])
            extra = {name: self.featurizer.extra_rows(name, parts) for name in self._stored_arrays}
            return phi, q, parts, extra
        kept = [x for x in self._stored_arrays if x not in _DENSE_ROWS]
        tokens = self._tokens
        if tokens is not None:  # "factored": the positions' [a, g] stand for rank_one too
            kept.remove("rank_one")
        extra = {name: self.featurizer.extra_rows(name, parts) for name in kept}
        if tokens is not None:
            extra["token_factors"] = self.featurizer.factored_rows(parts, tokens)
        return None, q, parts, extra

    def _row_mode(self, tokens: Sequence[int]) -> str:
        """How a batch's per-layer rows are kept: ``"rank_one"``, ``"factored"`` or ``"dense"``.

        Rows start as each layer's ``[a, g]`` (``rank_one``). The first batch
        whose layers see several positions picks ``token_factors`` (its
        positions' ``[a, g]``, padded to that batch's counts) where that is
        narrower than the dense ``vec(sum_t g_t a_tᵀ)``, else dense rows; a
        later batch with more positions than stored turns the store dense.
        Rows already stored are rewritten in the new form, so every stored
        row is in the newest form.
        """
        assert self.ckpt_loaded is not None
        if self._dense:
            return "dense"
        if self._tokens is None and all(t == 1 for t in tokens):
            return "rank_one"
        if self._tokens is None:
            width = self.featurizer.row_width("token_factors", tokens)
            if width < self.featurizer.dense_width():
                self._start_factored(self.ckpt_loaded, list(tokens))
                return "factored"
        elif all(t <= s for t, s in zip(tokens, self._tokens)):
            return "factored"
        self._require_dense(self.ckpt_loaded)
        return "dense"

    def _compact_rows(self, model_id: int, rows: np.ndarray) -> Any:
        """Per-layer parts of stored factored rows ``rows`` (rank-one or token factors)."""
        name = "rank_one" if self._tokens is None else "token_factors"
        x = self.store.array(layout.checkpoint_array(model_id, name)).oindex[rows]
        return self.featurizer.split_rank_one(torch.from_numpy(np.asarray(x)), self._tokens)

    def _rewrite_rows(self, model_id: int, write: Any) -> None:
        """``write(rows, parts)`` for the stored rows of ``model_id``, chunk by chunk."""
        self.store.flush()
        done = self.store.done_rows(layout.checkpoint_array(model_id, "done"))
        for start in range(0, self.train_set_size, self._chunk_rows):
            rows = np.nonzero(done[start : start + self._chunk_rows])[0] + start
            if rows.size:
                write(rows, self._compact_rows(model_id, rows))

    def _start_factored(self, model_id: int, tokens: list[int]) -> None:
        """Create ``token_factors`` of ``model_id`` with ``tokens`` positions per layer."""
        arr = functools.partial(layout.checkpoint_array, model_id)
        width = self.featurizer.row_width("token_factors", tokens)
        factored = self.store.require_array(
            arr("token_factors"),
            (self.train_set_size, width),
            self._np_dtype,
            chunk_rows=self._dense_chunk_rows,
        )

        def write(rows: np.ndarray, parts: Any) -> None:
            factored.oindex[rows] = self.featurizer.factored_rows(parts, tokens).numpy()

        self._rewrite_rows(model_id, write)
        self._write_ckpt_record(model_id, {**self._ckpt_record(model_id), "tokens": tokens})
        self._tokens = tokens

    def _require_dense(self, model_id: int) -> None:
        """Create the dense per-layer rows of ``model_id``, filled for its stored rows."""
        arr = functools.partial(layout.checkpoint_array, model_id)
        n, k = self.train_set_size, self.proj_dim
        for name in (x for x in ("grads", *self._stored_arrays) if x in _DENSE_ROWS):
            dense = self.store.require_array(
                arr(name), (n, k), self._np_dtype, chunk_rows=self._dense_chunk_rows
            )
            use_sampled = name == "fisher_grads"

            def write(
                rows: np.ndarray, parts: Any, dense: Any = dense, s: bool = use_sampled
            ) -> None:
                pairs = [(a, gs if s and gs is not None else g) for a, g, gs in parts]
                dense.oindex[rows] = self.featurizer.features(pairs).numpy()

            self._rewrite_rows(model_id, write)
        self._dense = True

    def stored_features(self, model_id: int, name: str = "grads") -> Any:
        """The stored ``[n, k]`` training features of checkpoint ``model_id``, as an array.

        Per-layer methods keep each layer's ``[a, g]`` where every layer sees one
        position per example; the returned view then expands ``vec(g aᵀ)`` as
        row slices are read (``view[i:j]``, a numpy array). ``name="fisher_grads"``:
        the features under sampled labels (``curvature="sampled"``).
        """
        arr = functools.partial(layout.checkpoint_array, model_id)
        if not self.layered or self.store.has(arr(name)):
            return self.store.array(arr(name))
        tokens = self._ckpt_record(model_id).get("tokens")
        return FactoredRows(
            self.store.array(arr("rank_one" if tokens is None else "token_factors")),
            self.featurizer,
            tokens=tokens,
            sampled=name == "fisher_grads",
        )

    # -- featurizing ------------------------------------------------------------
    def featurize(
        self, batch: Sequence[Tensor], inds: Any = None, num_samples: int | None = None
    ) -> None:
        """Compute and store features and Q of a batch of training rows.

        TRAK's features are ``P grad f / sqrt(d)``; the per-layer methods store
        each factored layer's gradient and fit their curvature from the same
        pass. Rows already stored (from an interrupted run) are skipped: their
        gradients are not recomputed, and rows already in the stored curvature
        statistics are not added twice (both resume independently).

        Args:
            batch: tuple of ``[B, ...]`` tensors, as the task expects, or (for
                the Hugging Face tasks) a dict such as a tokenizer returns.
            inds: ``[B]`` row indices in the training set.
            num_samples: ``B``, when rows follow the previous batch.
        """
        if self.ckpt_loaded is None or self._done is None:
            raise ModelIDException(
                "no checkpoint loaded; call traker.load_checkpoint(state_dict, model_id) "
                "before featurize."
            )
        batch, idx = _batch_rows(
            self.task,
            batch,
            inds,
            num_samples,
            self._last_ind,
            self.train_set_size,
            "featurize",
            self.device,
        )
        check_token_batch(self.task, self.model, batch, "featurize")
        if num_samples is not None:
            self._last_ind += int(num_samples)
        need_rows = ~self._done[idx]
        need_acc = np.zeros_like(need_rows)
        if self._covered_any is not None:
            need_acc = ~self._covered_any[idx]
        if self._owned is not None:
            need_rows &= self._owned[idx]
            need_acc &= self._owned[idx]
        todo = need_rows | need_acc
        if not todo.any():
            return
        if not todo.all():
            keep = torch.as_tensor(np.nonzero(todo)[0], device=batch[0].device)
            batch = tuple(t.index_select(0, keep.to(t.device)) for t in batch)
            idx, need_rows, need_acc = idx[todo], need_rows[todo], need_acc[todo]
        phi, q, parts, extra = self._train_rows(batch, idx)
        # Before anything is accumulated or written: one NaN would poison every score.
        checked = {"features": phi, "out_to_loss": q, **extra}
        if phi is not None:
            checked.pop("rank_one", None)  # NaN rows there mark rows kept dense
        check_finite_rows(checked, idx, batch, "featurize")
        if need_acc.any():
            mask = self.featurizer.token_mask(batch) if self.layered else None
            self._accumulate(idx, need_acc, phi, q, parts, mask)
        if not need_rows.any():
            return
        rows = np.nonzero(need_rows)[0]
        if rows.size < idx.size:
            keep_rows = torch.as_tensor(rows, device=q.device)
            phi = None if phi is None else phi[keep_rows.to(phi.device)]
            q = q[keep_rows]
            extra = {name: x[keep_rows] for name, x in extra.items()}
        arr = functools.partial(layout.checkpoint_array, self.ckpt_loaded)
        arrays = {
            arr("out_to_loss"): q.detach().cpu().numpy().astype(self._q_dtype).reshape(-1, 1),
        }
        if phi is not None:  # dense rows: _row_mode made the store dense already
            arrays[arr("grads")] = phi.detach().to(self.dtype).cpu().numpy()
        for name, x in extra.items():
            arrays[arr(name)] = x.detach().to(self.dtype).cpu().numpy()
        self.store.write_rows(
            idx[rows],
            arrays,
            done=arr("done"),
            background=True,  # written while the next batch is computed
        )
        self._done[idx[rows]] = True

    def _accumulate(
        self,
        idx: np.ndarray,
        need: np.ndarray,
        phi: Tensor | None,
        q: Tensor,
        parts: Any,
        token_mask: Tensor | None,
    ) -> None:
        """Hand the rows ``need`` of a batch to the accumulating preconditioner."""
        assert self._precond is not None and self._covered is not None
        assert self._covered_any is not None
        sel = torch.as_tensor(np.nonzero(need)[0], device=q.device)
        if phi is None and not isinstance(self._precond, KFACPreconditioner):
            # K-FAC's statistics come from the layers' parts; a user's may read features.
            phi = self.featurizer.features([(a, g) for a, g, _ in parts])

        every = bool(need.all())

        def pick(t: Tensor) -> Tensor:
            # Most batches hand over every row: no copy then.
            return t if every else t.index_select(0, sel.to(t.device))

        layers = None
        if parts is not None:
            layers = [(pick(a), pick(g), None if gs is None else pick(gs)) for a, g, gs in parts]
        self._precond.accumulate(
            FeatureBatch(
                rows=idx[need],
                features=None if phi is None else pick(phi),
                out_to_loss=pick(q),
                layers=layers,
                token_mask=None if token_mask is None else pick(token_mask),
            )
        )
        self._covered[idx[need]] = True
        self._covered_any[idx[need]] = True
        self._rows_since_save += int(need.sum())
        if self._rows_since_save >= max(self._chunk_rows, self.train_set_size // 10):
            self._save_accumulated()

    def featurize_loader(self, loader: Iterable[Any], *, batch_size: int = 16) -> None:
        """Featurize every batch of ``loader`` in order, with a progress bar.

        ``loader`` yields tuple or dict batches, or is a ``datasets.Dataset``
        with the task's columns (read in order, ``batch_size`` rows at a time,
        ragged token columns right-padded and masked).

        Under ``torch.distributed``, an in-order map-style ``DataLoader`` is
        re-batched over this rank's rows still to do, so each rank loads only
        the examples it featurizes; other iterables are read in full and each
        rank keeps its own rows.
        """
        if self._done is None or self._owned is None:
            raise ModelIDException(
                "no checkpoint loaded; call traker.load_checkpoint(state_dict, model_id) "
                "before featurize_loader."
            )
        self._last_ind = self._run_loader(
            as_loader(loader, self.task, batch_size),
            self.featurize,
            self._done,
            self._owned,
            self._last_ind,
            f"featurizing model {self.ckpt_loaded}",
        )
        self._save_accumulated()
        self.store.flush()

    def _run_loader(
        self,
        loader: Iterable[Any],
        step: Any,
        done: np.ndarray,
        owned: np.ndarray,
        first_row: int,
        desc: str,
    ) -> int:
        """Feed ``loader``'s batches to ``step``; returns the row after the last one."""
        rank, world = rank_and_world()
        disable = not self.progress or rank != 0
        size = shardable_size(loader) if world > 1 else None
        sharded = None
        if size is not None and first_row + size <= done.size:
            window = slice(first_row, first_row + size)
            rows = np.nonzero(owned[window] & ~done[window])[0]
            sharded = shard_loader(loader, rows)
        if sharded is None:
            for raw in tqdm(loader, desc=desc, disable=disable):
                batch = as_task_batch(self.task, raw)
                step(batch, num_samples=int(batch[0].shape[0]))
                first_row += int(batch[0].shape[0])
            return first_row
        start = 0
        for raw in tqdm(sharded, desc=desc, disable=disable):
            batch = as_task_batch(self.task, raw)
            count = int(batch[0].shape[0])
            step(batch, inds=first_row + rows[start : start + count])
            start += count
        assert size is not None
        return first_row + size

    def _row_block(self) -> int:
        if self.memory_budget is None:
            return default_block_rows(self.train_set_size, self.proj_dim)
        return max(1, min(self.train_set_size, self.memory_budget // (8 * self.proj_dim)))

    def finalize_features(
        self, model_ids: Iterable[int] | None = None, del_grads: bool = False
    ) -> None:
        """Fit each checkpoint's preconditioner from its stored rows and mark it final.

        TRAK computes XᵀX (streamed in row blocks, summed across ranks); K-FAC
        eigendecomposes its factors; EK-FAC also corrects the eigenvalues in
        one pass over the stored rows. The ``[n, k]`` features
        ``X (XᵀX + λI)⁻¹`` are only formed when ``del_grads=True`` (TRAK only;
        then they replace the gradients); otherwise the preconditioner is
        applied to the targets at scoring time, which is cheaper.
        """
        if del_grads and self.method != "trak":
            raise ValueError(
                f"`del_grads`=True is not supported by method={self.method!r}: the stored "
                "training gradients are what queries are scored against. Pass del_grads=False."
            )
        self._save_accumulated()
        self._release_checkpoint()
        if not self.layered:
            self.projector.free_memory()
        # Every rank's rows must be on disk before anyone reads the flags.
        self.store.flush()
        barrier()
        ids = self.model_ids if model_ids is None else [int(i) for i in model_ids]
        require_same_across_ranks("the model ids to finalize", ids)
        rank, world = rank_and_world()
        bar = tqdm(ids, desc="finalizing features", disable=not self.progress or rank != 0)
        for model_id in bar:
            record = self._ckpt_record(model_id)
            if not record:
                raise ModelIDException(
                    f"model id {model_id} is not in `{self.save_dir}`; featurized ids are "
                    f"{self.model_ids}."
                )
            arr = functools.partial(layout.checkpoint_array, model_id)
            done = self.store.done_rows(arr("done"))
            precond: Preconditioner | None = None
            if self._precond_cls.accumulates:
                precond, _, covered = self._read_accumulated(model_id)
                done = done & covered
            # Ranks decide together, from the same flags, whether to go on.
            require_same_across_ranks(f"model id {model_id} complete", bool(done.all()))
            if not done.all():
                missing = np.nonzero(~done)[0]
                raise ModelIDException(
                    f"model id {model_id} is not fully featurized: {missing.size} of "
                    f"{done.size} rows missing (first: {missing[:5].tolist()}). Featurize them, "
                    "then finalize."
                )
            if record.get("finalized"):
                self.logger.info("model id %d already finalized; skipping", model_id)
                continue
            self._require_intact_rows(model_id)
            precond = precond or self._new_preconditioner()
            rows_q = self.store.array(arr("out_to_loss"))
            # Each rank reads its own rows; the preconditioner sums across ranks.
            mine = chunk_shard(self.train_set_size, int(rows_q.chunks[0]))
            if world == 1:
                mine = range(self.train_set_size)
            names = [x for x in ("grads", *self._stored_arrays) if x != "rank_one"]
            arrays = {name: self.stored_features(model_id, name) for name in names}
            tokens = None
            if self.layered and not self.store.has(arr("grads")):
                # Rows kept factored: the preconditioner may read the factors themselves.
                tokens = self._ckpt_record(model_id).get("tokens")
                arrays["factored"] = self.store.array(
                    arr("rank_one" if tokens is None else "token_factors")
                )
            train = TrainRows(
                arrays,
                self.store.array(arr("out_to_loss")),
                mine,
                size=self.train_set_size,
                block_rows=self._row_block(),
                device=self.device,
                prefetch=self.memory_budget is None,
                tokens=tokens,
            )
            precond.finalize(train)
            state = precond.state_dict()
            if rank == 0:
                for key, value in state.items():
                    name = layout.checkpoint_state(model_id, key)
                    self.store.require_array(name, value.shape, value.dtype)[...] = value
            if del_grads:
                assert isinstance(precond, GramPreconditioner) and precond.xtx is not None
                self._form_features(model_id, precond.xtx, mine)
                barrier()
                if rank == 0:
                    self.store.delete(arr("grads"))
            if rank == 0:
                self._write_ckpt_record(
                    model_id,
                    {**record, "finalized": True, "features": del_grads, "state": sorted(state)},
                )
            barrier()

    def preconditioner(self, model_id: int) -> Preconditioner:
        """The finalized preconditioner of checkpoint ``model_id``, read from the store.

        ``traker.preconditioner(0).solve(targets)`` is ``P⁻¹`` applied to
        ``[m, k]`` target features, as scoring applies it.

        Raises:
            ModelIDException: ``model_id`` is not finalized.
        """
        record = self._ckpt_record(model_id)
        if not record.get("finalized"):
            raise ModelIDException(
                f"model id {model_id} is not finalized in `{self.save_dir}`; call "
                "finalize_features() first."
            )
        return self._load_preconditioner(model_id, record)

    def _load_preconditioner(self, model_id: int, record: Mapping[str, Any]) -> Preconditioner:
        """The finalized preconditioner of ``model_id``, read from the store."""
        keys = record.get("state", ["xtx"] if self.method == "trak" else [])
        state, problem = self._read_state(model_id, keys)
        if state is None:
            if record.get("features"):
                raise StoreIntegrityError(
                    f"model id {model_id} in `{self.save_dir}`: its finalized state is damaged "
                    f"({problem}) and its gradients were deleted (del_grads=True). Fix: "
                    f"featurize it again with load_from_save_dir=False, then finalize."
                )
            # Recomputed from the stored rows (and statistics), as finalize made it.
            self.logger.warning(
                "model id %d: finalized state is damaged (%s); finalizing it again.",
                model_id,
                problem,
            )
            self._write_ckpt_record(model_id, {**record, "finalized": False})
            self.finalize_features([model_id])
            record = self._ckpt_record(model_id)
            keys = record.get("state", keys)
            state, problem = self._read_state(model_id, keys)
            if state is None:
                raise StoreIntegrityError(
                    f"model id {model_id} in `{self.save_dir}`: its finalized state is still "
                    f"damaged after finalizing again ({problem})."
                )
        precond = self._new_preconditioner()
        precond.load_state_dict(state)
        return precond

    def _read_state(
        self, model_id: int, keys: Sequence[str]
    ) -> tuple[dict[str, np.ndarray] | None, str | None]:
        """The finalized state arrays, or ``(None, reason)`` when one is missing or damaged."""
        state = {}
        for key in keys:
            name = layout.checkpoint_state(model_id, key)
            if not self.store.has(name):
                return None, f"`{self.save_dir / name}` is missing"
            try:
                value = np.asarray(self.store.array(name)[...])
            except (ValueError, OSError, StoreIntegrityError) as exc:
                return None, f"`{self.save_dir / name}` fails to read: {exc}"
            if value.dtype.kind == "f" and not np.isfinite(value).all():
                return None, f"`{self.save_dir / name}` holds NaN (a chunk is missing)"
            state[key] = value
        return state, None

    def _form_features(self, model_id: int, xtx: Tensor, rows: range) -> None:
        grads = self.store.array(layout.checkpoint_array(model_id, "grads"))
        inv = damped_inverse(xtx.float(), resolve_lambda(self.lambda_reg, xtx.float()))
        with rank_zero_first():
            # Same chunks as the gradients, so each rank's rows fill whole chunks.
            feats = self.store.require_array(
                layout.checkpoint_array(model_id, "features"),
                tuple(grads.shape),
                np.float32,
                chunk_rows=grads.chunks[0],
            )
        step = self._row_block()
        for start in range(rows.start, rows.stop, step):
            stop = min(rows.stop, start + step)
            x = rows_as_tensor(grads, start, stop, device=self.device, dtype=torch.float32)
            feats[start:stop] = (x @ inv).cpu().numpy()

    # -- scoring ------------------------------------------------------------------
    def start_scoring_checkpoint(
        self,
        exp_name: str,
        checkpoint: Mapping[str, Any],
        model_id: int,
        num_targets: int,
        *,
        per_token: bool = False,
    ) -> None:
        """Load ``checkpoint`` to compute target features of experiment ``exp_name``.

        Args:
            exp_name: the experiment's name.
            checkpoint: the state dict of checkpoint ``model_id``.
            model_id: the checkpoint's id (featurized before).
            num_targets: number of targets m.
            per_token: also keep one feature per target token, for
                :meth:`finalize_scores` with ``per_token=True`` (tasks with a
                ``per_token_batch``, as ``"language_modeling"``; each target
                costs ``T`` per-example gradients).

        Raises:
            SettingsMismatchError: ``exp_name`` exists with another ``num_targets``
                or ``per_token``.
        """
        self._save_accumulated()
        self._release_checkpoint()
        if not exp_name or "/" in exp_name:
            raise ValueError(f"`exp_name` must be a non-empty name without '/', got {exp_name!r}.")
        positive_int("num_targets", num_targets)
        check_weights(checkpoint, model_id)
        _check_per_token(self.task, per_token)
        require_same_across_ranks(
            "(exp_name, model_id, num_targets, checkpoint fingerprint)",
            (exp_name, int(model_id), num_targets, checkpoint_fingerprint(checkpoint)),
        )
        rec_path = self.save_dir / layout.experiment_record(exp_name)
        requested: dict[str, Any] = {"num_targets": num_targets}
        if per_token:
            requested["per_token"] = True
        arr = functools.partial(layout.target_array, exp_name, model_id)
        with rank_zero_first():
            rec_path.parent.mkdir(parents=True, exist_ok=True)
            if rec_path.exists():
                stored = read_record(rec_path)
                if stored.get("num_targets") != num_targets:
                    raise SettingsMismatchError(
                        f"experiment {exp_name!r} in `{self.save_dir}` has num_targets="
                        f"{stored.get('num_targets')}, requested {num_targets}. Use a new "
                        "exp_name."
                    )
                if bool(stored.get("per_token", False)) != bool(per_token):
                    raise SettingsMismatchError(
                        f"experiment {exp_name!r} in `{self.save_dir}` has per_token="
                        f"{bool(stored.get('per_token', False))}, requested {per_token}. Use a "
                        "new exp_name."
                    )
            else:
                write_record(rec_path, requested)
            targets = self.store.require_array(
                arr("grads"),
                (num_targets, self.proj_dim),
                self._np_dtype,
                chunk_rows=self._dense_chunk_rows,
            )
            self.store.require_done(arr("done"), num_targets, chunk_rows=self._dense_chunk_rows)
        self._exp_owned = owned_mask(num_targets, int(targets.chunks[0]))
        self._exp_done = self.store.done_rows(arr("done"))
        self._load_weights(checkpoint, model_id)
        self._exp, self._exp_model_id = exp_name, int(model_id)
        self._exp_num_targets = num_targets
        self._exp_per_token = bool(per_token)
        self._last_ind_target = 0

    def score(
        self, batch: Sequence[Tensor], inds: Any = None, num_samples: int | None = None
    ) -> None:
        """Compute and store the target features of a batch (see :meth:`featurize`)."""
        if self._exp is None or self._exp_model_id is None or self._exp_done is None:
            raise ModelIDException(
                "no scoring checkpoint; call traker.start_scoring_checkpoint(...) before score."
            )
        batch, idx = _batch_rows(
            self.task,
            batch,
            inds,
            num_samples,
            self._last_ind_target,
            self._exp_num_targets,
            "score",
            self.device,
        )
        check_token_batch(self.task, self.model, batch, "score")
        if num_samples is not None:
            self._last_ind_target += int(num_samples)
        todo = ~self._exp_done[idx]
        if self._exp_owned is not None:
            todo &= self._exp_owned[idx]
        if not todo.any():
            return
        if not todo.all():
            keep = torch.as_tensor(np.nonzero(todo)[0])
            batch = tuple(t.index_select(0, keep.to(t.device)) for t in batch)
            idx = idx[todo]
        arr = functools.partial(layout.target_array, self._exp, self._exp_model_id)
        rows: dict[str, np.ndarray] = {}
        if self._exp_per_token:
            # f = Σ_t f_t: the target's feature is the sum of its tokens' features.
            size = int(batch[0].shape[0])
            count = getattr(self.task, "per_token_length", None)
            length = int(count(batch)) if callable(count) else int(batch[0].shape[1])
            # B targets give B * T per-token rows; a few targets at a time keep
            # each pass at most max(B, T) rows.
            group = max(1, size // length)
            parts = []
            for start in range(0, size, group):
                part = tuple(t[start : start + group] for t in batch)
                expanded = tuple(self.task.per_token_batch(part))  # type: ignore[attr-defined]
                parts.append(self._features(expanded, self._exp_model_id))
            tokens = torch.cat(parts).reshape(size, length, -1)
            phi = tokens.sum(1)
            name = self._token_array(arr("token_grads"), length)
            rows[name] = tokens.detach().reshape(size, -1).to(self.dtype).cpu().numpy()
        else:
            phi = self._features(batch, self._exp_model_id)
        check_finite_rows({"target features": phi}, idx, batch, "score")
        rows[arr("grads")] = phi.detach().to(self.dtype).cpu().numpy()
        self.store.write_rows(idx, rows, done=arr("done"), background=True)
        self._exp_done[idx] = True

    def _token_array(self, name: str, length: int) -> str:
        """The ``[m, T * k]`` per-token target features ``name`` (made on first use)."""
        width = length * self.proj_dim
        if self.store.has(name):
            stored = int(self.store.array(name).shape[1]) // self.proj_dim
            if stored != length:
                raise ValueError(
                    f"per-token targets of experiment {self._exp!r} have {stored} tokens, this "
                    f"batch has {length}; pad every target to the same length."
                )
        self.store.require_array(
            name,
            (self._exp_num_targets, width),
            self._np_dtype,
            chunk_rows=default_chunk_rows((width,), np.dtype(self._np_dtype)),
        )
        return name

    def score_loader(self, loader: Iterable[Any], *, batch_size: int = 16) -> None:
        """Score every batch of ``loader`` in order (inputs, sharding: see ``featurize_loader``)."""
        if self._exp_done is None or self._exp_owned is None:
            raise ModelIDException(
                "no scoring checkpoint; call traker.start_scoring_checkpoint(...) before "
                "score_loader."
            )
        self._last_ind_target = self._run_loader(
            as_loader(loader, self.task, batch_size),
            self.score,
            self._exp_done,
            self._exp_owned,
            self._last_ind_target,
            f"scoring targets ({self._exp})",
        )
        self.store.flush()

    def _scoring_inputs(
        self, exp_name: str, model_ids: Iterable[int] | None, allow_skip: bool
    ) -> tuple[dict[str, Any], list[int], list[CheckpointGrads]]:
        """The experiment's record, the usable model ids and their scoring inputs."""
        # Every rank's target features must be on disk before anyone reads them.
        self.store.flush()
        barrier()
        rec_path = self.save_dir / layout.experiment_record(exp_name)
        if not rec_path.exists():
            raise ValueError(
                f"experiment {exp_name!r} does not exist in `{self.save_dir}`; start it with "
                "start_scoring_checkpoint(...) and score targets first."
            )
        experiment = read_record(rec_path)
        ids = self.model_ids if model_ids is None else [int(i) for i in model_ids]
        require_same_across_ranks("(exp_name, model ids) to score", (exp_name, ids))
        if not ids:
            raise ModelIDException(f"no model ids to score in `{self.save_dir}`.")
        ckpts: list[CheckpointGrads] = []
        used: list[int] = []
        for model_id in ids:
            record = self._ckpt_record(model_id)
            target = functools.partial(layout.target_array, exp_name, model_id)
            problem = None
            if not record.get("finalized"):
                problem = f"model id {model_id} is not finalized (call finalize_features)"
            elif not self.store.has(target("done")):
                problem = f"model id {model_id} has no target features for {exp_name!r}"
            elif not self.store.done_rows(target("done")).all():
                problem = f"model id {model_id} has targets of {exp_name!r} not scored yet"
            if problem is not None:
                if allow_skip:
                    self.logger.warning("%s; skipping it.", problem)
                    continue
                raise ModelIDException(problem + "; or pass allow_skip=True.")
            arr = functools.partial(layout.checkpoint_array, model_id)
            self._require_intact_targets(exp_name, model_id)
            self._require_intact_rows(model_id)
            used.append(model_id)
            targets = self.store.array(target("grads"))
            out_to_loss = self.store.array(arr("out_to_loss"))
            if record.get("features"):
                # TRAK's del_grads: the rows hold X (XᵀX + λI)⁻¹ already.
                ckpts.append(
                    CheckpointGrads(
                        self.store.array(arr("features")), targets, out_to_loss, preconditioned=True
                    )
                )
                continue
            precond = self._load_preconditioner(model_id, record)
            ckpts.append(
                precond.checkpoint_grads(self.stored_features(model_id), targets, out_to_loss)
            )
        if not ckpts:
            raise ModelIDException(
                f"every model id was skipped for {exp_name!r}; nothing to score."
            )
        return experiment, used, ckpts

    def finalize_scores(
        self,
        exp_name: str,
        model_ids: Iterable[int] | None = None,
        allow_skip: bool = False,
        *,
        per_token: bool = False,
    ) -> Any:
        """Ensemble the checkpoints' scores for experiment ``exp_name``.

        Args:
            exp_name: the experiment.
            model_ids: checkpoints to ensemble (default: all featurized).
            allow_skip: skip checkpoints not finalized or not scored.
            per_token: scores of each target token (the experiment was started
                with ``per_token=True``): ``[n, m, T]``, summing over ``T`` to
                the ``[n, m]`` scores. Computed in memory and not saved.

        Returns:
            ``[train_set_size, num_targets]`` float32 scores: a numpy array, or
            (when it exceeds ``memory_budget``) the zarr array
            ``save_dir/scores/<exp_name>`` on disk. Both are also saved there.
        """
        experiment, used, ckpts = self._scoring_inputs(exp_name, model_ids, allow_skip)
        num_targets = int(experiment["num_targets"])
        if per_token:
            return self._per_token_scores(exp_name, experiment, used, ckpts)
        n, m = self.train_set_size, num_targets
        scores = ensemble_scores(
            ckpts,
            self.lambda_reg,
            self.memory_budget,
            path=self.save_dir / layout.scores_array(exp_name),
            copy_to=lambda: self.store.require_array(
                layout.scores_array(exp_name), (n, m), np.float32
            ),
            score_computer=self.score_computer,
            precision=self.precision,
            device=self.device,
            progress=self.progress,
        )
        rank, _ = rank_and_world()
        if rank == 0:
            scores_json = self.save_dir / layout.scores_record(exp_name)
            scores_json.parent.mkdir(exist_ok=True)
            scores_json.write_text(
                json.dumps(
                    {
                        "model_ids": [int(i) for i in used],
                        "num_targets": m,
                        "method": self.method,
                        "lambda_reg": self.lambda_reg,
                    }
                )
                + "\n"
            )
        barrier()
        self.scores = scores
        return scores

    def _per_token_scores(
        self,
        exp_name: str,
        experiment: Mapping[str, Any],
        model_ids: Sequence[int],
        ckpts: Sequence[CheckpointGrads],
    ) -> np.ndarray:
        """``[n, m, T]`` scores of each target token (targets' token features in memory)."""
        if not experiment.get("per_token"):
            raise ValueError(
                f"experiment {exp_name!r} was not started with per_token=True; start a new one "
                "with start_scoring_checkpoint(..., per_token=True) to get per-token scores."
            )
        n, m = self.train_set_size, int(experiment["num_targets"])
        if self.memory_budget is not None and 4 * n * m > self.memory_budget:
            raise ValueError(
                f"per-token scores need at least {4 * n * m} bytes but `memory_budget`="
                f"{self.memory_budget}; score fewer targets per experiment."
            )
        # Under torch.distributed each rank scores its column shard of the targets.
        rank, world = rank_and_world()
        cols = column_shard(m) if world > 1 else range(m)
        tokens = []
        for model_id in model_ids:
            # The targets' rows: [m, T * k] stored, [m * T, k] for the kernel.
            name = layout.target_array(exp_name, model_id, "token_grads")
            wide = np.float64 if self.dtype == torch.float64 else np.float32
            stored = self.store.array(name)
            length = int(stored.shape[1]) // self.proj_dim
            rows = np.asarray(stored[cols.start : cols.stop], dtype=wide)
            tokens.append(rows.reshape(len(cols) * length, self.proj_dim))
        if len(cols):
            per_token = [
                dataclasses.replace(ck, targets=torch.from_numpy(t)) for ck, t in zip(ckpts, tokens)
            ]
            local = score_checkpoints(
                per_token,
                self.lambda_reg,
                self.memory_budget,
                precision=self.precision,
                device=self.device,
                progress=self.progress and rank == 0,
            )
            local = torch.as_tensor(np.asarray(local)).reshape(n, len(cols), length)
        else:
            local = torch.zeros(n, 0, length)
        if world == 1:
            return local.numpy()
        # [n, m_r, T] -> [n T, m_r] columns, gathered -> [n, m, T] (bits copied).
        flat = local.permute(0, 2, 1).reshape(n * length, len(cols))
        whole = all_gather_columns(flat, m).reshape(n, length, m).permute(0, 2, 1)
        return whole.contiguous().numpy()

    def topk(
        self,
        exp_name: str,
        k: int,
        model_ids: Iterable[int] | None = None,
        allow_skip: bool = False,
    ) -> TopK:
        """The ``k`` top proponents and opponents of each target of ``exp_name``.

        Streams the score tiles of :meth:`finalize_scores` (sized by
        ``memory_budget``) into running top-k lists: the ``[n, m]`` score
        matrix is never formed, memory is ``O((block + k) * m)``.

        Under ``torch.distributed`` each rank streams the targets of its
        :func:`~gradsketch.attribution.column_shard` and the ``[k, m]`` lists
        are gathered: every rank returns the whole result.

        Returns:
            :class:`~gradsketch.attribution.TopK` with ``[k, m]`` training-row
            indices and scores (proponents highest first, opponents lowest first).
        """
        positive_int("k", k, fix="pass the number of proponents to keep per target")
        _, _, ckpts = self._scoring_inputs(exp_name, model_ids, allow_skip)
        m = int(ckpts[0].targets.shape[0])
        rank, world = rank_and_world()
        cols = column_shard(m) if world > 1 else range(m)
        if len(cols) == 0:
            kk = min(int(k), self.train_set_size)
            idx, val = torch.zeros(kk, 0, dtype=torch.int64), torch.zeros(kk, 0)
            local = TopK(idx, val, idx.clone(), val.clone())
        else:
            local = topk_checkpoints(
                ckpts if world == 1 else shard_checkpoint_targets(ckpts, cols),
                k,
                self.lambda_reg,
                self.memory_budget,
                device=self.device,
                progress=self.progress and rank == 0,
            )
        if world == 1:
            return local
        parts = (local.proponents, local.proponent_scores, local.opponents, local.opponent_scores)
        return TopK(*(all_gather_columns(t, m) for t in parts))
