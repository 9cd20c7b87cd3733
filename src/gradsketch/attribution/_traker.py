"""TRAKer: TRAK's front end on a resumable zarr store with memory-bounded scoring."""

from __future__ import annotations

import functools
import json
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from gradsketch._checks import positive_int
from gradsketch._hash import TensorDigest
from gradsketch._settings import SettingsMismatchError, read_record, write_record
from gradsketch._store import RowStore, default_chunk_rows
from gradsketch.attribution import _layout as layout
from gradsketch.attribution._distributed import (
    RowWindow,
    all_reduce_sum_,
    barrier,
    chunk_shard,
    owned_mask,
    rank_and_world,
    rank_zero_first,
    require_same_across_ranks,
    shard_loader,
    shardable_size,
)
from gradsketch.attribution._gradient_computers import (
    FunctionalGradientComputer,
)
from gradsketch.attribution._hook_computer import HookGradientComputer
from gradsketch.attribution._io import default_block_rows, rows_as_tensor
from gradsketch.attribution._linalg import damped_inverse, resolve_lambda, xtx_blocked
from gradsketch.attribution._lm_data import as_loader, as_task_batch
from gradsketch.attribution._lm_params import select_parameters
from gradsketch.attribution._modelout import AbstractModelOutput, resolve_task
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


def _refuse_per_token(per_token: bool, method: str) -> None:
    if per_token:
        raise ValueError(
            f"`per_token`=True needs method='trak'; method={method!r} scores whole targets."
        )


class ModelIDException(GradsketchError, RuntimeError):
    """A checkpoint (model id) is missing, incomplete or inconsistent (TRAK's name)."""


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
    """

    train_set_size: int
    proj_dim: int
    projector: dict[str, Any] = field(default_factory=dict)
    model: str = ""
    task: str = ""
    grad_wrt: list[str] | None = None
    dtype: str = "float32"
    normalize: float = 1.0

    def __post_init__(self) -> None:
        for name in ("train_set_size", "proj_dim"):
            value = getattr(self, name)
            positive_int(name, value)
        if self.dtype not in ("float16", "float32"):
            raise ValueError(f"`dtype` must be 'float16' or 'float32', got {self.dtype!r}.")


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
            on CPU, :class:`CudaProjector` on CUDA; with a
            :class:`HookGradientComputer` on CPU and no ``mask``,
            :meth:`FactorizedProjector.from_budget` of ``proj_dim``, so that no
            per-example gradient of a Linear / Conv2d layer is formed).
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
        lambda_reg: ridge damping λ >= 0, or ``"auto"``.
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
        method: ``"trak"`` (default), or ``"identity"``, ``"kfac"``, ``"ekfac"``:
            the same calls and store then run
            :class:`~gradsketch.attribution.InfluenceComputer` (``lambda_reg``
            is its damping; a :class:`FactorizedProjector` given as
            ``projector`` sets its per-layer projection).
        curvature: with an influence ``method``, ``"loss"`` (empirical
            Fisher), ``"output"`` or ``"sampled"`` (true Fisher, labels drawn
            from the model, seeded by ``projector_seed``); see
            :class:`~gradsketch.attribution.InfluenceComputer`. TRAK has no
            curvature choice: only ``"loss"`` is accepted with ``method="trak"``.

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
        lambda_reg: float | str = 0.0,
        *,
        memory_budget: int | None = None,
        mask: MaskLike | None = None,
        precision: str = "float32",
        progress: bool = True,
        chunk_rows: int | None = None,
        method: str = "trak",
        curvature: str = "loss",
    ) -> None:
        self.logger = logging.getLogger("gradsketch.attribution.TRAKer")
        self.logger.setLevel(logging_level)
        self.method = method
        self._influence: Any = None
        if method != "trak":
            from gradsketch.attribution._influence import make_influence

            self._influence = make_influence(
                method,
                model,
                task,
                train_set_size,
                save_dir,
                load_from_save_dir,
                device,
                projector,
                projector_seed,
                grad_wrt,
                lambda_reg,
                progress,
                chunk_rows,
                curvature,
            )
            self.save_dir = self._influence.save_dir
            return
        if curvature != "loss":
            raise ValueError(
                f"`curvature`={curvature!r} needs an influence method ('identity', 'kfac', "
                "'ekfac'); TRAK preconditions with its own Gram matrix. Pass method='ekfac' "
                "(or another influence method), or leave curvature='loss'."
            )
        if saver is not None:
            raise ValueError(
                f"`saver`={saver!r} is not supported: gradsketch stores features in a resumable "
                "zarr store under `save_dir`. Pass saver=None."
            )
        positive_int("memory_budget", memory_budget, optional=True, fix=MEMORY_BUDGET_FIX)
        self.model = model
        self.task = resolve_task(task)
        self.train_set_size = int(train_set_size)
        self.device = torch.device(
            device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
        )
        if use_half_precision is None:
            use_half_precision = self.device.type == "cuda"
        self.dtype = torch.float16 if use_half_precision else torch.float32
        self.lambda_reg = check_lambda(lambda_reg)
        self.memory_budget = memory_budget
        self.precision = precision
        self.progress = progress
        self.load_from_save_dir = bool(load_from_save_dir)
        self.grad_wrt = select_parameters(model, grad_wrt, mask)

        params = dict(model.named_parameters())
        self.num_params = sum(p.numel() for p in params.values())
        if self.grad_wrt is not None:
            self.num_params_for_grad = sum(params[n].numel() for n in self.grad_wrt)
        else:
            self.num_params_for_grad = self.num_params
        self.grad_dim = int(mask.numel) if mask is not None else self.num_params_for_grad
        self.proj_seed = projector_seed
        self._init_projector(projector, proj_dim, proj_max_batch_size, mask, gradient_computer)
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
            projector=_projector_record(self.projector, self.grad_dim),
            model=model_fingerprint(model),
            task=type(self.task).__name__,
            grad_wrt=self.grad_wrt,
            dtype=str(self.dtype).removeprefix("torch."),
            normalize=self.normalize_factor,
        )
        self.save_dir = Path(save_dir).resolve()
        # Rank 0 writes the settings record; the others then compare with it.
        with rank_zero_first():
            self.store = RowStore(self.save_dir, self.settings, what="TRAK store")
        positive_int("chunk_rows", chunk_rows, optional=True, fix="pass None for ~1 MiB chunks")
        self._chunk_rows = chunk_rows or default_chunk_rows(
            (self.proj_dim,), np.dtype(self._np_dtype)
        )
        self._owned: np.ndarray | None = None
        self._exp_owned: np.ndarray | None = None
        self.ckpt_loaded: int | None = None
        self._done: np.ndarray | None = None
        self._last_ind = 0
        self._exp: str | None = None
        self._exp_model_id: int | None = None
        self._exp_done: np.ndarray | None = None
        self._exp_per_token = False
        self._last_ind_target = 0
        self.scores: Any = None

    # -- set-up ----------------------------------------------------------------
    @property
    def _np_dtype(self) -> Any:
        return np.float16 if self.dtype == torch.float16 else np.float32

    def _init_projector(
        self,
        projector: Any,
        proj_dim: int,
        proj_max_batch_size: int,
        mask: MaskLike | None,
        gradient_computer: Any,
    ) -> None:
        if projector is None:
            projector = self._default_projector(
                proj_dim, proj_max_batch_size, mask, gradient_computer
            )
        self.projector = projector
        self.proj_dim = (
            self.grad_dim if isinstance(projector, NoOpProjector) else int(projector.proj_dim)
        )
        self.logger.info("Using %s", type(self.projector).__name__)

    def _default_projector(
        self, proj_dim: int, proj_max_batch_size: int, mask: MaskLike | None, gradient_computer: Any
    ) -> Any:
        """The projector used when none is given (see the class docstring)."""
        if self._wants_factorized(gradient_computer, mask):
            # Layer hooks never form a per-example gradient when the projector
            # is factorized: the fast CPU pair (features up to proj_dim).
            return FactorizedProjector.from_budget(
                self.model,
                proj_dim,
                seed=self.proj_seed,
                device=self.device,
                grad_wrt=self.grad_wrt,
            )
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
        # One index_add_ pass per batch, tables built once: the fast CPU choice.
        return CountSketchProjector(
            self.grad_dim, int(proj_dim), self.proj_seed, self.device, mask=mask
        )

    def _wants_factorized(self, gradient_computer: Any, mask: MaskLike | None) -> bool:
        """Hook gradients on CPU, no mask: the default projector is a FactorizedProjector."""
        return (
            isinstance(gradient_computer, type)
            and issubclass(gradient_computer, HookGradientComputer)
            and self.device.type == "cpu"
            and mask is None
        )

    def _ckpt_record(self, model_id: int) -> dict[str, Any]:
        path = self.save_dir / layout.checkpoint_record(model_id)
        return read_record(path) if path.exists() else {}

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
        self.gradient_computer.load_model_params(self.model)
        self.projector.set_model_id(int(model_id))

    def load_checkpoint(self, checkpoint: Mapping[str, Any], model_id: int) -> None:
        """Load a checkpoint for featurizing; resumes rows already stored for ``model_id``.

        Raises:
            SettingsMismatchError: ``model_id`` was featurized from other weights.
        """
        if self._influence is not None:
            return self._influence.load_checkpoint(checkpoint, model_id)
        sha = checkpoint_fingerprint(checkpoint)
        require_same_across_ranks("(model_id, checkpoint fingerprint)", (int(model_id), sha))
        n, k = self.train_set_size, self.proj_dim
        arr = functools.partial(layout.checkpoint_array, model_id)
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
            grads = self.store.require_array(
                arr("grads"), (n, k), self._np_dtype, chunk_rows=self._chunk_rows
            )
            self.store.require_array(
                arr("out_to_loss"), (n, 1), np.float32, chunk_rows=self._chunk_rows
            )
            self.store.require_done(arr("done"), n, chunk_rows=self._chunk_rows)
            if first and not self.load_from_save_dir:
                self.store.array(arr("done"))[:] = np.zeros(n, dtype=np.uint8)
                self._write_ckpt_record(model_id, {"checkpoint": sha, "finalized": False})
        # The stored chunking decides the shards (a resumed store keeps its own).
        self._owned = owned_mask(n, int(grads.chunks[0]))
        self._done = self.store.done_rows(arr("done"))
        if self._done.any():
            self.logger.info(
                "model id %d: resuming, %d of %d rows already featurized",
                model_id,
                int(self._done.sum()),
                n,
            )
        self._load_weights(checkpoint, model_id)
        self.ckpt_loaded = int(model_id)
        self._last_ind = 0

    def _features(self, batch: Sequence[Tensor], model_id: int) -> Tensor:
        gc = self.gradient_computer
        if hasattr(gc, "project"):
            phi = gc.project(batch, self.projector, model_id)
        else:
            phi = self.projector.project(gc.compute_per_sample_grad(batch), model_id=model_id)
        return phi / self.normalize_factor

    # -- featurizing ------------------------------------------------------------
    def featurize(
        self, batch: Sequence[Tensor], inds: Any = None, num_samples: int | None = None
    ) -> None:
        """Compute and store features ``P grad f / sqrt(d)`` and Q for a batch of training rows.

        Rows already stored (from an interrupted run) are skipped: their
        gradients are not recomputed.

        Args:
            batch: tuple of ``[B, ...]`` tensors, as the task expects, or (for
                the Hugging Face tasks) a dict such as a tokenizer returns.
            inds: ``[B]`` row indices in the training set.
            num_samples: ``B``, when rows follow the previous batch.
        """
        if self._influence is not None:
            return self._influence.featurize(batch, inds, num_samples)
        if self.ckpt_loaded is None or self._done is None:
            raise ModelIDException(
                "no checkpoint loaded; call traker.load_checkpoint(state_dict, model_id) "
                "before featurize."
            )
        batch = as_task_batch(self.task, batch)
        idx = _resolve_inds(inds, num_samples, self._last_ind, self.train_set_size, "featurize")
        if num_samples is not None:
            self._last_ind += int(num_samples)
        todo = ~self._done[idx]
        if self._owned is not None:
            todo &= self._owned[idx]
        if not todo.any():
            return
        if not todo.all():
            keep = torch.as_tensor(np.nonzero(todo)[0], device=batch[0].device)
            batch = tuple(t.index_select(0, keep.to(t.device)) for t in batch)
            idx = idx[todo]
        phi = self._features(batch, self.ckpt_loaded)
        q = self.gradient_computer.compute_loss_grad(batch)
        arr = functools.partial(layout.checkpoint_array, self.ckpt_loaded)
        self.store.write_rows(
            idx,
            {
                arr("grads"): phi.detach().to(self.dtype).cpu().numpy(),
                arr("out_to_loss"): q.detach().float().reshape(-1, 1).cpu().numpy(),
            },
            done=arr("done"),
            background=True,  # written while the next batch is computed
        )
        self._done[idx] = True

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
        if self._influence is not None:
            return self._influence.featurize_loader(loader)
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
        """Compute each checkpoint's XᵀX (streamed in row blocks) and mark it final.

        The ``[n, k]`` features ``X (XᵀX + λI)⁻¹`` are only formed when
        ``del_grads=True`` (then they replace the gradients); otherwise the
        inverse is applied to the targets at scoring time, which is cheaper.
        """
        if self._influence is not None:
            return self._influence.finalize_features(model_ids, del_grads)
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
            grads = self.store.array(arr("grads"))
            dev = self.device
            # XᵀX = Σ_r X_rᵀX_r: each rank multiplies its own rows, all_reduce adds.
            mine = chunk_shard(self.train_set_size, int(grads.chunks[0]))
            rows = grads if world == 1 else RowWindow(grads, mine.start, mine.stop)
            if self.score_computer is not None:
                xtx = self.score_computer.get_xtx(torch.as_tensor(rows[:], device=dev).float())
            else:
                xtx = xtx_blocked(
                    rows,
                    block_rows=self._row_block(),
                    device=dev,
                    prefetch=self.memory_budget is None,
                )
            xtx = all_reduce_sum_(xtx)
            if rank == 0:
                xtx_arr = self.store.require_array(arr("xtx"), tuple(xtx.shape), np.float32)
                xtx_arr[:] = xtx.float().cpu().numpy()
            if del_grads:
                self._form_features(model_id, xtx, mine)
                barrier()
                if rank == 0:
                    self.store.delete(arr("grads"))
            if rank == 0:
                self._write_ckpt_record(
                    model_id, {**record, "finalized": True, "features": del_grads}
                )
            barrier()

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
        if self._influence is not None:
            _refuse_per_token(per_token, self.method)
            return self._influence.start_scoring_checkpoint(
                exp_name, checkpoint, model_id, num_targets
            )
        if not exp_name or "/" in exp_name:
            raise ValueError(f"`exp_name` must be a non-empty name without '/', got {exp_name!r}.")
        positive_int("num_targets", num_targets)
        if per_token and not callable(getattr(self.task, "per_token_batch", None)):
            raise ValueError(
                f"`per_token`=True needs a task with per-token outputs (a `per_token_batch` "
                f"method, as 'language_modeling' has); {type(self.task).__name__} has none."
            )
        if per_token and rank_and_world()[1] > 1:
            raise ValueError(
                "`per_token`=True is not supported under torch.distributed yet; score the "
                "per-token targets in one process."
            )
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
                chunk_rows=self._chunk_rows,
            )
            self.store.require_done(arr("done"), num_targets, chunk_rows=self._chunk_rows)
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
        if self._influence is not None:
            return self._influence.score(batch, inds, num_samples)
        if self._exp is None or self._exp_model_id is None or self._exp_done is None:
            raise ModelIDException(
                "no scoring checkpoint; call traker.start_scoring_checkpoint(...) before score."
            )
        batch = as_task_batch(self.task, batch)
        idx = _resolve_inds(
            inds, num_samples, self._last_ind_target, self._exp_num_targets, "score"
        )
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
            size, length = (int(s) for s in batch[0].shape[:2])
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
        if self._influence is not None:
            return self._influence.score_loader(loader)
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
            has_features = bool(record.get("features"))
            used.append(model_id)
            ckpts.append(
                CheckpointGrads(
                    train=self.store.array(arr("features") if has_features else arr("grads")),
                    targets=self.store.array(target("grads")),
                    out_to_loss=self.store.array(arr("out_to_loss")),
                    xtx=torch.from_numpy(np.asarray(self.store.array(arr("xtx"))[:])),
                    preconditioned=has_features,
                )
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
        if self._influence is not None:
            _refuse_per_token(per_token, self.method)
            return self._influence.finalize_scores(exp_name, model_ids, allow_skip)
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
                json.dumps({"model_ids": [int(i) for i in used], "num_targets": m}) + "\n"
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
        tokens = []
        for model_id in model_ids:
            # The targets' rows: [m, T * k] stored, [m * T, k] for the kernel.
            name = layout.target_array(exp_name, model_id, "token_grads")
            stored = np.asarray(self.store.array(name)[:], dtype=np.float32)
            tokens.append(stored.reshape(m * (stored.shape[1] // self.proj_dim), self.proj_dim))
        length = tokens[0].shape[0] // m
        per_token = [
            CheckpointGrads(
                ck.train, torch.from_numpy(t), ck.out_to_loss, ck.xtx, ck.preconditioned
            )
            for ck, t in zip(ckpts, tokens)
        ]
        scores = score_checkpoints(
            per_token,
            self.lambda_reg,
            self.memory_budget,
            precision=self.precision,
            device=self.device,
            progress=self.progress,
        )
        return np.asarray(scores).reshape(n, m, length)

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

        Returns:
            :class:`~gradsketch.attribution.TopK` with ``[k, m]`` training-row
            indices and scores (proponents highest first, opponents lowest first).
        """
        if self._influence is not None:
            raise ValueError(
                f"`topk` streams TRAK's kernel; with method={self.method!r} call "
                "finalize_scores(exp_name) and take the top rows of its columns."
            )
        if rank_and_world()[1] > 1:
            raise ValueError(
                "TRAKer.topk is not supported under torch.distributed yet; call it in one "
                "process on the finalized store."
            )
        _, _, ckpts = self._scoring_inputs(exp_name, model_ids, allow_skip)
        return topk_checkpoints(
            ckpts,
            k,
            self.lambda_reg,
            self.memory_budget,
            device=self.device,
            progress=self.progress,
        )
