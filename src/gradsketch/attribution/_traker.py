"""TRAKer: TRAK's front end, one flow for every attribution method.

The flow (load a checkpoint, featurize, finalize, score, ensemble, top-k,
per-token scores, resume, ``memory_budget``, ``torchrun`` sharding) is
written once, here; what a method computes at each step is a method object
it holds: :class:`~gradsketch.attribution._traker_method.FeatureMethod`
(TRAK, identity, K-FAC, EK-FAC, registered preconditioners) or
:class:`~gradsketch.attribution._replay_traker.ReplayMethod` (exact
metagradients through training). The store's records are
:class:`~gradsketch.attribution._traker_records.TRAKRecords`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from gradsketch._checks import positive_int
from gradsketch._store import RowStore, default_chunk_rows
from gradsketch.attribution import _layout as layout
from gradsketch.attribution._distributed import (
    all_gather_columns,
    barrier,
    column_shard,
    owned_mask,
    rank_and_world,
    rank_zero_first,
    require_same_across_ranks,
    shard_checkpoint_targets,
)
from gradsketch.attribution._gradient_computers import FunctionalGradientComputer
from gradsketch.attribution._integrity import check_finite_rows, check_weights
from gradsketch.attribution._kfac import LAYER_AUTO_DAMPING_FRACTION
from gradsketch.attribution._kronecker_features import CURVATURES
from gradsketch.attribution._lm_data import as_loader, check_token_batch
from gradsketch.attribution._lm_params import select_parameters
from gradsketch.attribution._modelout import AbstractModelOutput, resolve_task
from gradsketch.attribution._plan import (
    AttributionPlan,
    cache_refusal,
    choose_rows,
    model_plan,
    plan_first_batch,
    plan_per_token,
    refuse_on_any_rank,
    stored_row_bytes,
    traker_plan,
    warn_finalize,
    with_cache,
)
from gradsketch.attribution._preconditioners import CurvaturePreconditioner, resolve_method
from gradsketch.attribution._projection_default import default_projection, given_projection
from gradsketch.attribution._replay import ReplayAttributor
from gradsketch.attribution._replay_traker import ReplayMethod, replay_device, replay_settings
from gradsketch.attribution._score_cache import ScoringCache
from gradsketch.attribution._scores import (
    MEMORY_BUDGET_FIX,
    CheckpointGrads,
    ensemble_scores,
    score_dtype,
)
from gradsketch.attribution._topk import TopK, topk_checkpoints
from gradsketch.attribution._traker_arguments import checked_damping, refuse_unused
from gradsketch.attribution._traker_features import FeatureMaker, storage_dtype
from gradsketch.attribution._traker_inputs import (
    batch_rows,
    check_per_token,
    run_loader,
    select_rows,
)
from gradsketch.attribution._traker_method import FeatureMethod
from gradsketch.attribution._traker_recompute import check_rows
from gradsketch.attribution._traker_records import (
    TRAKRecords,
    TRAKSettings,
    checkpoint_fingerprint,
    model_fingerprint,
)
from gradsketch.attribution._traker_tokens import per_token_scores
from gradsketch.attribution._vocab_layers import default_layer_parameters
from gradsketch.errors import ModelIDException
from gradsketch.masked import MaskLike

#: trak's message for featurizing before load_checkpoint (its users match it); ours follows.
_TRAK_NO_CHECKPOINT = "Load a checkpoint using traker.load_checkpoint before featurizing"

#: Constructor arguments handed to the FeatureMaker as they are.
_MAKER_ARGUMENTS = (
    "curvature",
    "projector",
    "projection",
    "proj_dim",
    "proj_max_batch_size",
    "mask",
    "gradient_computer",
)

__all__ = [
    "TRAKer",
    "ReplayTRAKer",
    "TRAKSettings",
    "ModelIDException",
    "checkpoint_fingerprint",
    "model_fingerprint",
]


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
        method: the preconditioner (:data:`CURVATURE_PRECONDITIONERS`): ``"trak"``
            (default: XᵀX of the projected gradients), ``"identity"``,
            ``"kfac"``, ``"ekfac"`` (per-layer Kronecker curvature of every
            Linear / Conv2d / ``Conv1D`` layer; ``lambda_reg`` is the damping,
            ``"auto"`` 0.3 of each layer's mean eigenvalue), or one
            registered with :func:`register_curvature_preconditioner`. Every method
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
            per-layer gradients. ``"auto"`` (default): exact, unless the exact
            rows would not fit the free disk and ``rows="auto"``; then
            ``(16, 16)`` per layer, logged
            (:mod:`~gradsketch.attribution._projection_default`).
        sample_seed: seed of ``curvature="sampled"`` (default: ``projector_seed``).
        dtype: storage dtype of the features (default: float16 on CUDA for
            TRAK, else float32; per-layer methods also take float64).
        replay: with ``method="replay"``, the run to replay: a
            :class:`~gradsketch.attribution.ReplaySettings` or a
            :class:`~gradsketch.attribution.ReplayAttributor`. The same calls,
            records and store then give exact metagradients through training
            (MAGIC); see :mod:`gradsketch.attribution._replay_traker`.
        damping_fraction: per-layer methods with ``lambda_reg="auto"``: the
            damping is this fraction of each layer's mean eigenvalue (0.3,
            chosen by LDS in benchmarks/RESULTS.md; Kronfluence's heuristic is
            0.1). Recorded with each score matrix, as ``lambda_reg`` is.
        rows: ``"stored"`` keeps each training document's row on disk;
            ``"recompute"`` keeps only the curvature (factors, eigenbases,
            corrections, XᵀX) and Q, and recomputes the training gradients
            while scoring, from the (re-iterable) loader given to
            :meth:`featurize_loader` and the weights given to
            :meth:`load_checkpoint` / :meth:`start_scoring_checkpoint`, kept by
            reference (:mod:`~gradsketch.attribution._traker_recompute`);
            ``"auto"`` (default): stored unless the rows would not fit the
            free disk (:func:`~gradsketch.attribution._plan.choose_rows`, logged).

    Scale is planned (:attr:`plan`, :mod:`~gradsketch.attribution._plan`): logged
    before featurizing, refused up front where it does not fit. Per-layer
    methods leave a vocabulary-sized LM head out of the curvature by default
    (:mod:`~gradsketch.attribution._vocab_layers`).

    Arguments a method cannot use are refused with the method, the argument
    and the fix (:data:`~gradsketch.attribution.ARGUMENT_REFUSALS`).

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
        >>> for rows in (slice(0, 8), slice(8, 12)):
        ...     traker.featurize((x[rows], y[rows]), inds=range(12)[rows])
        >>> traker.finalize_features()
        >>> traker.start_scoring_checkpoint("test", model.state_dict(), model_id=0, num_targets=2)
        >>> traker.score_loader([(x[:2], y[:2])])
        >>> scores = traker.finalize_scores("test")
        >>> scores.shape, traker.topk("test", k=3).proponents.shape
        ((12, 2), torch.Size([3, 2]))

    The same calls serve ``method="ekfac"`` (and every per-layer method) and
    ``method="replay"`` (with ``replay=ReplaySettings(...)``).
    """

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
        projection: tuple[int, int] | str | None = "auto",
        sample_seed: int | None = None,
        dtype: torch.dtype | None = None,
        replay: Any = None,
        damping_fraction: float = LAYER_AUTO_DAMPING_FRACTION,
        rows: str = "auto",
    ) -> None:
        # Every argument as given, before another local exists: the refusal table reads them.
        given = dict(locals())
        del given["self"]
        self.logger = logging.getLogger("gradsketch.attribution.TRAKer")
        self.logger.setLevel(logging_level)
        self.method = method
        precond_cls = None if method == "replay" else resolve_method(method)
        if precond_cls is None:
            self._kind = "replay"
        else:
            self._kind = "per-layer" if precond_cls.features == "layers" else "projected"
            if curvature not in CURVATURES:
                raise ValueError(
                    f"`curvature` must be one of {list(CURVATURES)}, got {curvature!r}."
                )
        refuse_unused(method, self._kind, given, _defaults())
        self.rows = check_rows(rows)
        positive_int("memory_budget", memory_budget, optional=True, fix=MEMORY_BUDGET_FIX)
        if not isinstance(model, nn.Module):
            raise TypeError(f"`model` must be a torch.nn.Module, got {type(model).__name__}.")
        self.model = model
        self.task = resolve_task(task)
        positive_int("train_set_size", train_set_size)
        self.train_set_size = int(train_set_size)
        self.memory_budget = memory_budget
        self.precision = precision
        self.progress = bool(progress)
        self.load_from_save_dir = bool(load_from_save_dir)
        self.save_dir = Path(save_dir).resolve()
        self._method: FeatureMethod | ReplayMethod
        if precond_cls is None:
            self._init_replay(replay, device)
        else:
            self._init_features(precond_cls, given)
        self.proj_dim = self._method.width
        self.dtype = self._method.dtype
        self.lambda_reg = self._method.lambda_reg
        self.score_computer = self._method.score_computer
        self.ckpt_loaded: int | None = None
        self._last_ind = 0
        self._exp: str | None = None
        self._exp_model_id: int | None = None
        self._exp_num_targets = 0
        self._exp_done: np.ndarray | None = None
        self._exp_owned: np.ndarray | None = None
        self._exp_per_token = False
        self._last_ind_target = 0
        self._cleared: set[str] = set()
        self.scores: Any = None
        self._plan_batch_pending = True

    # -- set-up ----------------------------------------------------------------------
    def _init_features(self, precond_cls: type[CurvaturePreconditioner], a: dict[str, Any]) -> None:
        """Stored features and a preconditioner (``a``: the constructor's arguments)."""
        layered = self._kind == "per-layer"
        method, model = self.method, self.model
        device = a["device"]
        self.device = torch.device(
            device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
        )
        dtype = storage_dtype(layered, method, self.device, a["dtype"], a["use_half_precision"])
        lambda_reg, self.damping_fraction = checked_damping(
            a["lambda_reg"], a["damping_fraction"], method, layered, self.logger
        )
        self.grad_wrt = select_parameters(model, a["grad_wrt"], a["mask"])
        chosen = (a["grad_wrt"], a["mask"], given_projection(a["projection"]), a["projector"])
        if layered and all(x is None for x in chosen):
            self.grad_wrt = default_layer_parameters(model, self.grad_wrt, self.logger)
        projection = a["projection"]
        if not layered or a["projector"] is not None:
            projection = given_projection(projection)
        a["projection"] = default_projection(  # LoGra where exact rows do not fit the disk
            projection,
            model=model,
            grad_wrt=self.grad_wrt,
            train_set_size=self.train_set_size,
            itemsize=dtype.itemsize,
            sampled=a["curvature"] == "sampled",
            rows=self.rows,
            save_dir=self.save_dir,
            logger=self.logger,
        )
        self.proj_seed = a["projector_seed"]
        sample_seed = a["sample_seed"]
        self.sample_seed = self.proj_seed if sample_seed is None else int(sample_seed)
        curvature = a["curvature"]
        maker = FeatureMaker(
            model,
            self.task,
            method=method,
            layered=layered,
            device=self.device,
            dtype=dtype,
            grad_wrt=self.grad_wrt,
            seed=self.proj_seed,
            sample_seed=self.sample_seed,
            logger=self.logger,
            **{name: a[name] for name in _MAKER_ARGUMENTS},
        )
        self._device_problem = maker.device_problem
        self.featurizer = maker.featurizer
        self.gradient_computer = maker.gradient_computer
        self.projector = maker.projector
        self.projection = maker.projection
        self.layers = maker.layers
        self.grad_dim = maker.grad_dim
        self.normalize_factor = maker.normalize_factor
        # The model's part of the plan, before the store is made: nothing large is allocated
        # yet (per-layer factors are allocated lazily), and a refused run leaves no settings.
        self._plan = model_plan(self, maker, curvature)
        refuse_on_any_rank(self._plan, layered)  # each rank's share of the machine's memory
        computer = a["score_computer"]
        if computer is not None and self.rows == "recompute":
            raise ValueError(
                "`score_computer` multiplies stored rows in memory, but rows='recompute' stores "
                "none; pass score_computer=None, or rows='stored'."
            )
        rows_bytes = stored_row_bytes(maker, curvature == "sampled")
        rows = "stored" if computer is not None else self.rows
        self.rows = choose_rows(rows, self._plan, rows_bytes, self.save_dir, self.logger)
        if self.rows == "recompute":  # TRAK's Gram is then summed while featurizing
            self._plan = dataclasses.replace(self._plan, curvature_at_finalize=False)
            refuse_on_any_rank(self._plan, layered)
        warn_finalize(self._plan, layered, self.logger)
        if computer is not None:
            computer = computer(
                dtype=dtype,
                device=self.device,
                logging_level=self.logger.level,
                lambda_reg=lambda_reg,
            )
        self.settings = TRAKSettings(
            train_set_size=self.train_set_size,
            proj_dim=maker.proj_dim,
            projector=maker.projector_record(),
            model=model_fingerprint(model),
            task=type(self.task).__name__,
            grad_wrt=self.grad_wrt,
            dtype=str(dtype).removeprefix("torch."),
            normalize=maker.normalize_factor,
            method=method,
            curvature=curvature,
            sample_seed=self.sample_seed if curvature == "sampled" else 0,
            layers=[x.name for x in maker.layers],
            rows=self.rows,
        )
        self.records = TRAKRecords(self.save_dir, self.settings, self.logger)
        positive_int(
            "chunk_rows", a["chunk_rows"], optional=True, fix="pass None for ~1 MiB chunks"
        )
        self._method = FeatureMethod(
            method,
            precond_cls,
            maker,
            self.records,
            self.train_set_size,
            lambda_reg=lambda_reg,
            curvature=curvature,
            score_computer=computer,
            chunk_rows=a["chunk_rows"],
            memory_budget=self.memory_budget,
            load_from_save_dir=self.load_from_save_dir,
            progress=self.progress,
            logger=self.logger,
            damping_fraction=self.damping_fraction,
            rows=self.rows,
        )
        self._method.score_cache = ScoringCache(
            lambda held, extra: cache_refusal(self._plan, self.memory_budget, held, extra),
            self.logger,
        )

    @property
    def plan(self) -> AttributionPlan:
        """The run's :class:`AttributionPlan` (from the model; from the first batch once seen)."""
        return with_cache(self._plan, self._method)

    def _init_replay(self, replay: Any, device: Any) -> None:
        """Exact metagradients through the replayed run ``replay``."""
        self.rows = "stored"  # the replay keeps its own rows
        settings = replay_settings(replay)
        self.device = replay_device(self.model, device)
        n = self.train_set_size
        self.grad_wrt = None
        self._device_problem = None
        self.featurizer = self.gradient_computer = self.projector = self.projection = None
        self.layers = []
        self.grad_dim, self.normalize_factor = n, 1.0
        self.settings = TRAKSettings(
            train_set_size=n,
            proj_dim=n,
            model=model_fingerprint(self.model),
            task=type(self.task).__name__,
            dtype="float64",
            method="replay",
            replay=settings.record(),
        )
        self.records = TRAKRecords(self.save_dir, self.settings, self.logger)
        self._method = ReplayMethod(
            self.model,
            self.task,
            replay,
            self.records,
            n,
            memory_budget=self.memory_budget,
            load_from_save_dir=self.load_from_save_dir,
            progress=self.progress,
            logger=self.logger,
        )
        self.replay_settings = settings
        self.damping_fraction = LAYER_AUTO_DAMPING_FRACTION
        self._plan = traker_plan(self)

    @property
    def store(self) -> RowStore:
        """The zarr row store under ``save_dir``."""
        return self.records.store

    @property
    def model_ids(self) -> list[int]:
        """Checkpoints present in the store."""
        return self.records.model_ids

    @property
    def attributor(self) -> ReplayAttributor:
        """``method="replay"``: the run's :class:`ReplayAttributor` (after finalize_features)."""
        if not isinstance(self._method, ReplayMethod):
            raise ValueError(
                f"`attributor` is the replayed run of method='replay', but method="
                f"{self.method!r}; construct the TRAKer with method='replay' and `replay`."
            )
        return self._method.attributor

    # -- featurizing -----------------------------------------------------------------
    def load_checkpoint(self, checkpoint: Mapping[str, Any], model_id: int) -> None:
        """Load a checkpoint for featurizing; resumes rows already stored for ``model_id``.

        ``method="replay"``: the weights the run starts from (one run, one model id).

        Raises:
            SettingsMismatchError: ``model_id`` was featurized from other weights.
            ModelIDException: ``method="replay"`` and the store holds another model id.
        """
        self._method.pause()  # the previous checkpoint's statistics, before they are replaced
        check_weights(checkpoint, model_id)
        sha = checkpoint_fingerprint(checkpoint)
        require_same_across_ranks("(model_id, checkpoint fingerprint)", (int(model_id), sha))
        self._method.load_checkpoint(checkpoint, int(model_id), sha)
        self.ckpt_loaded = int(model_id)
        self._last_ind = 0

    def featurize(
        self, batch: Sequence[Tensor], inds: Any = None, num_samples: int | None = None
    ) -> None:
        """Compute and store the rows of a batch of training examples.

        TRAK's features are ``P grad f / sqrt(d)``; the per-layer methods store
        each factored layer's gradient and fit their curvature from the same
        pass; the replay keeps the rows it trains on. Rows already stored (from
        an interrupted run) are skipped: their gradients are not recomputed,
        and rows already in the stored curvature statistics are not added
        twice (both resume independently).

        Args:
            batch: tuple of ``[B, ...]`` tensors, as the task expects, or (for
                the Hugging Face tasks) a dict such as a tokenizer returns.
            inds: ``[B]`` row indices in the training set.
            num_samples: ``B``, when rows follow the previous batch.
        """
        if self.ckpt_loaded is None:
            raise ModelIDException(
                f"{_TRAK_NO_CHECKPOINT}: no checkpoint loaded; call "
                "traker.load_checkpoint(state_dict, model_id) before featurize."
            )
        rows, idx = self._rows_of(batch, inds, num_samples, "featurize")
        if self._plan_batch_pending:  # the first batch with rows to do: planned, then timed
            with plan_first_batch(self, rows, idx) as plan:
                self._method.featurize(rows, idx)
            if plan is not None:
                self._plan, self._plan_batch_pending = plan.done(), False
            return
        self._method.featurize(rows, idx)

    def _rows_of(
        self, batch: Any, inds: Any, num_samples: int | None, what: str
    ) -> tuple[tuple[Tensor, ...], np.ndarray]:
        """A training (``what="featurize"``) or target (``"score"``) batch and its rows.

        ``num_samples`` rows follow the previous batch's of the same kind.
        """
        if self._device_problem is not None:  # refused where the devices would mix
            raise ValueError(self._device_problem)
        targets = what == "score"
        last = self._last_ind_target if targets else self._last_ind
        n = self._exp_num_targets if targets else self.train_set_size
        rows = batch_rows(self.task, batch, inds, num_samples, last, n, what, self.device)
        check_token_batch(self.task, self.model, rows[0], what)
        if num_samples is not None and targets:
            self._last_ind_target += int(num_samples)
        elif num_samples is not None:
            self._last_ind += int(num_samples)
        return rows

    def featurize_loader(self, loader: Iterable[Any], *, batch_size: int = 16) -> None:
        """Featurize every batch of ``loader`` in order, with a progress bar.

        ``loader`` yields tuple or dict batches, or is a ``datasets.Dataset``
        with the task's columns (read in order, ``batch_size`` rows at a time,
        ragged token columns right-padded and masked).

        Under ``torch.distributed``, an in-order map-style ``DataLoader`` is
        re-batched over this rank's rows still to do, so each rank loads only
        the examples it featurizes; other iterables are read in full and each
        rank keeps its own rows.

        ``rows="recompute"``: ``loader`` is kept (it must be re-iterable) and
        read again by ``finalize_features`` and the scoring.
        """
        if isinstance(self._method, FeatureMethod):
            self._method.keep_loader(loader, self._last_ind, batch_size)
        self._feed(loader, batch_size, targets=False)

    def _feed(self, loader: Iterable[Any], batch_size: int, targets: bool) -> None:
        """Feed ``loader`` in order to :meth:`score` (``targets``) or to :meth:`featurize`."""
        if targets:
            step, first, call = self.score, self._last_ind_target, "start_scoring_checkpoint(...)"
            done, owned, desc = self._exp_done, self._exp_owned, f"scoring targets ({self._exp})"
        else:
            step, first = self.featurize, self._last_ind
            call = "load_checkpoint(state_dict, model_id)"
            done, owned = self._method.done, self._method.owned
            desc = f"featurizing model {self.ckpt_loaded}"
        if done is None or owned is None or (not targets and self.ckpt_loaded is None):
            what = "scoring checkpoint" if targets else "checkpoint loaded"
            loop = "score_loader" if targets else "featurize_loader"
            trak = "" if targets else f"{_TRAK_NO_CHECKPOINT}: "
            raise ModelIDException(f"{trak}no {what}; call traker.{call} before {loop}.")
        data = as_loader(loader, self.task, batch_size)
        last = run_loader(self.task, data, step, done, owned, first, desc, self.progress)
        if targets:
            self._last_ind_target = last
        else:
            self._last_ind = last
            self._method.pause()
        self.store.flush()

    def finalize_features(
        self, model_ids: Iterable[int] | None = None, del_grads: bool = False
    ) -> None:
        """Fit each checkpoint's preconditioner from its stored rows and mark it final.

        TRAK computes XᵀX (streamed in row blocks, summed across ranks); K-FAC
        eigendecomposes its factors; EK-FAC also corrects the eigenvalues in
        one pass over the stored rows; the replay trains its run. The
        ``[n, k]`` features ``X (XᵀX + λI)⁻¹`` are only formed when
        ``del_grads=True`` (TRAK only; then they replace the gradients);
        otherwise the preconditioner is applied to the targets at scoring
        time, which is cheaper. ``rows="recompute"``: the statistics were summed while
        featurizing; passes over rows (EK-FAC's correction) recompute them from the loader.
        """
        refuse_unused(self.method, self._kind, {"del_grads": del_grads}, {"del_grads": False})
        if del_grads and self.rows == "recompute":
            raise ValueError("`del_grads`=True deletes stored rows; rows='recompute' has none.")
        ids = self.model_ids if model_ids is None else [int(i) for i in model_ids]
        require_same_across_ranks("the model ids to finalize", ids)
        if self._kind != "replay":  # TRAK's Gram is formed here: refused before it is
            refuse_on_any_rank(self.plan, self._kind == "per-layer", stage="finalize")
        self._method.finalize(ids, bool(del_grads))

    def preconditioner(self, model_id: int) -> CurvaturePreconditioner:
        """The finalized preconditioner of checkpoint ``model_id``, read from the store.

        ``traker.preconditioner(0).solve(targets)`` is ``P⁻¹`` applied to
        ``[m, k]`` target features, as scoring applies it.

        Raises:
            ModelIDException: ``model_id`` is not finalized.
        """
        precond: CurvaturePreconditioner = self._method.preconditioner(model_id)
        return precond

    def stored_features(self, model_id: int, name: str = "grads") -> Any:
        """The stored ``[n, k]`` training features of checkpoint ``model_id``, as an array.

        Per-layer methods keep each layer's ``[a, g]`` where every layer sees one
        position per example; the returned view then expands ``vec(g aᵀ)`` as
        row slices are read (``view[i:j]``, a numpy array). ``name="fisher_grads"``:
        the features under sampled labels (``curvature="sampled"``). ``rows="recompute"``:
        an array whose row slices are computed from the loader when read.
        """
        return self._method.stored_features(model_id, name)

    # -- scoring ---------------------------------------------------------------------
    def start_scoring_checkpoint(
        self,
        exp_name: str,
        checkpoint: Mapping[str, Any],
        model_id: int,
        num_targets: int,
        *,
        per_token: bool = False,
    ) -> None:
        """Load ``checkpoint`` to compute target rows of experiment ``exp_name``.

        Args:
            exp_name: the experiment's name.
            checkpoint: the state dict of checkpoint ``model_id`` (featurized
                before; ``method="replay"``: the run's starting checkpoint, the
                queries being scored at the parameters trained from it).
            model_id: the checkpoint's id.
            num_targets: number of targets m.
            per_token: also keep one row per target token, for
                :meth:`finalize_scores` with ``per_token=True`` (tasks with a
                ``per_token_batch``, as ``"language_modeling"``; each target
                costs ``T`` per-example gradients).

        Raises:
            SettingsMismatchError: ``exp_name`` exists with another ``num_targets``
                or ``per_token``.
        """
        self._method.pause()
        if not exp_name or "/" in exp_name:
            raise ValueError(f"`exp_name` must be a non-empty name without '/', got {exp_name!r}.")
        positive_int("num_targets", num_targets)
        check_weights(checkpoint, model_id)
        check_per_token(self.task, per_token)
        require_same_across_ranks(
            "(exp_name, model_id, num_targets, checkpoint fingerprint)",
            (exp_name, int(model_id), num_targets, checkpoint_fingerprint(checkpoint)),
        )
        arr = functools.partial(layout.target_array, exp_name, model_id)
        method = self._method
        with rank_zero_first() as first:
            self.records.open_experiment(exp_name, num_targets, per_token)
            targets = self.store.require_array(
                arr("grads"),
                (num_targets, self.proj_dim),
                method.np_dtype,
                chunk_rows=method.dense_chunk_rows,
            )
            self.store.require_done(arr("done"), num_targets, chunk_rows=method.dense_chunk_rows)
            fresh = method.targets_follow_run and not self.load_from_save_dir
            if first and fresh and exp_name not in self._cleared:
                # Rows that depend on the whole run are recomputed once per session.
                self.store.array(arr("done"))[:] = np.zeros(num_targets, dtype=np.uint8)
                self._cleared.add(exp_name)
        self._exp_owned = owned_mask(num_targets, int(targets.chunks[0]))
        self._exp_done = self.store.done_rows(arr("done"))
        method.load_weights(checkpoint, int(model_id))
        self._exp, self._exp_model_id = exp_name, int(model_id)
        self._exp_num_targets = num_targets
        self._exp_per_token = bool(per_token)
        self._last_ind_target = 0

    def score(
        self, batch: Sequence[Tensor], inds: Any = None, num_samples: int | None = None
    ) -> None:
        """Compute and store the target rows of a batch (see :meth:`featurize`)."""
        if self._exp is None or self._exp_model_id is None or self._exp_done is None:
            raise ModelIDException(
                "no scoring checkpoint; call traker.start_scoring_checkpoint(...) before score."
            )
        batch, idx = self._rows_of(batch, inds, num_samples, "score")
        todo = ~self._exp_done[idx]
        if self._exp_owned is not None:
            todo &= self._exp_owned[idx]
        if not todo.any():
            return
        batch, idx = select_rows(batch, idx, todo)
        if self._exp_per_token:  # planned, and refused, before its B T rows are made
            self._plan = plan_per_token(self, batch)
        arr = functools.partial(layout.target_array, self._exp, self._exp_model_id)
        phi, tokens = self._method.target_rows(batch, self._exp_model_id, self._exp_per_token)
        rows: dict[str, np.ndarray] = {}
        if tokens is not None:
            name = self._token_array(arr("token_grads"), int(tokens.shape[1]))
            rows[name] = tokens.detach().reshape(idx.size, -1).to(self.dtype).cpu().numpy()
        check_finite_rows({"target features": phi}, idx, batch, "score")
        rows[arr("grads")] = phi.detach().to(self.dtype).cpu().numpy()
        self.store.write_rows(idx, rows, done=arr("done"), background=True)
        self._exp_done[idx] = True

    def _token_array(self, name: str, length: int) -> str:
        """The ``[m, T * k]`` per-token target rows ``name`` (made on first use)."""
        width = length * self.proj_dim
        if self.store.has(name):
            stored = int(self.store.array(name).shape[1]) // self.proj_dim
            if stored != length:
                raise ValueError(
                    f"per-token targets of experiment {self._exp!r} have {stored} tokens, this "
                    f"batch has {length}; pad every target to the same length."
                )
        np_dtype = self._method.np_dtype
        self.store.require_array(
            name,
            (self._exp_num_targets, width),
            np_dtype,
            chunk_rows=default_chunk_rows((width,), np.dtype(np_dtype)),
        )
        return name

    def score_loader(self, loader: Iterable[Any], *, batch_size: int = 16) -> None:
        """Score every batch of ``loader`` in order (inputs, sharding: see ``featurize_loader``)."""
        self._feed(loader, batch_size, targets=True)

    def _scoring_inputs(
        self, exp_name: str, model_ids: Iterable[int] | None, allow_skip: bool
    ) -> tuple[dict[str, Any], list[int], list[CheckpointGrads]]:
        """The experiment's record, the usable model ids and their scoring inputs."""
        # Every rank's target rows must be on disk before anyone reads them.
        self.store.flush()
        barrier()
        experiment = self.records.experiment(exp_name)
        ids = self.model_ids if model_ids is None else [int(i) for i in model_ids]
        require_same_across_ranks("(exp_name, model ids) to score", (exp_name, ids))
        if not ids:
            raise ModelIDException(f"no model ids to score in `{self.save_dir}`.")
        ckpts: list[CheckpointGrads] = []
        used: list[int] = []
        for model_id in ids:
            record = self.records.checkpoint(model_id)
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
            self.records.require_intact_targets(exp_name, model_id)
            self.records.require_intact_rows(model_id, self._method.row_arrays(model_id))
            used.append(model_id)
            targets = self.store.array(target("grads"))
            ckpts.append(self._method.checkpoint_grads(model_id, record, targets))
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
            ``[train_set_size, num_targets]`` scores (float32; float64 for
            ``method="replay"``): a numpy array, or (when it exceeds
            ``memory_budget``) the zarr array ``save_dir/scores/<exp_name>``
            on disk. Both are also saved there.
        """
        experiment, used, ckpts = self._scoring_inputs(exp_name, model_ids, allow_skip)
        if per_token:
            return per_token_scores(self, exp_name, experiment, used, ckpts)
        n, m = self.train_set_size, int(experiment["num_targets"])
        recompute = getattr(self._method, "recompute", None)
        if recompute is not None:
            scores = recompute.scores(exp_name, used, ckpts, **self._recompute_args())
        else:
            scores = ensemble_scores(
                ckpts,
                self.lambda_reg,
                self.memory_budget,
                path=self.save_dir / layout.scores_array(exp_name),
                copy_to=lambda: self.store.require_array(
                    layout.scores_array(exp_name), (n, m), score_dtype(ckpts)
                ),
                score_computer=self.score_computer,
                precision=self.precision,
                device=self.device,
                progress=self.progress,
            )
        if rank_and_world()[0] == 0:
            self.records.write_scores(
                exp_name,
                {
                    "model_ids": [int(i) for i in used],
                    "num_targets": m,
                    "method": self.method,
                    "lambda_reg": self.lambda_reg,
                    **self._damping_record(),
                },
            )
        barrier()
        self.scores = scores
        return scores

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
        _, used, ckpts = self._scoring_inputs(exp_name, model_ids, allow_skip)
        recompute = getattr(self._method, "recompute", None)
        if recompute is not None:  # the scores on disk (made, or resumed), read in blocks
            scores = recompute.scores(exp_name, used, ckpts, **self._recompute_args())
            return recompute.topk(scores, k, self.memory_budget)
        m = int(ckpts[0].targets.shape[0])
        rank, world = rank_and_world()
        cols = column_shard(m) if world > 1 else range(m)
        if len(cols) == 0:
            kk = min(int(k), self.train_set_size)
            idx = torch.zeros(kk, 0, dtype=torch.int64)
            val = torch.zeros(kk, 0, dtype=getattr(torch, score_dtype(ckpts)))
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

    def _recompute_args(self) -> dict[str, Any]:
        rank = rank_and_world()[0]
        return {
            "lambda_reg": self.lambda_reg,
            "memory_budget": self.memory_budget,
            "progress": self.progress and rank == 0,
        }

    def _damping_record(self) -> dict[str, float]:
        """``damping_fraction`` for the score record, where it applied and is not the default."""
        if self.lambda_reg != "auto" or self._kind != "per-layer":
            return {}
        if self.damping_fraction == LAYER_AUTO_DAMPING_FRACTION:
            return {}
        return {"damping_fraction": self.damping_fraction}

    # -- what tests of the per-layer methods reach into --------------------------------
    @property
    def _precond(self) -> CurvaturePreconditioner | None:
        """The accumulating preconditioner of the loaded checkpoint."""
        assert isinstance(self._method, FeatureMethod)
        return self._method.accumulated.precond

    def _save_accumulated(self) -> None:
        assert isinstance(self._method, FeatureMethod)
        self._method.accumulated.save()

    def _require_dense(self, model_id: int) -> None:
        assert isinstance(self._method, FeatureMethod)
        self._method.rows.require_dense(model_id)

    def _ckpt_record(self, model_id: int) -> dict[str, Any]:
        return self.records.checkpoint(model_id)

    def _write_ckpt_record(self, model_id: int, record: Mapping[str, Any]) -> None:
        self.records.write_checkpoint(model_id, record)


#: Deprecated alias (kept one release): the replay is ``TRAKer(..., method="replay")``,
#: the same class as every other method's.
ReplayTRAKer = TRAKer


def _defaults() -> dict[str, Any]:
    """TRAKer's arguments and their defaults (what the refusal table compares with)."""
    params = inspect.signature(TRAKer.__init__).parameters
    return {name: p.default for name, p in params.items() if name != "self"}
