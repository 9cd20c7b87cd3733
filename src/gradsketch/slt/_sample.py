"""``sample``: SGMCMC chains on a language model, per-token losses of observables in zarr.

The store has devinterp 2.0's layout (variable names, dimensions and root
``metadata``), so code that reads ``devinterp.slt.sample``'s output reads
this one's. Per chain, per step, per draw::

    sampling_loss_micro      [chain, step, batch_sampling, token_pos]  every micro-batch
    sampling_input_ids_micro [chain, step, batch_sampling, token]
    sampling_loss            [chain, draw, batch, token_pos]   the step's loss at a draw
    loss_<obs>               [chain, draw, batch_<obs>, token_pos]  fixed probe sequences
    input_ids_<obs>          [batch_<obs>, token]
    init_loss                [chain, token_pos]   L(w*) per position
    metrics_<field>          [chain, step]        with save_metrics (norms, dot products)
    sketch_<component>       [chain, step, sketch] with sketch_dim (count sketches)

Chunks are compressed with Blosc-zstd and byte shuffle, then checksummed
(crc32c; :func:`gradsketch._store.array_options`); devinterp writes plain
zstd, and each library reads the other's stores.

The chains run on :class:`gradsketch.sampling.SGMCMC` (every preconditioner,
masks, metrics, sketches). Differences from devinterp that change no
estimate: batches are index lookups into one token tensor (the same batches
as devinterp's DataLoader for the same seed); the per-token loss is one fused
cross-entropy; every observable of a draw is evaluated in one forward pass
(in chunks bounded by the logits' size); the initial loss, which depends only
on the weights and the batches, is computed once when every chain sees the
same batches (and once for the calls sharing a :class:`SamplingCache`, as
the restrictions of :func:`~gradsketch.slt.susceptibilities` do); and each
finished chain is written by a background thread while the next one samples
(data first, then the chain's done flag, as :mod:`gradsketch._store` does).

Every chain runs on a working copy of the model
(:mod:`gradsketch.slt._train_forward`): the same train-mode function with
dropout masks from the chain's own generator and faster CPU kernels for
dropout, attention with dropout and GELU.

With ``cores=k > 1`` (devinterp 2.0 has no such option; devinterp 1.x
called it ``cores``) ``k`` chains sample at once
(:mod:`gradsketch._processes`): in threads of this process when nothing a
chain runs draws from torch's global generator (checked on one forward
pass), else in worker processes; each finished chain comes back to this
thread, which alone writes the store, in the same order (data, then flag).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import inspect
import json
import logging
import os
import pickle
import shutil
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr
from filelock import FileLock, Timeout
from torch import nn
from tqdm.auto import tqdm

from gradsketch._processes import check_cores, run_jobs, start_workers, threads_for
from gradsketch._settings import SettingsMismatchError, settings_diff, settings_record
from gradsketch._store import array_options
from gradsketch._writer import BackgroundWriter
from gradsketch.masked import ParamMask
from gradsketch.sampling import SGMCMC, Metrics
from gradsketch.sampling._chain import DrawSchedule, run_chain
from gradsketch.slt._data import (
    LossFn,
    NonFiniteLossError,
    Observable,
    as_token_tensor,
    check_finite_weights,
    check_token_range,
    nonfinite_cause,
    per_token_loss,
    token_digest,
    vocab_size,
)
from gradsketch.slt._restrictions import to_param_mask
from gradsketch.slt._train_forward import (
    FAST_PATHS,
    dropout_stream,
    engaged,
    fast_kernels,
    skip_seeds,
    stream_draws,
    train_copy,
    uses_global_generator,
)

logger = logging.getLogger(__name__)

__all__ = [
    "SAMPLING_METHODS",
    "OutputPathMismatchError",
    "SamplerSettings",
    "SamplingCache",
    "UnsavedSamplesWarning",
    "sample",
]

#: ``sampling_method`` names (devinterp's, plus gradsketch's other samplers) -> SGMCMC factory.
SAMPLING_METHODS: dict[str, Callable[..., SGMCMC]] = {
    "sgmcmc_sgld": SGMCMC.sgld,
    "rmsprop_sgld": SGMCMC.rmsprop_sgld,
    "adam_sgld": SGMCMC.adam_sgld,
    "sgnht": SGMCMC.sgnht,
}

#: Bytes of one forward pass's logits, at most, when evaluating observables and
#: ``init_loss`` (with at least one row per pass).
EVAL_LOGIT_BYTES = {"cuda": 256 << 20, "cpu": 4 << 20}
#: Token positions of one such forward pass on CPU, at most: the activations of
#: a few thousand positions stay in cache from one operation to the next, which
#: makes smaller passes faster per row (benchmarks/RESULTS.md).
EVAL_TOKENS_CPU = 3200
#: Bytes of one stored chunk, at most (chunks span one chain and several draws).
CHUNK_BYTES = 32 << 20
#: Base64 of NaN as float64: xarray's encoding of a NaN fill value.
_NAN_FILL = "AAAAAAAA+H8="
_FORMAT = "gradsketch.slt.sample/1"
#: Root attribute holding the settings record of a gradsketch sample store.
SETTINGS_ATTR = "gradsketch_settings"
#: Root attribute: the number of sampled weights ``d`` (the LLC lies in ``[0, d/2]``).
NUMEL_ATTR = "gradsketch_numel"


def lock_path(path: Path) -> Path:
    """The advisory lock file of the store at ``path``, held by the one process writing it.

    Hidden beside the store: zarr warns of any foreign file inside one.
    """
    return path.with_name(f".{path.name}.lock")


class OutputPathMismatchError(SettingsMismatchError, RuntimeError):
    """``output_path`` holds samples made with other settings (or is not a sample store)."""


class UnsavedSamplesWarning(UserWarning):
    """A large run writes to a temporary directory (pass ``output_path`` to keep it)."""


@dataclasses.dataclass
class SamplerSettings:
    """The sampler settings of :func:`sample`, in devinterp's ``SamplerConfig`` order.

    They are stored in the store's root ``metadata`` exactly as devinterp
    stores them, and compared when an ``output_path`` is reused.
    """

    lr: float
    n_beta: float
    batch_size: int = 32
    num_chains: int = 4
    num_draws: int = 200
    num_burnin_steps: int = 0
    num_steps_bw_draws: int = 1
    gradient_accumulation_steps: int = 1
    num_init_loss_batches: int = 32
    init_seed: int = 100
    localization: float = 0.0
    noise_level: float = 1.0
    llc_weight_decay: float = 0.0
    bounding_box_size: float | None = None
    sampling_method: str = "sgmcmc_sgld"
    sampling_method_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    init_noise: float | None = None
    save_metrics: bool = False
    shuffle: bool = True
    epoch_mode: str = "cycle"
    match_sampling_input_ids_across_chains: bool = True

    def __post_init__(self) -> None:
        for name in ("lr", "n_beta", "localization", "noise_level", "llc_weight_decay"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"`{name}` must be a non-negative number, got {value!r}.")
            setattr(self, name, float(value))
        for name in ("lr", "n_beta"):
            if getattr(self, name) == 0:
                raise ValueError(f"`{name}` must be positive, got 0.")
        for name, low in (
            ("batch_size", 1),
            ("num_chains", 1),
            ("num_draws", 1),
            ("num_burnin_steps", 0),
            ("num_steps_bw_draws", 1),
            ("gradient_accumulation_steps", 1),
            ("num_init_loss_batches", 1),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                kind = "non-negative" if low == 0 else "positive"
                raise ValueError(f"`{name}` must be a {kind} int, got {value!r}.")
        if isinstance(self.init_seed, bool) or not isinstance(self.init_seed, int):
            raise TypeError(f"`init_seed` must be an int, got {self.init_seed!r}.")
        for name in ("bounding_box_size", "init_noise"):
            value = getattr(self, name)
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                    raise ValueError(
                        f"`{name}` must be None or a non-negative number, got {value!r}."
                    )
                setattr(self, name, float(value))
        if self.sampling_method not in SAMPLING_METHODS:
            raise ValueError(
                f"`sampling_method` must be one of {sorted(SAMPLING_METHODS)}, got "
                f"{self.sampling_method!r}."
            )
        if self.epoch_mode != "cycle":
            raise ValueError(f"`epoch_mode` must be 'cycle', got {self.epoch_mode!r}.")

    @property
    def num_steps(self) -> int:
        """Sampler steps per chain: ``num_draws * num_steps_bw_draws + num_burnin_steps``."""
        return self.num_draws * self.num_steps_bw_draws + self.num_burnin_steps

    def metadata(self) -> dict[str, Any]:
        """The ``config.sampler`` record devinterp 2.0.1 writes (with its legacy fields)."""
        return {
            **dataclasses.asdict(self),
            "scheduler_type": "constant",
            "scheduler_kwargs": None,
            "cores": 1,
            "online": False,
        }


def _model_digest(model: nn.Module) -> str:
    """A digest of the parameters' and buffers' names, shapes and values."""
    digest = hashlib.blake2b(type(model).__name__.encode(), digest_size=8)
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    for name, t in tensors:
        flat = t.detach().reshape(-1)
        if flat.numel() > 1 << 20:
            # Large tensors: a fixed stride of values and the sum (hashing GBs costs seconds).
            step = flat.numel() // (1 << 20)
            flat = torch.cat([flat[::step], flat.float().sum().reshape(1).to(flat.dtype)])
        digest.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
        digest.update(flat.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _noise_seed(init_seed: int, chain: int) -> int:
    """The seed of a chain's sampler noise, unrelated to ``init_seed + chain``.

    torch's global generator, which draws dropout masks, is seeded with
    ``init_seed + chain`` (as devinterp); a noise generator with the same seed
    would replay that stream, correlating the noise with the dropout masks.
    """
    state = np.random.SeedSequence([init_seed, chain, 0x5EED]).generate_state(1, np.uint64)
    return int(state[0] >> 1)


def _loader_order(n: int, *, seed: int, shuffle: bool) -> torch.Tensor:
    """The row order of devinterp's DataLoader for one seeded generator (first epoch).

    A DataLoader iterator draws one int64 from the generator for its workers'
    base seed before the RandomSampler's ``randperm``; the same draw is made here
    so that both give the same batches.
    """
    if not shuffle:
        return torch.arange(n)
    gen = torch.Generator().manual_seed(seed)
    torch.empty((), dtype=torch.int64).random_(generator=gen)
    return torch.randperm(n, generator=gen)


def _factory_kwargs(
    settings: SamplerSettings, mask: list[torch.Tensor | None] | None, sketch_dim: int | None
) -> tuple[Callable[..., SGMCMC], dict[str, Any]]:
    factory = SAMPLING_METHODS[settings.sampling_method]
    kwargs: dict[str, Any] = {
        "lr": settings.lr,
        "nbeta": settings.n_beta,
        "localization": settings.localization,
        "weight_decay": settings.llc_weight_decay,
        "bounding_box_size": settings.bounding_box_size,
        "save_metrics": settings.save_metrics,
        "noise_level": settings.noise_level,
        "mask": mask,
        "sketch_dim": sketch_dim,
    }
    accepted = set(inspect.signature(factory).parameters) - {"params"}
    for name in list(kwargs):
        if name in accepted:
            continue
        default = {"noise_level": 1.0, "mask": None}.get(name)
        if kwargs[name] != default:
            what = "a weight restriction" if name == "mask" else f"{name}={kwargs[name]!r}"
            raise ValueError(
                f"`sampling_method`={settings.sampling_method!r} does not take {what}; use "
                "'sgmcmc_sgld' or 'rmsprop_sgld' for it."
            )
        del kwargs[name]
    extra = dict(settings.sampling_method_kwargs)
    unknown = sorted(set(extra) - accepted)
    if unknown:
        raise ValueError(
            f"`sampling_method_kwargs` has {unknown}, which {settings.sampling_method!r} does not "
            f"take; it takes {sorted(accepted - set(kwargs))}."
        )
    return factory, {**kwargs, **extra}


class _Arrays:
    """Creates the store's arrays with devinterp's names, dimensions and fill values."""

    def __init__(self, root: zarr.Group) -> None:
        self.root = root

    def create(self, name: str, dims: tuple[str, ...], shape: tuple[int, ...], dtype: str) -> None:
        if name in self.root:
            return
        np_dtype = np.dtype(dtype)
        chunks = list(shape)
        if len(shape) >= 2 and dims[0] == "chain":
            # One chain per chunk, as many draws (steps) as fit in CHUNK_BYTES.
            row = int(np.prod(shape[2:], dtype=np.int64)) * np_dtype.itemsize
            chunks[0] = 1
            chunks[1] = max(1, min(shape[1], CHUNK_BYTES // max(row, 1)))
        floating = np_dtype.kind == "f"
        self.root.create_array(
            name,
            shape=shape,
            dtype=np_dtype,
            chunks=tuple(chunks),
            dimension_names=dims,
            # Blosc-zstd with shuffle, crc32c checksums, NaN fill for floats.
            **array_options(np_dtype, compress=True),
            attributes={"_FillValue": _NAN_FILL} if floating else {},
        )


def _array(root: zarr.Group, name: str) -> zarr.Array:
    node = root[name]
    if not isinstance(node, zarr.Array):
        raise TypeError(f"{name!r} in the sample store is a {type(node).__name__}, not an array.")
    return node


class _ChainWriter:
    """Writes finished chains behind the sampler, data first and its done flag last.

    The rule of :mod:`gradsketch._store`: a chain's flag is set only after all
    its arrays are on disk (zarr replaces each chunk file atomically), so a
    killed run leaves every chain either flagged and complete or unflagged
    and redone. The sampler hands a chain over and goes on with the next; the
    writes run on gradsketch's one background writer.
    """

    def __init__(self, root: zarr.Group) -> None:
        self.root = root
        self._arrays: dict[str, zarr.Array] = {}
        self._writer: BackgroundWriter[tuple[int, dict[str, np.ndarray], str]] = BackgroundWriter(
            self._write, max_pending=2, name="gradsketch-slt"
        )

    def _array(self, name: str) -> zarr.Array:
        if name not in self._arrays:
            self._arrays[name] = _array(self.root, name)
        return self._arrays[name]

    def _write(self, job: tuple[int, dict[str, np.ndarray], str]) -> None:
        chain, values, flag = job
        for name, value in values.items():
            self._array(name)[chain] = value
        self._array(flag)[chain] = 1

    def write(self, chain: int, values: dict[str, np.ndarray], flag: str) -> None:
        """Queue chain ``chain``'s rows of every array in ``values``, then its ``flag``."""
        self._writer.submit((chain, values, flag))

    def close(self) -> None:
        """Wait for every queued write; raise the first failure."""
        self._writer.close()


#: Top-level arrays and groups of a sample store (the prefixes end in ``_``).
_LAYOUT_NAMES = ("init_loss", "sampling_loss", "sampling_loss_micro", "sampling_input_ids_micro")
_LAYOUT_PREFIXES = ("loss_", "input_ids_", "metrics_", "sketch_")


def _half_created(path: Path) -> bool:
    """True for a store :meth:`_Run._layout` began and never finished (nothing sampled yet).

    The layout writes the settings record last and every chain after it, so
    a store without the record whose entries are all the layout's own
    (arrays, the ``progress`` group, zarr's metadata and its ``.partial``
    temporaries) holds nothing that cannot be made again: a kill, or a full
    disk, while it was being created.
    """
    for entry in path.iterdir():
        name = entry.name
        if name == "zarr.json" or name.endswith(".partial"):
            continue
        ours = name in _LAYOUT_NAMES or name == "progress" or name.startswith(_LAYOUT_PREFIXES)
        if not (ours and entry.is_dir()):
            return False
    return True


def _clear_half_created(path: Path) -> None:
    """Remove a half-created store's entries (only those :func:`_half_created` accepted)."""
    logger.warning(
        "sample(): %s was created by an interrupted run before any sample was written; "
        "creating it again",
        path,
    )
    for entry in path.iterdir():
        if entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def _check_existing(path: Path, record: dict[str, Any], sampler: dict[str, Any]) -> str:
    """``"new"``, ``"resume"`` or ``"done"`` for an existing ``output_path``; refuse mismatches.

    A store half-created by an interrupted run (:func:`_half_created`) is
    cleared and made again (``"new"``). A request without the observables
    (``"evaluate_observables": False``) takes a store made with them, which
    holds more, the same chains: ``record`` then loses that key, and the run
    evaluates them (resuming, all the store's chains stay alike).
    """
    if not path.exists() or (path.is_dir() and not any(path.iterdir())):
        return "new"
    try:
        attrs: dict[str, Any] = dict(zarr.open_group(str(path), mode="r").attrs)
    except Exception as exc:
        if _half_created(path):
            _clear_half_created(path)
            return "new"
        raise OutputPathMismatchError(
            f"`output_path`={str(path)!r} exists but is not a zarr store ({exc!r}); pass "
            "another path or delete it."
        ) from exc
    if SETTINGS_ATTR in attrs:
        if record.get("evaluate_observables", True) is False and attrs[SETTINGS_ATTR].get(
            "evaluate_observables", True
        ):
            del record["evaluate_observables"]
        diffs = settings_diff(attrs[SETTINGS_ATTR], record)
        if diffs:
            raise OutputPathMismatchError(
                f"`output_path`={str(path)!r} has a different sampler config (samples made with "
                "other settings):\n  "
                + "\n  ".join(diffs)
                + "\nPass another output_path for the new settings, delete the old samples, "
                "or rerun with the stored settings."
            )
        return "done" if attrs.get("completed") == 1 else "resume"
    # Written by devinterp: reuse it when complete and made with the same sampler settings.
    stored = attrs.get("metadata", {}).get("config", {}).get("sampler")
    if stored is None and _half_created(path):
        _clear_half_created(path)
        return "new"
    if stored is None:
        raise OutputPathMismatchError(
            f"`output_path`={str(path)!r} is a zarr store but holds no samples (no "
            "metadata.config.sampler); pass another path or delete it."
        )
    diffs = settings_diff(stored, sampler)
    if diffs or attrs.get("completed") != 1:
        state = "is incomplete" if not diffs else "has a different sampler config"
        raise OutputPathMismatchError(
            f"`output_path`={str(path)!r} holds devinterp samples; the store {state}:\n  "
            + "\n  ".join(diffs or ["completed: stored <missing>, requested 1"])
            + "\nPass another output_path or delete it."
        )
    return "done"


@contextlib.contextmanager
def _store_lock(path: Path) -> Iterator[None]:
    """Hold ``path``'s advisory lock: one process writes a store at a time.

    A second process asking for a store another one is writing waits for
    it (logging that it waits, and on which lock), then finds it complete
    and reuses it, or resumes it where the other stopped. The lock is an
    ``flock`` on :func:`lock_path` beside the store, released by the
    operating system when its holder dies, so a killed run leaves none held.
    """
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(
            f"`output_path`={str(path)!r} is a file, not a directory; pass a directory path "
            "for the zarr store (it is created) or move the file away."
        )
    lock: FileLock | None = FileLock(str(lock_path(path)))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        assert lock is not None
        try:
            lock.acquire(timeout=0)
        except Timeout:
            logger.warning(
                "sample(): another process is writing %s; waiting for it to finish (lock %s)",
                path,
                lock_path(path),
            )
            lock.acquire()
    except OSError as exc:
        if not (path.is_dir() and not os.access(path.parent, os.W_OK)):
            raise OSError(
                f"`output_path`={str(path)!r} cannot be locked for writing ({exc}); pass a "
                "writable directory."
            ) from exc
        # A read-only store can only be read (a complete one is reused; else writing fails).
        lock = None
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


def _open_tree(path: Path) -> Any:
    import xarray as xr

    return xr.open_datatree(str(path), engine="zarr", consolidated=False)


def _chunks(rows: int, limit: int) -> list[slice]:
    """``rows`` split into the fewest passes of at most ``limit`` rows, of even sizes."""
    passes = -(-rows // limit)
    size = -(-rows // passes) if rows else limit
    return [slice(i, min(i + size, rows)) for i in range(0, rows, size)]


def _eval_rows(model: nn.Module, seq: int, device: torch.device) -> int:
    """Rows per forward pass: logits within EVAL_LOGIT_BYTES; on CPU, EVAL_TOKENS_CPU tokens."""
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", None) or 50_000)
    budget = EVAL_LOGIT_BYTES["cuda" if device.type == "cuda" else "cpu"]
    rows = budget // max(1, seq * vocab * 4)
    if device.type != "cuda":
        rows = min(rows, EVAL_TOKENS_CPU // max(1, seq))
    return max(1, rows)


def sample(
    model: nn.Module,
    dataset: Any,
    observables: Mapping[str, Any],
    *,
    lr: float | str,
    n_beta: float,
    param_masks: ParamMask | Mapping[str, torch.Tensor | None] | None = None,
    num_chains: int = 4,
    num_draws: int = 200,
    batch_size: int = 32,
    num_burnin_steps: int = 0,
    num_steps_bw_draws: int = 1,
    num_init_loss_batches: int = 32,
    init_seed: int = 100,
    batches_per_draw: int = 3,
    obs_seed: int = 1337,
    gradient_accumulation_steps: int = 1,
    localization: float = 0.0,
    noise_level: float = 1.0,
    llc_weight_decay: float = 0.0,
    bounding_box_size: float | None = None,
    sampling_method: str = "sgmcmc_sgld",
    sampling_method_kwargs: dict[str, Any] | None = None,
    rmsprop_eps: float | None = None,
    rmsprop_alpha: float | None = None,
    shuffle: bool = True,
    match_sampling_input_ids_across_chains: bool = True,
    init_noise: float | None = None,
    device: str | torch.device | None = None,
    save_metrics: bool = False,
    output_path: str | Path | None = None,
    loss_fn: LossFn | None = None,
    sketch_dim: int | None = None,
    cores: int = 1,
    progress: bool | None = None,
    fast_path: str = "auto",
    cache: SamplingCache | None = None,
    evaluate_observables: bool = True,
) -> Any:
    """Run SGMCMC chains from ``model``'s weights; record per-token losses of every observable.

    Call-compatible with ``devinterp.slt.sampling.sample`` (2.0.1): same
    arguments, same store layout (see the module docstring). The model runs
    in train mode, as in devinterp; chain ``c`` draws its dropout masks and
    initial noise from a generator seeded ``init_seed + c`` (as devinterp
    seeds torch's global generator, which is seeded so too, for models that
    draw from it) and its SGLD noise from a second one; with
    ``match_sampling_input_ids_across_chains`` every chain sees the batches
    of devinterp's DataLoader seeded with ``init_seed``.

    A completed ``output_path`` made with the same settings (model, datasets,
    masks and sampler) is returned as it is, also one written by devinterp;
    one made with other settings is refused, showing both values of every
    difference; an interrupted one resumes at its first unfinished chain.

    Args:
        model: The trained language model (not modified).
        dataset: Sampling data: a ``datasets.Dataset`` with ``input_ids``, a
            ``[n, seq]`` token tensor, or rows ``{"input_ids": ...}``.
        observables: ``{name: data}`` or ``{name: (data, batches_per_draw)}``;
            ``batch_size * batches_per_draw`` fixed sequences each.
        lr: Step size ``eps``, or ``"auto"``: the step of
            :func:`gradsketch.sampling.calibrated_lr` (SGLD pilots from the
            model's weights aiming at a 2.5 % discretization bias of the
            LLC, on the full model, rounded to two significant digits; a
            store at ``output_path`` already made with ``"auto"`` keeps its
            step). The resolved number is what the store records.
        n_beta: Inverse temperature times sample size.
        param_masks: Which weights move: None (all), a ParamMask from
            :func:`~gradsketch.slt.create_param_masks`, or devinterp's dict
            ``{name: bool mask or None}`` (unlisted parameters are frozen).
        num_chains: Chains.
        num_draws: Draws per chain.
        batch_size: Sequences per (micro-)batch and per observable batch.
        num_burnin_steps: Steps before the first draw.
        num_steps_bw_draws: Steps between draws.
        num_init_loss_batches: Batches (times ``gradient_accumulation_steps``)
            averaged for ``init_loss``.
        init_seed: Seed of chains, batches and initial noise.
        batches_per_draw: Default batches of an observable given without one.
        obs_seed: Seed of the observables' fixed sequences.
        gradient_accumulation_steps: Micro-batches per step.
        localization: ``gamma``, the pull towards the initial weights.
        noise_level: Noise standard deviation (1 samples the posterior).
        llc_weight_decay: ``lambda``, a Gaussian prior centred at zero.
        bounding_box_size: Clamp to ``w0 +- b`` when set.
        sampling_method: A name in :data:`SAMPLING_METHODS`.
        sampling_method_kwargs: Extra keywords of the sampler factory.
        rmsprop_eps: Shorthand for ``sampling_method_kwargs["eps"]`` (rmsprop only).
        rmsprop_alpha: Shorthand for ``sampling_method_kwargs["alpha"]`` (rmsprop only).
        shuffle: Shuffle the sampling data.
        match_sampling_input_ids_across_chains: Every chain sees the same batches.
        init_noise: Gaussian noise of this std added to the restricted weights first.
        device: Where chains run; default CUDA when available.
        save_metrics: Record the sampler's per-step norms and dot products.
        output_path: Directory of the zarr store; default a temporary one.
        loss_fn: ``(model, input_ids) -> [batch, seq - 1]`` per-token loss;
            default next-token cross-entropy.
        sketch_dim: Also record count sketches of size ``k`` of every update
            component per step (gradsketch only).
        cores: Chains sampled at once, each running torch on ``max(1,
            torch.get_num_threads() // cores)`` threads (gradsketch only;
            devinterp 1.x's name). On CPU, when one train-mode forward pass
            of ``loss_fn`` draws nothing from torch's global generator (the
            working copy's dropout draws from each chain's own; a model
            calling ``torch.nn.functional.dropout`` itself does), the chains
            run in threads of this process: they start at once. Otherwise
            each runs in a worker process started with ``spawn``: the model,
            data and ``loss_fn`` are pickled to it (a ``loss_fn`` must then
            be a module-level function), it imports torch first (a few
            seconds), the workers are kept for the next call with the same
            ``cores`` and thread count (:func:`~gradsketch.slt.shutdown_workers`
            ends them), and scripts need the ``if __name__ == "__main__":``
            guard of ``spawn``. Either way the stores are bit for bit those
            of ``cores=1`` run on that many threads, and ``cores`` is not
            part of the settings: a store written with one value is reused
            or resumed with another.
        progress: tqdm bars on stderr for ``lr="auto"``'s pilots, ``L(w*)`` and
            the chains' steps: True shows them, False hides them, None (the
            default) shows them where stderr is a terminal (gradsketch only).
        fast_path: ``"auto"`` (the default) runs the chains on a working copy
            with faster train-mode pieces and native kernels where they
            engage (CPU only; :mod:`gradsketch.slt._train_forward`), ``"off"``
            on a plain copy with torch's operations (gradsketch only). Which
            ran is recorded in the store's ``gradsketch_fast_path`` attribute;
            it is not part of the settings.
        cache: A :class:`SamplingCache` shared with other calls, so that they
            compute L(w*) and ``lr="auto"``'s step once (gradsketch only;
            :func:`~gradsketch.slt.susceptibilities` shares one across its
            restrictions). None (the default): a fresh one for this call. The
            store's bits are the same either way: what ran earlier, in this
            process or with this cache, changes nothing.
        evaluate_observables: False skips the observables' forward pass at
            every draw (about half of a draw's time on a small language
            model): the store then holds no ``loss_<name>`` or
            ``input_ids_<name>`` variables, only the sampling losses and
            ``init_loss`` that :func:`~gradsketch.slt.compute_llc` reads, and
            its settings record the choice (a store made without them is not
            reused by a call that wants them; one made with them is reused,
            or resumed evaluating them, by a call that skips them). The
            chains are the same either way (gradsketch only;
            :func:`~gradsketch.slt.llc` passes False when no ``output_path``
            keeps the store).

    Returns:
        ``xarray.DataTree`` read lazily from the store.

    Example:
        >>> import tempfile
        >>> from transformers import GPT2Config, GPT2LMHeadModel
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16))
        >>> ids = torch.randint(0, 16, (16, 9))
        >>> tree = sample(model, ids, {"probe": ids}, lr=1e-4, n_beta=10.0, num_chains=2,
        ...               num_draws=3, batch_size=4, batches_per_draw=2,
        ...               output_path=tempfile.mkdtemp() + "/s.zarr")
        >>> tree.dataset["loss_probe"].dims, tree.dataset["loss_probe"].shape
        (('chain', 'draw', 'batch_probe', 'token_pos'), (2, 3, 8, 8))
    """
    if cache is None:
        cache = SamplingCache()
    elif not isinstance(cache, SamplingCache):
        raise TypeError(
            f"`cache` must be a gradsketch.slt.SamplingCache or None, got "
            f"{type(cache).__name__}; pass SamplingCache() to share one between calls."
        )
    if fast_path not in FAST_PATHS:
        raise ValueError(
            f"`fast_path` must be one of {list(FAST_PATHS)}, got {fast_path!r}; 'off' runs "
            "the model's own modules with torch's operations."
        )
    if not isinstance(evaluate_observables, bool):
        raise TypeError(
            f"`evaluate_observables` must be True or False, got {evaluate_observables!r}."
        )
    lr_auto = isinstance(lr, str)
    if lr_auto and lr != "auto":
        raise ValueError(f"`lr` must be a positive float or 'auto', got {lr!r}.")
    kwargs = dict(sampling_method_kwargs or {})
    for short, value in (("eps", rmsprop_eps), ("alpha", rmsprop_alpha)):
        if value is None:
            continue
        if sampling_method != "rmsprop_sgld":
            raise ValueError(
                f"`rmsprop_{short}` is only valid with sampling_method='rmsprop_sgld', got "
                f"sampling_method={sampling_method!r}."
            )
        if short in kwargs:
            raise ValueError(
                f"`rmsprop_{short}` is given and so is sampling_method_kwargs[{short!r}]; give one."
            )
        kwargs[short] = value
    settings = SamplerSettings(
        lr=1.0 if isinstance(lr, str) else lr,  # "auto": calibrated below, once all is checked
        n_beta=n_beta,
        batch_size=batch_size,
        num_chains=num_chains,
        num_draws=num_draws,
        num_burnin_steps=num_burnin_steps,
        num_steps_bw_draws=num_steps_bw_draws,
        gradient_accumulation_steps=gradient_accumulation_steps,
        num_init_loss_batches=num_init_loss_batches,
        init_seed=init_seed,
        localization=localization,
        noise_level=noise_level,
        llc_weight_decay=llc_weight_decay,
        bounding_box_size=bounding_box_size,
        sampling_method=sampling_method,
        sampling_method_kwargs=kwargs,
        init_noise=init_noise,
        save_metrics=save_metrics,
        shuffle=shuffle,
        match_sampling_input_ids_across_chains=match_sampling_input_ids_across_chains,
    )
    if sketch_dim is not None and (
        isinstance(sketch_dim, bool) or not isinstance(sketch_dim, int) or sketch_dim < 1
    ):
        raise ValueError(f"`sketch_dim` must be None or a positive int, got {sketch_dim!r}.")
    if not isinstance(observables, Mapping) or not observables:
        raise ValueError(
            "`observables` must be a non-empty dict {name: dataset or (dataset, "
            f"batches_per_draw)}}, got {type(observables).__name__}."
        )
    data = as_token_tensor(dataset)
    if data.shape[0] < batch_size:
        raise ValueError(
            f"`dataset` has {data.shape[0]} sequences, fewer than `batch_size`={batch_size}; "
            "lower batch_size or give more data (batches drop the last partial one)."
        )
    context_length = data.shape[1] - 1
    # Token ids the embedding cannot take fail here, named, not as torch's IndexError.
    vocab = vocab_size(model)
    if vocab is not None:
        check_token_range(data, vocab, name="dataset")
    obs_list: list[Observable] = []
    for name, spec in observables.items():
        obs_data, bpd = spec if isinstance(spec, tuple) else (spec, batches_per_draw)
        ids = as_token_tensor(obs_data, name=f"observables[{name!r}]")
        if vocab is not None:
            check_token_range(ids, vocab, name=f"observables[{name!r}]")
        if ids.shape[1] != data.shape[1]:
            raise ValueError(
                f"observable {name!r} has sequences of {ids.shape[1]} tokens but `dataset` has "
                f"{data.shape[1]}; all sequences must have one length."
            )
        obs_list.append(
            Observable(name, ids, batches_per_draw=bpd, batch_size=batch_size, seed=obs_seed)
        )
    ids_seen = [o.obs_id for o in obs_list]
    if len(set(ids_seen)) != len(ids_seen):
        raise ValueError(
            f"`observables` names map to repeated identifiers {ids_seen}; rename them."
        )
    check_finite_weights(model)
    cores = check_cores(cores)
    mask = to_param_mask(model, param_masks)
    if mask.numel == 0:
        raise ValueError("`param_masks` selects no weight; select at least one entry.")
    loss = loss_fn if loss_fn is not None else per_token_loss
    model_digest, data_digest = _model_digest(model), token_digest(data)
    loss_name = getattr(loss, "__qualname__", repr(loss))
    if lr_auto:
        # Last, so that no argument error comes after the pilots' cost.
        settings = dataclasses.replace(
            settings,
            lr=_auto_lr(
                model,
                data,
                loss,
                key=(model_digest, data_digest, loss_name),
                settings=settings,
                output_path=output_path,
                device=device,
                cache=cache,
                progress=progress,
                fast_path=fast_path,
            ),
        )
    record = {
        "format": _FORMAT,
        **settings.metadata(),
        "context_length": context_length,
        "dataset": data_digest,
        "observables": [
            {"obs_id": o.obs_id, "batches_per_draw": o.batches_per_draw, "data": o.digest}
            for o in obs_list
        ],
        "obs_seed": obs_seed,
        "model": model_digest,
        "param_masks": mask.fingerprint,
        "loss_fn": loss_name,
        "sketch_dim": sketch_dim,
        **({"lr_auto": True} if lr_auto else {}),
        # Only when skipped, so that the records of stores with observables are unchanged.
        **({} if evaluate_observables else {"evaluate_observables": False}),
    }
    if output_path is None:
        total = num_chains * settings.num_steps * batch_size
        if total > 1000:
            warnings.warn(
                f"sample() writes {total} sampled sequences to a temporary directory that is "
                "not kept; pass output_path='samples.zarr' to keep them.",
                UnsavedSamplesWarning,
                stacklevel=2,
            )
        path = Path(tempfile.mkdtemp()) / "samples.zarr"
    else:
        path = Path(output_path)
    with _store_lock(path):
        state = _check_existing(path, record, settings.metadata())
        if state == "done":
            logger.info("sample(): reusing the completed samples at %s", path)
            return _open_tree(path)
        torch_device = torch.device(
            device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
        )
        try:
            _Run(
                model=model,
                data=data,
                observables=obs_list,
                settings=settings,
                mask=mask,
                loss_fn=loss,
                device=torch_device,
                path=path,
                record=record,
                sketch_dim=sketch_dim,
                cores=cores,
                progress=progress,
                fast_path=fast_path,
                cache=cache,
                # False unless _check_existing took a store made with them.
                evaluate_observables=record.get("evaluate_observables", True),
            ).run()
        except OSError as exc:
            # A full disk, a quota, a lost mount: say which store, and that a rerun resumes it.
            raise OSError(
                exc.errno,
                f"writing the sample store {path} failed ({exc.strerror or exc}); free space "
                "(or fix the cause) and rerun with the same arguments: finished chains are "
                "kept and the run resumes",
            ) from exc
    return _open_tree(path)


#: The root attribute listing which fast path ran (:func:`_fast_path_record`).
FAST_PATH_ATTR = "gradsketch_fast_path"


class SamplingCache:
    """Initial losses L(w*) and ``lr="auto"`` steps that calls of :func:`sample` may share.

    Each :func:`sample` call makes a fresh one unless it is given one;
    :func:`~gradsketch.slt.susceptibilities` gives one to all its
    restrictions' calls, so that L(w*) (which ignores the restriction, as
    devinterp's does) and the ``lr="auto"`` pilots run once. Every entry is
    keyed by everything that decides its bits, so a store made with a cache
    that earlier calls filled is bit for bit the store made with a fresh one.

    Keys:
        ``init_losses``: ``(model digest, modules' repr digest, data digest,
        loss_fn, batch_size, gradient_accumulation_steps,
        num_init_loss_batches, init_seed, init_noise, shuffle,
        match_sampling_input_ids_across_chains, device, threads, chains in
        threads, fast-path record, chain)`` -> ``[token_pos]`` float32, with
        chain 0 for every chain when all chains share one L(w*) (same
        batches, no ``init_noise``: chain 0's dropout stream).
        ``auto_lrs``: ``(model digest, data digest, loss_fn, n_beta,
        localization, batch_size, init_seed, device, threads, fast_path)`` ->
        the calibrated step.

    Example:
        >>> cache = SamplingCache()
        >>> cache.auto_lrs[("model", "data")] = 1e-4
        >>> len(cache), cache.clear(), len(cache)
        (1, None, 0)
    """

    def __init__(self) -> None:
        self.init_losses: dict[tuple[Any, ...], np.ndarray] = {}
        self.auto_lrs: dict[tuple[Any, ...], float] = {}

    def __len__(self) -> int:
        return len(self.init_losses) + len(self.auto_lrs)

    def __repr__(self) -> str:
        return (
            f"SamplingCache({len(self.init_losses)} initial losses, "
            f"{len(self.auto_lrs)} lr='auto' steps)"
        )

    def clear(self) -> None:
        """Forget every entry."""
        self.init_losses.clear()
        self.auto_lrs.clear()


def _auto_lr(
    model: nn.Module,
    data: torch.Tensor,
    loss: LossFn,
    *,
    key: tuple[str, str, str],
    settings: SamplerSettings,
    output_path: str | Path | None,
    device: str | torch.device | None,
    cache: SamplingCache,
    progress: bool | None = None,
    fast_path: str = "auto",
) -> float:
    """The step of ``lr="auto"`` (see :func:`sample`) for the validated ``settings``.

    ``key``: the digests of the model and data and the loss's name, as in the record;
    ``cache``: steps already calibrated by the calls sharing it.
    """
    if output_path is not None:
        path = Path(output_path)
        if path.is_dir() and any(path.iterdir()):
            try:
                stored = dict(zarr.open_group(str(path), mode="r").attrs).get(SETTINGS_ATTR)
            except Exception:  # not a store: sample() refuses it with the full message
                stored = None
            step = stored.get("lr") if isinstance(stored, Mapping) else None
            if isinstance(stored, Mapping) and stored.get("lr_auto") and isinstance(step, float):
                logger.info("sample(lr='auto'): keeping the stored step %g", step)
                return step
    from torch.utils.data import DataLoader, TensorDataset

    from gradsketch.sampling import calibrated_lr

    cache_key = (
        *key,
        settings.n_beta,
        settings.localization,
        settings.batch_size,
        settings.init_seed,
        # What a fresh process would compute it on, so that no earlier call decides it.
        str(device),
        torch.get_num_threads(),
        fast_path,
    )
    if cache_key in cache.auto_lrs:  # e.g. susceptibilities' restrictions: one calibration
        return cache.auto_lrs[cache_key]
    pilot_model = copy.deepcopy(model).train()
    loader = DataLoader(
        TensorDataset(data),
        batch_size=settings.batch_size,
        shuffle=True,
        drop_last=True,
        generator=torch.Generator().manual_seed(settings.init_seed),
    )
    with (
        tqdm(desc="lr='auto' pilots", unit="step", disable=_hidden(progress)) as bar,
        fast_kernels(fast_path != "off"),
    ):

        def evaluate(m: nn.Module, batch: Any) -> torch.Tensor:
            bar.update()
            return loss(m, batch[0]).mean()

        step = calibrated_lr(
            pilot_model,
            loader,
            evaluate,
            nbeta=settings.n_beta,
            localization=settings.localization,
            seed=settings.init_seed,
            device=device
            if device is not None
            else ("cuda" if torch.cuda.is_available() else "cpu"),
        )
    step = float(f"{step:.2g}")
    logger.info("sample(lr='auto'): calibrated step %g", step)
    cache.auto_lrs[cache_key] = step
    return step


class _Run:
    """One call of :func:`sample`: store layout, initial loss, chains, writes."""

    def __init__(
        self,
        *,
        model: nn.Module,
        data: torch.Tensor,
        observables: list[Observable],
        settings: SamplerSettings,
        mask: ParamMask,
        loss_fn: LossFn,
        device: torch.device,
        path: Path,
        record: dict[str, Any],
        sketch_dim: int | None,
        cores: int = 1,
        progress: bool | None = None,
        fast_path: str = "auto",
        cache: SamplingCache | None = None,
        evaluate_observables: bool = True,
    ) -> None:
        self.model = model
        self.data = data
        self.obs = observables
        self.s = settings
        self.mask = mask
        self.loss_fn = loss_fn
        self.device = device
        self.path = path
        self.record = record
        self.sketch_dim = sketch_dim
        self.ctx = data.shape[1] - 1
        self.n_batches = data.shape[0] // settings.batch_size
        self.cores = cores
        self.progress = progress
        self.fast_path = fast_path
        # L(w*) of the calls sharing it (read and written by run(), in this process only).
        self.cache = cache if cache is not None else SamplingCache()
        self.evaluate_observables = evaluate_observables
        # With evaluate_observables=False: the dropout-stream seeds the observables'
        # forward pass draws, drawn without it at each draw (run() decides; None: it
        # runs, as the chains could not be kept the same without it).
        self.skipped_seeds: int | None = None
        # Chains in threads of this process (run() decides): no global seeding then.
        self.threaded = False
        # Per process (dropped when pickled to a worker): the working copies, the step counter.
        self._local = threading.local()
        self._tick: Callable[[], Any] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_local"]
        state["_tick"] = None
        state["threaded"] = False
        state["cache"] = None  # workers sample chains; L(w*) is this process's
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._local = threading.local()

    def observed(self) -> list[Observable]:
        """The observables evaluated at each draw: none when :attr:`skipped_seeds` is set."""
        return [] if self.skipped_seeds is not None else self.obs

    def _observable_ids(self) -> torch.Tensor:
        """Every observable's fixed sequences, in order, on the device: one forward pass's rows."""
        return torch.cat([o.input_ids for o in self.obs]).to(self.device)

    def _decide_observables(self) -> None:
        """Set :attr:`skipped_seeds` for ``evaluate_observables=False``, where the chains allow.

        The observables' train-mode forward pass draws its dropout seeds from
        the chain's stream; skipped, the same number is drawn at each draw, so
        the chains and their sampling losses are those of the run that
        evaluates them. Where that count cannot be found (the pass draws from
        torch's global generator, or other than whole seeds), they are
        evaluated as usual.
        """
        self.skipped_seeds = None
        if self.evaluate_observables:
            return
        work = self.work()
        obs_ids = self._observable_ids()
        with fast_kernels(self.fast_path != "off"):
            count = stream_draws(
                lambda: self._forward_rows(work.train(), obs_ids, check=False), self.device
            )
        if count is None:
            logger.info(
                "sample(evaluate_observables=False): the observables' forward pass draws "
                "from torch's global generator (or other than whole dropout seeds); they are "
                "evaluated, so that the chains stay those of a run that evaluates them"
            )
        self.skipped_seeds = count

    def work(self) -> nn.Module:
        """The working copy of the model in this thread (each chain resets its weights).

        A :func:`~gradsketch.slt._train_forward.train_copy`: the same
        train-mode function with faster dropout, attention and GELU kernels.
        """
        work = getattr(self._local, "work", None)
        if work is None:
            work = train_copy(
                self.model,
                self.device,
                loss_fn=self.loss_fn,
                probe=self.data[:1],
                fast_path=self.fast_path,
            )
            self._local.work = work
        return work

    def _generator(self, chain: int) -> torch.Generator:
        """Chain ``chain``'s generator of dropout masks and initial noise (init_seed + chain).

        Outside threads torch's global generator gets the same seed, for
        models that draw from it (devinterp seeds only that one).
        """
        seed = self.s.init_seed + chain
        if not self.threaded:
            torch.manual_seed(seed)
        return torch.Generator(device=self.device).manual_seed(seed)

    # ------------------------------------------------------------------ layout
    def _layout(self, root: zarr.Group) -> None:
        s, ctx = self.s, self.ctx
        arrays = _Arrays(root)
        micro = s.gradient_accumulation_steps * s.batch_size
        arrays.create("init_loss", ("chain", "token_pos"), (s.num_chains, ctx), "float32")
        arrays.create(
            "sampling_loss",
            ("chain", "draw", "batch", "token_pos"),
            (s.num_chains, s.num_draws, s.batch_size, ctx),
            "float32",
        )
        arrays.create(
            "sampling_loss_micro",
            ("chain", "step", "batch_sampling", "token_pos"),
            (s.num_chains, s.num_steps, micro, ctx),
            "float32",
        )
        arrays.create(
            "sampling_input_ids_micro",
            ("chain", "step", "batch_sampling", "token"),
            (s.num_chains, s.num_steps, micro, ctx + 1),
            "int64",
        )
        for o in self.observed():
            dim = f"batch_{o.obs_id}"
            arrays.create(
                f"loss_{o.obs_id}",
                ("chain", "draw", dim, "token_pos"),
                (s.num_chains, s.num_draws, o.n_samples, ctx),
                "float32",
            )
            arrays.create(f"input_ids_{o.obs_id}", (dim, "token"), (o.n_samples, ctx + 1), "int64")
        if s.save_metrics:
            for name in (*Metrics.NORM_FIELDS, *Metrics.DOT_FIELDS):
                arrays.create(
                    f"metrics_{name}", ("chain", "step"), (s.num_chains, s.num_steps), "float32"
                )
        if self.sketch_dim is not None:
            for q in ("scaled_grad", "unscaled_grad", "localization", "weight_decay", "noise"):
                arrays.create(
                    f"sketch_{q}",
                    ("chain", "step", "sketch"),
                    (s.num_chains, s.num_steps, self.sketch_dim),
                    "float32",
                )
        progress = zarr.open_group(str(self.path / "progress"), mode="a")
        flags = _Arrays(progress)
        flags.create("init_done", ("chain",), (s.num_chains,), "uint8")
        flags.create("chain_done", ("chain",), (s.num_chains,), "uint8")
        attrs: dict[str, Any] = {
            "metadata": {
                "config": {
                    "sampler": s.metadata(),
                    "observables": [
                        {
                            "type": "ObserveDifferentDataset",
                            "obs_id": o.obs_id,
                            "batches_per_draw": o.batches_per_draw,
                        }
                        for o in self.observed()
                    ],
                    "chain_buffer_size": min(50, s.num_draws),
                    "shared_observable_dims": ["token", "token_pos"],
                    "tokenizer_context_length": ctx + 1,
                }
            },
            SETTINGS_ATTR: settings_record(self.record),
        }
        attrs[NUMEL_ATTR] = self.mask.numel
        if s.save_metrics:
            attrs["metrics_numel"] = self.mask.numel
        if SETTINGS_ATTR not in root.attrs:
            root.update_attributes(attrs)
        for o in self.observed():
            _array(root, f"input_ids_{o.obs_id}")[...] = o.input_ids.numpy()

    # --------------------------------------------------------------- helpers
    def _order(self, chain: int) -> torch.Tensor:
        s = self.s
        seed = s.init_seed if s.match_sampling_input_ids_across_chains else s.init_seed + chain
        return _loader_order(self.data.shape[0], seed=seed, shuffle=s.shuffle)

    def _batch_rows(self, order: torch.Tensor, first: int, count: int) -> torch.Tensor:
        """Row indices of ``count`` consecutive batches from batch ``first`` (cycling)."""
        bs = self.s.batch_size
        idx = (torch.arange(first, first + count) % self.n_batches).repeat_interleave(bs)
        return order[idx * bs + torch.arange(bs).repeat(count)]

    def _forward_rows(self, model: nn.Module, ids: torch.Tensor, *, check: bool) -> torch.Tensor:
        """Per-token loss of every row of ``ids``, in forward passes of bounded size."""
        limit = _eval_rows(model, ids.shape[1], self.device)
        out = torch.empty(ids.shape[0], self.ctx, dtype=torch.float32)
        for sl in _chunks(ids.shape[0], limit):
            loss = self.loss_fn(model, ids[sl].to(self.device))
            if check:
                self._check_shape(loss, sl.stop - sl.start)
            out[sl] = loss.detach().float().cpu()
        return out

    def _check_shape(self, loss: torch.Tensor, rows: int) -> None:
        if tuple(loss.shape) != (rows, self.ctx):
            raise ValueError(
                f"`loss_fn` must return the per-token loss of shape {(rows, self.ctx)} for "
                f"input_ids of shape {(rows, self.ctx + 1)}, got {tuple(loss.shape)}."
            )

    def _reset(self, work: nn.Module) -> None:
        with torch.no_grad():
            for p, ref in zip(work.parameters(), self.model.parameters()):
                p.copy_(ref)

    # ------------------------------------------------------------ init loss
    def _init_key(self, threads: int) -> tuple[Any, ...]:
        """What decides :meth:`_init_loss`'s bits (:class:`SamplingCache`), less the chain."""
        s = self.s
        # The modules' settings (dropout rates, activations) too, beside the weights' digest.
        modules = hashlib.blake2b(repr(self.model).encode(), digest_size=8).hexdigest()
        return (
            self.record["model"],
            modules,
            self.record["dataset"],
            self.loss_fn,
            s.batch_size,
            s.gradient_accumulation_steps,
            s.num_init_loss_batches,
            s.init_seed,
            s.init_noise,
            s.shuffle,
            s.match_sampling_input_ids_across_chains,
            str(self.device),
            threads,
            self.threaded,
            # What the working copy engages (its modules, native or torch kernels).
            json.dumps(_fast_path_record(self.fast_path, self.work()), sort_keys=True),
        )

    def _record_fast_path(self, root: zarr.Group) -> None:
        """Add what this run's working copy engages to the store's :data:`FAST_PATH_ATTR`.

        A list with one entry per distinct record: a store resumed with another
        ``fast_path`` (or on a machine without the kernels) lists both.
        """
        entry = _fast_path_record(self.fast_path, self.work())
        stored = root.attrs.get(FAST_PATH_ATTR)
        runs = list(stored) if isinstance(stored, list) else []
        if entry not in runs:
            root.update_attributes({FAST_PATH_ATTR: [*runs, entry]})

    def _shared_init(self) -> bool:
        """Whether every chain takes one L(w*): same weights (no init noise), same batches."""
        return self.s.match_sampling_input_ids_across_chains and not self.s.init_noise

    @torch.inference_mode()
    def _init_loss(self, work: nn.Module, chain: int, cache: dict[int, np.ndarray]) -> np.ndarray:
        """L(w*) per position for ``chain`` (``[token_pos]``), refused when not finite.

        With :meth:`_shared_init` it is chain 0's (its dropout stream), whichever
        chain asks: a resumed run gives the uninterrupted run's bits.
        """
        s = self.s
        if self._shared_init():
            if cache:
                # Same weights, same batches: the same L(w*) (up to dropout's draws).
                return next(iter(cache.values()))
            chain = 0
        gen = self._generator(chain)
        self._reset(work)
        if s.init_noise:
            # devinterp: noise on every weight (ignoring the restriction) for L(w*).
            for p in work.parameters():
                p.add_(_randn(p, gen) * s.init_noise)
        count = s.gradient_accumulation_steps * s.num_init_loss_batches
        rows = self._batch_rows(self._order(chain), 0, count)
        work.train()
        with dropout_stream(gen), fast_kernels(self.fast_path != "off"):
            losses = self._forward_rows(work, self.data[rows], check=True)
        bad = ~torch.isfinite(losses).all(dim=1)
        if bool(bad.any()):
            where = sorted(set(rows[bad].tolist()))
            raise NonFiniteLossError(
                f"the initial loss L(w*) is NaN or infinite on {len(where)} sequences of "
                f"`dataset` (rows {where[:10]}{' ...' if len(where) > 10 else ''}) before any "
                "sampling step: the model's weights or `loss_fn` give a non-finite loss there; "
                "check the weights and loss_fn on these rows, or drop them from the data."
            )
        value = losses.double().mean(dim=0).float().numpy()
        cache[chain] = value
        return value

    # ---------------------------------------------------------------- chain
    def sample_chain(self, chain: int) -> tuple[int, dict[str, np.ndarray], str | None]:
        """Chain ``chain``: ``(chain, {array: the chain's rows}, failure message or None)``."""
        s = self.s
        work = self.work()
        failure: str | None = None
        bs, gas, ctx = s.batch_size, s.gradient_accumulation_steps, self.ctx
        gen = self._generator(chain)
        self._reset(work)
        masks = [self.mask[n] for n, _ in work.named_parameters()]
        chosen: list[torch.Tensor] = []
        per_param: list[torch.Tensor | None] = []
        for (_, p), m in zip(work.named_parameters(), masks):
            selected = bool(m.any())
            p.requires_grad_(selected)
            p.grad = None
            if selected:
                chosen.append(p)
                per_param.append(None if bool(m.all()) else m.to(p.device))
        restricted = any(sel is not None for sel in per_param)
        factory, kwargs = _factory_kwargs(s, per_param if restricted else None, self.sketch_dim)
        optimizer = factory(chosen, **kwargs)
        if s.init_noise:
            with torch.no_grad():
                for param, sel in zip(chosen, per_param):
                    noise = _randn(param, gen) * s.init_noise
                    param.add_(noise if sel is None else noise * sel)
        noise_gen = torch.Generator(device=self.device).manual_seed(_noise_seed(s.init_seed, chain))
        order = self._order(chain)
        steps, draws = s.num_steps, s.num_draws
        micro_loss = np.full((steps, gas * bs, ctx), np.nan, dtype=np.float32)
        micro_rows = np.zeros((steps, gas * bs), dtype=np.int64)
        draw_loss = np.full((draws, bs, ctx), np.nan, dtype=np.float32)
        obs_loss = [
            np.full((draws, o.n_samples, ctx), np.nan, dtype=np.float32) for o in self.observed()
        ]
        obs_ids = self._observable_ids()
        obs_split = np.cumsum([o.n_samples for o in self.obs])[:-1]
        fields = (*Metrics.NORM_FIELDS, *Metrics.DOT_FIELDS)
        metrics = np.full((steps, len(fields)), np.nan, dtype=np.float32)
        sketches = (
            np.full((steps, 5, self.sketch_dim), np.nan, dtype=np.float32)
            if self.sketch_dim is not None
            else None
        )
        work.train()

        def step_loss(step: int) -> torch.Tensor:
            """Forward and backward over the step's micro-batches: ``[batch, token_pos]`` loss."""
            rows = self._batch_rows(order, step * gas, gas)
            micro_rows[step] = rows.numpy()
            acc: torch.Tensor | None = None
            for j in range(gas):
                ids = self.data[rows[j * bs : (j + 1) * bs]].to(self.device)
                loss = self.loss_fn(work, ids)
                if step == 0 and j == 0:
                    self._check_shape(loss, bs)
                loss = loss.float()
                (loss.mean() / gas).backward()
                part = loss.detach() / gas
                acc = part if acc is None else acc + part
                micro_loss[step, j * bs : (j + 1) * bs] = loss.detach().cpu().numpy()
            assert acc is not None
            return acc

        def nonfinite(step: int, acc: torch.Tensor) -> NonFiniteLossError:
            bad = ~np.isfinite(micro_loss[step]).all(axis=1)
            where = sorted(set(micro_rows[step][bad].tolist()))
            cause = nonfinite_cause(step, s.lr) + (" on these rows" if step == 0 else "")
            return NonFiniteLossError(
                f"chain {chain}: the loss is NaN or infinite at step {step} on rows "
                f"{where[:10]} of `dataset`, {cause}"
            )

        def on_step(step: int, acc: torch.Tensor) -> None:
            if s.save_metrics:
                record = optimizer.get_metrics()
                metrics[step] = [float(getattr(record, f)) for f in fields]
            if sketches is not None:
                buf = optimizer.get_sketches()
                sketches[step] = torch.stack(list(buf.as_dict().values())).numpy()

        def on_draw(draw: int, step: int, acc: torch.Tensor) -> None:
            draw_loss[draw] = acc.cpu().numpy()
            if self.skipped_seeds is not None:
                # Not evaluated: its dropout seeds are drawn, so that the chain goes on as with it.
                skip_seeds(gen, self.skipped_seeds)
                return
            with torch.inference_mode():
                values = self._forward_rows(work, obs_ids, check=False).numpy()
            for buf_, part_ in zip(obs_loss, np.split(values, obs_split)):
                buf_[draw] = part_

        schedule = DrawSchedule(draws, s.num_burnin_steps, s.num_steps_bw_draws)
        try:
            with dropout_stream(gen), fast_kernels(self.fast_path != "off"):
                run_chain(
                    optimizer,
                    step_loss,
                    schedule,
                    noise_generator=noise_gen,
                    nonfinite_error=nonfinite,
                    on_step=on_step if s.save_metrics or sketches is not None else None,
                    on_draw=on_draw,
                    tick=self._tick,
                )
        except NonFiniteLossError as exc:
            # As devinterp: a failed chain warns (in the caller's process) and keeps NaN.
            failure = f"Chain failed: {exc}; its remaining draws are NaN."
        out: dict[str, np.ndarray] = {
            "sampling_loss": draw_loss[None],
            "sampling_loss_micro": micro_loss[None],
            "sampling_input_ids_micro": self.data.numpy()[micro_rows][None],
        }
        for o, buf_ in zip(self.observed(), obs_loss):
            out[f"loss_{o.obs_id}"] = buf_[None]
        if s.save_metrics:
            for i, f in enumerate(fields):
                out[f"metrics_{f}"] = metrics[None, :, i]
        if sketches is not None:
            names = ("scaled_grad", "unscaled_grad", "localization", "weight_decay", "noise")
            for i, q in enumerate(names):
                out[f"sketch_{q}"] = sketches[None, :, i]
        return chain, {k: v[0] for k, v in out.items()}, failure

    # ------------------------------------------------------------------ run
    def run(self) -> None:
        s = self.s
        root = zarr.open_group(str(self.path), mode="a")
        # With cores > 1 this process also runs on the workers' thread count, so
        # that init_loss too is the bits of cores=1 on that many threads.
        with threads_for(self.cores) as threads:
            self._decide_observables()
            self._layout(root)
            writer = _ChainWriter(root)
            done = np.asarray(_array(root, "progress/chain_done")[:], dtype=bool)
            todo = [c for c in range(s.num_chains) if not done[c]]
            parallel = self.cores > 1 and len(todo) > 1
            # Chains share this process when nothing they run draws from torch's
            # global generator (each has its own dropout stream); else processes.
            self.threaded = (
                parallel
                and self.device.type == "cpu"
                and not uses_global_generator(self.work(), self.loss_fn, self.data[:1])
            )
            self._record_fast_path(root)
            if parallel and not self.threaded:
                _check_picklable(self.loss_fn, self.cores)
                start_workers(self.cores, threads=threads)  # their imports overlap init_loss
            bar = tqdm(
                total=len(todo) * s.num_steps,
                desc="L(w*)",
                unit="step",
                disable=_hidden(self.progress),
            )
            try:
                init_done = np.asarray(_array(root, "progress/init_done")[:], dtype=bool)
                cache: dict[int, np.ndarray] = {}
                known = self._init_key(threads)
                shared = self._shared_init()
                if shared and init_done.any():
                    # Resuming: the stored L(w*), never one of another chain's dropout stream.
                    first = int(np.flatnonzero(init_done)[0])
                    stored = np.asarray(_array(root, "init_loss")[first], dtype=np.float32)
                    if np.isfinite(stored).all():
                        cache[first] = stored
                for chain in range(s.num_chains):
                    if not init_done[chain]:
                        key = (*known, 0 if shared else chain)
                        value = self.cache.init_losses.get(key)
                        if value is None:
                            value = self._init_loss(self.work(), chain, cache)
                            self.cache.init_losses[key] = value.copy()
                        writer.write(chain, {"init_loss": value}, "progress/init_done")
                bar.set_description("sampling")
                in_process = not parallel or self.threaded
                self._tick = _locked(bar.update) if in_process else None
                # Chains are written as they finish (in any order), each one's
                # data before its done flag, all from this thread.
                for chain, values, failure in run_jobs(
                    _sample_chain,
                    todo,
                    cores=self.cores,
                    shared=self,
                    threads=threads,
                    backend="threads" if self.threaded else "processes",
                ):
                    if failure is not None:
                        warnings.warn(failure, stacklevel=3)
                    writer.write(chain, values, "progress/chain_done")
                    if not in_process:
                        bar.update(s.num_steps)
            finally:
                bar.close()
                self._tick = None
                self.threaded = False
                writer.close()
        root.update_attributes({"completed": 1})


def _fast_path_record(fast_path: str, work: nn.Module) -> dict[str, Any]:
    """The store's ``gradsketch_fast_path`` entry: what was asked for, what engaged."""
    with fast_kernels(fast_path != "off"):
        return {"fast_path": fast_path, **engaged(work)}


def _hidden(progress: bool | None) -> bool | None:
    """The ``disable`` of tqdm for ``progress``: None leaves it to tqdm (off a terminal: hidden)."""
    return None if progress is None else not progress


def _check_picklable(loss_fn: LossFn, cores: int) -> None:
    """Refuse a ``loss_fn`` that worker processes cannot receive."""
    try:
        pickle.dumps(loss_fn)
    except Exception as exc:
        raise ValueError(
            f"`loss_fn`={loss_fn!r} cannot be sent to worker processes (cores={cores}; "
            f"its forward pass draws from torch's global generator, so chains cannot share "
            f"this process): {exc}; define it as a module-level function or pass cores=1."
        ) from exc


def _randn(param: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Standard normal noise shaped like ``param`` from ``gen`` (``randn_like`` takes none)."""
    return torch.randn(param.shape, generator=gen, dtype=param.dtype, device=param.device)


def _locked(fn: Callable[[int], Any]) -> Callable[[], None]:
    """``fn(1)`` under a lock (progress ticks from chains running in threads)."""
    lock = threading.Lock()

    def tick() -> None:
        with lock:
            fn(1)

    return tick


def _sample_chain(run: _Run, chain: int) -> tuple[int, dict[str, np.ndarray], str | None]:
    """:meth:`_Run.sample_chain` as a module-level function (worker processes call it)."""
    return run.sample_chain(chain)
