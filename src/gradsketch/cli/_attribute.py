"""``gradsketch attribute CONFIG.py``: the TRAK pipeline on a user's own model.

A config is a small Python file (run with importlib, like a settings module)
that defines:

==================  ========  ================================================
name                required  meaning
==================  ========  ================================================
``model``           one of    an ``nn.Module`` whose state dicts the
``build_model()``             checkpoints are (or a function returning one)
``checkpoints``     yes       list of state dicts or paths to ``torch.save``-d
                              state dicts, one per independently trained model
                              (``method = "replay"``: optional, the one state
                              the run starts from; default the model's own)
``train_loader``    yes       iterable of training batches, in row order
``target_loader``   yes       iterable of target batches, in row order
``task``            yes       ``"image_classification"``,
                              ``"text_classification"`` or an
                              ``AbstractModelOutput`` instance
``proj_dim``        no        projection size (default 2048)
``lambda_reg``      no        ridge term, a float or ``"auto"`` (default 0.0)
``train_set_size``  no        rows of ``train_loader`` (default: the length of
                              its ``dataset``)
``num_targets``     no        rows of ``target_loader`` (default likewise)
``projector_seed``  no        seed of the projection (default 0)
``device``          no        torch device (default ``"cpu"``)
``memory_budget``   no        bytes of working memory for the finalize steps
                              (default ``None``: unbounded)
``method``          no        ``"trak"`` (default), ``"identity"``,
                              ``"kfac"``, ``"ekfac"``, a registered
                              preconditioner (``TRAKer(method=...)``) or
                              ``"replay"``: exact metagradients through a
                              training run the CLI trains and replays
``replay``          replay    how that run trains: a ``ReplaySettings`` or a
                              dict of its fields (optimizer, lr, num_steps,
                              batch_size, seed, ...); the rows are
                              ``train_loader``'s
``curvature``       no        per-layer methods: ``"loss"`` (default),
                              ``"output"`` or ``"sampled"``
``gradients``       no        ``"vmap"`` (per-example gradients by
                              ``torch.func``, count-sketched; the default) or
                              ``"hooks"`` (per-example gradients from one
                              hooked forward and backward; the same
                              count sketch)
==================  ========  ================================================

Outputs in ``out_dir``: ``scores.npy`` (``[train_set_size, num_targets]``
float32), ``summary.json`` (settings, timings, the strongest proponents of
the first targets) and the resumable TRAK store under ``trak_store/``: a
rerun after an interruption featurizes only the rows that are missing. When
the score matrix is larger than ``memory_budget`` it is never loaded into
memory: it stays in the zarr array ``trak_store/scores/targets`` (no
``scores.npy``), and the summary and report say so. With ``method =
"replay"`` the store is the replay's (``trak_store/replay/``, resumable in
the same way) and the run is trained once, from the checkpoint, on every
row of ``train_loader``; the options of projected features (``proj_dim``,
``lambda_reg``, ``projector_seed``, ``gradients``, ``curvature``) are refused.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch
import zarr
from torch import Tensor, nn
from tqdm.auto import tqdm

from gradsketch import _config
from gradsketch._checks import check_int, check_number, positive_int
from gradsketch._device import to_device
from gradsketch.attribution import REPLAY_UNUSED_ARGUMENTS as WHY_NOT_USED
from gradsketch.attribution import (
    AbstractGradientComputer,
    FunctionalGradientComputer,
    HookGradientComputer,
)
from gradsketch.cli._paths import check_folder, output_folder, write_summary
from gradsketch.demos import to_numpy
from gradsketch.errors import ConfigError

logger = logging.getLogger(__name__)

#: Names every config must define.
REQUIRED_NAMES: tuple[str, ...] = ("checkpoints", "train_loader", "target_loader", "task")
#: One of these must be defined.
MODEL_NAMES: tuple[str, ...] = ("model", "build_model")
#: Optional names and their defaults (``None``: derived from the loaders).
OPTIONAL_DEFAULTS: dict[str, Any] = {
    "proj_dim": 2048,
    "lambda_reg": 0.0,
    "train_set_size": None,
    "num_targets": None,
    "projector_seed": 0,
    "device": "cpu",
    "memory_budget": None,
    "gradients": "vmap",
    "method": "trak",
    "curvature": "loss",
}

#: Config names that do not apply to ``method = "replay"``, and why (TRAKer's reasons for
#: the arguments they set).
REPLAY_REFUSED: dict[str, str] = {
    name: WHY_NOT_USED[arg]
    for name, arg in {
        "proj_dim": "proj_dim",
        "projector_seed": "projector_seed",
        "lambda_reg": "lambda_reg",
        "gradients": "gradient_computer",
        "curvature": "curvature",
    }.items()
}

#: Values of the config's ``gradients`` name and the gradient computers they pick.
GRADIENTS: dict[str, type[AbstractGradientComputer]] = {
    "vmap": FunctionalGradientComputer,
    "hooks": HookGradientComputer,
}

#: TRAK experiment name used for the config's targets.
EXPERIMENT = "targets"

#: Targets whose top proponents are listed in ``summary.json``.
SUMMARY_TARGETS = 10
SUMMARY_TOP = 5


@dataclass(frozen=True)
class AttributeSettings:
    """The numeric settings read from a config (saved in ``summary.json``).

    Attributes:
        proj_dim: projection size k.
        lambda_reg: ridge term, a float >= 0 or ``"auto"``.
        train_set_size: number of training rows.
        num_targets: number of target rows.
        projector_seed: seed of the projection.
        device: torch device name.
        memory_budget: bytes of working memory for the finalize steps
            (``None``: unbounded); larger score matrices stay on disk.
        gradients: ``"vmap"`` or ``"hooks"`` (see :data:`GRADIENTS`).
        method: the attribution method (``TRAKer``'s ``method``).
        curvature: per-layer methods' curvature (``TRAKer``'s ``curvature``).
        replay: with ``method="replay"``, the run's
            :class:`~gradsketch.attribution.ReplaySettings` (``None`` otherwise).
    """

    proj_dim: int
    lambda_reg: float | str
    train_set_size: int
    num_targets: int
    projector_seed: int = 0
    device: str = "cpu"
    memory_budget: int | None = None
    gradients: str = "vmap"
    method: str = "trak"
    curvature: str = "loss"
    replay: Any = None

    def __post_init__(self) -> None:
        from gradsketch.attribution import CURVATURE_PRECONDITIONERS, CURVATURES, ReplaySettings

        methods = [*sorted(CURVATURE_PRECONDITIONERS), "replay"]
        if self.method not in methods:
            raise ConfigError(
                f"`method` must be one of {methods}, got {self.method!r}; "
                'set e.g. `method = "ekfac"` in the config, or leave it out.'
            )
        if self.method == "replay" and not isinstance(self.replay, ReplaySettings):
            raise ConfigError(
                f'`method = "replay"` needs `replay`, the run to train and replay, got '
                f'{self.replay!r}; set e.g. `replay = dict(optimizer="sgd", lr=0.1, '
                "num_steps=100, batch_size=32, seed=0)` or a ReplaySettings."
            )
        if self.method != "replay" and self.replay is not None:
            raise ConfigError(
                f'`replay` is the run of `method = "replay"`, but method is {self.method!r}; '
                'set `method = "replay"`, or drop `replay`.'
            )
        if self.curvature not in CURVATURES:
            raise ConfigError(
                f"`curvature` must be one of {list(CURVATURES)}, got {self.curvature!r}; "
                'set e.g. `curvature = "loss"` in the config, or leave it out.'
            )
        if self.gradients not in GRADIENTS:
            raise ConfigError(
                f"`gradients` must be one of {sorted(GRADIENTS)}, got {self.gradients!r}; "
                'set e.g. `gradients = "hooks"` in the config, or leave it out.'
            )
        for name in ("proj_dim", "train_set_size", "num_targets"):
            fix = f"set `{name} = ...` in the config"
            positive_int(name, getattr(self, name), fix=fix, error=ConfigError)
        fix = "set e.g. `projector_seed = 0` in the config"
        check_int("projector_seed", self.projector_seed, fix=fix, error=ConfigError)
        positive_int(
            "memory_budget",
            self.memory_budget,
            optional=True,
            fix="set a number of bytes, e.g. `memory_budget = 2 * 1024**3`, or leave it out",
            error=ConfigError,
        )
        fix = "set e.g. `lambda_reg = 0.0` in the config"
        check_number(
            "lambda_reg", self.lambda_reg, low=0, also=("auto",), fix=fix, error=ConfigError
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for JSON (the replay's settings as their stored record)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.replay is not None:
            out["replay"] = self.replay.record()
            for name in REPLAY_REFUSED:
                out.pop(name)
        else:
            out.pop("replay")
        return out


def load_config(config_path: str | Path) -> ModuleType:
    """Execute a config file and return it as a module.

    Args:
        config_path: path to a ``.py`` file.

    Returns:
        The executed module.

    Raises:
        ConfigError: if the file is missing or not a ``.py`` file.
    """
    return _config.load_config(config_path, template="examples/attribute_config.py")


def read_config(config: ModuleType | Mapping[str, Any]) -> dict[str, Any]:
    """Check a loaded config and resolve defaults.

    Args:
        config: a module from :func:`load_config` or a mapping of the same names.

    Returns:
        ``{"model", "checkpoints" (list of state dicts), "train_loader",
        "target_loader", "task", "settings" (AttributeSettings)}``.

    Raises:
        ConfigError: naming every missing name, or the one that is invalid.

    Example:
        >>> read_config({"model": nn.Linear(2, 2)})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        gradsketch.errors.ConfigError: the config does not define `checkpoints`, ...
    """
    names = dict(config) if isinstance(config, Mapping) else vars(config)
    replaying = names.get("method") == "replay"
    needed = [n for n in REQUIRED_NAMES if not (replaying and n == "checkpoints")]
    missing = [n for n in needed if n not in names]
    has_model = any(n in names for n in MODEL_NAMES)
    if missing or not has_model:
        absent = missing + ([] if has_model else [" or ".join(f"`{n}`" for n in MODEL_NAMES)])
        required = ", ".join(f"`{n}`" for n in needed)
        one_of = ", ".join(f"`{n}`" for n in MODEL_NAMES)
        listed = ", ".join(a if a.startswith("`") else f"`{a}`" for a in absent)
        raise ConfigError(
            f"the config does not define {listed}; required: {required} and one of {one_of}. "
            "See examples/attribute_config.py."
        )
    model = names["model"] if "model" in names else names["build_model"]()
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"`model` must be a torch.nn.Module, got {type(model).__name__}; define `model = "
            "MyNet()` or `def build_model(): return MyNet()`."
        )
    if replaying:
        checkpoints, replay = _replay_config(names, model)
    else:
        # A `replay` without the method is refused by AttributeSettings, naming the fix.
        checkpoints, replay = _load_checkpoints(names["checkpoints"]), names.get("replay")
    for name in ("train_loader", "target_loader"):
        if not isinstance(names[name], Iterable):
            raise ConfigError(
                f"`{name}` must be an iterable of batches (e.g. a DataLoader), got "
                f"{type(names[name]).__name__}."
            )
    options = {k: names.get(k, default) for k, default in OPTIONAL_DEFAULTS.items()}
    if options["train_set_size"] is None:
        options["train_set_size"] = _dataset_len("train_loader", names["train_loader"])
    if options["num_targets"] is None:
        options["num_targets"] = _dataset_len("target_loader", names["target_loader"])
    options["device"] = str(options["device"])
    options["replay"] = replay
    return {
        "model": model,
        "checkpoints": checkpoints,
        "train_loader": names["train_loader"],
        "target_loader": names["target_loader"],
        "task": names["task"],
        "settings": AttributeSettings(**options),
    }


def attribute_command(
    config_path: str | Path, out_dir: str | Path, *, progress: bool = True
) -> dict[str, Any]:
    """Run TRAK for the model, checkpoints and loaders a config file defines.

    Featurizes every training batch under every checkpoint, finalizes the
    features, scores every target batch and averages over checkpoints, as in
    :class:`TRAKer`. The store in ``out_dir/trak_store`` is reused, so an
    interrupted run resumes; a rerun with other settings is refused by the
    store, with both settings shown.

    Args:
        config_path: the config file (see this module's docstring for the names).
        out_dir: output folder, created if missing.
        progress: show tqdm progress bars.

    Returns:
        The summary written to ``summary.json``; ``summary["report"]`` is a
        short text for the terminal.

    Raises:
        ConfigError: for a missing or invalid config.

    Example:
        >>> attribute_command("no_such_config.py", "out")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        gradsketch.errors.ConfigFileError: `config_path` must be an existing .py file, ...
    """
    out = check_folder(out_dir)
    check_folder(out / "trak_store", name="save_dir")
    config = read_config(load_config(config_path))
    from gradsketch.attribution import TRAKer

    settings: AttributeSettings = config["settings"]
    out = output_folder(out)
    timings: dict[str, float] = {}
    start = time.perf_counter()

    common: dict[str, Any] = dict(
        model=config["model"],
        task=config["task"],
        train_set_size=settings.train_set_size,
        save_dir=str(out / "trak_store"),
        load_from_save_dir=True,
        device=settings.device,
        logging_level=logging.WARNING,
        progress=progress,
        memory_budget=settings.memory_budget,
        method=settings.method,
    )
    if settings.method == "replay":
        traker = TRAKer(**common, replay=settings.replay)
    else:
        traker = TRAKer(
            **common,
            gradient_computer=GRADIENTS[settings.gradients],
            proj_dim=settings.proj_dim,
            use_half_precision=False,
            projector_seed=settings.projector_seed,
            lambda_reg=settings.lambda_reg,
            curvature=settings.curvature,
        )
    checkpoints = config["checkpoints"]
    t0 = time.perf_counter()
    bar = tqdm(
        total=len(checkpoints) * settings.train_set_size,
        desc="featurize",
        unit="ex",
        disable=not progress,
    )
    for model_id, ckpt in enumerate(checkpoints):
        traker.load_checkpoint(ckpt, model_id=model_id)
        for batch, size in _batches(config, "train_loader", settings):
            traker.featurize(batch=batch, num_samples=size)
            bar.update(size)
    bar.close()
    timings["featurize"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    traker.finalize_features()
    timings["finalize_features"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    for model_id, ckpt in enumerate(
        tqdm(checkpoints, desc="score", unit="ckpt", disable=not progress)
    ):
        traker.start_scoring_checkpoint(
            exp_name=EXPERIMENT,
            checkpoint=ckpt,
            model_id=model_id,
            num_targets=settings.num_targets,
        )
        for batch, size in _batches(config, "target_loader", settings):
            traker.score(batch=batch, num_samples=size)
    timings["score"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    result = traker.finalize_scores(exp_name=EXPERIMENT)
    timings["finalize_scores"] = time.perf_counter() - t0
    on_disk = isinstance(result, zarr.Array)
    if on_disk:
        # Over the memory budget: the zarr array TRAKer wrote is the result.
        scores_path = Path(traker.save_dir) / "scores" / EXPERIMENT
        scores_where = f"zarr array {scores_path} (larger than memory_budget, kept on disk)"
        # A scores.npy from an earlier in-memory run would no longer match.
        (out / "scores.npy").unlink(missing_ok=True)
    else:
        scores_path = out / "scores.npy"
        scores_where = str(scores_path)
        np.save(scores_path, to_numpy(result).astype(np.float32))
    timings["total"] = time.perf_counter() - start

    shown = min(SUMMARY_TARGETS, int(result.shape[1]))
    # Only the first targets' columns are read (a small slice even on disk).
    head = np.asarray(result[:, :shown], dtype=np.float32)
    summary: dict[str, Any] = {
        "config": str(Path(config_path).resolve()),
        "settings": settings.to_dict(),
        "num_checkpoints": len(checkpoints),
        "scores_shape": [int(s) for s in result.shape],
        "scores_on_disk": on_disk,
        "timings_s": {k: round(v, 3) for k, v in timings.items()},
        "top_proponents": {
            str(t): np.argsort(-head[:, t], kind="stable")[:SUMMARY_TOP].tolist()
            for t in range(shown)
        },
        "files": {"scores": str(scores_path), "summary": str(out / "summary.json")},
    }
    if settings.method == "replay":
        how = (
            f"by replaying one run ({settings.replay.num_steps} {settings.replay.optimizer} steps)"
        )
    else:
        how = (
            f"with {len(checkpoints)} checkpoint(s) (method={settings.method}, "
            f"k={settings.proj_dim}, lambda_reg={settings.lambda_reg})"
        )
    return write_summary(
        out,
        summary,
        f"gradsketch attribute: scored {settings.num_targets} targets against "
        f"{settings.train_set_size} training rows {how} in {timings['total']:.1f} s",
        f"scores: {scores_where} {tuple(int(s) for s in result.shape)}",
    )


def batch_size(batch: Any) -> int:
    """Rows in a batch: a tensor, a tuple/list of tensors, or a dict of tensors.

    Example:
        >>> batch_size((torch.zeros(3, 2), torch.zeros(3)))
        3
    """
    first = batch
    if isinstance(batch, Mapping):
        first = next(iter(batch.values()))
    elif isinstance(batch, Sequence) and not isinstance(batch, Tensor):
        first = batch[0]
    if not isinstance(first, Tensor) or first.dim() == 0:
        raise ConfigError(
            f"batches must be tensors, tuples/lists of tensors or dicts of tensors with a leading "
            f"batch dimension; got a batch whose first entry is {type(first).__name__}."
        )
    return int(first.shape[0])


def _replay_config(
    names: Mapping[str, Any], model: nn.Module
) -> tuple[list[dict[str, Tensor]], Any]:
    """``method = "replay"``: the one start state and the run's :class:`ReplaySettings`.

    Refuses the names of projected features (:data:`REPLAY_REFUSED`), more than
    one checkpoint and a ``replay`` that is not settings.
    """
    from gradsketch.attribution import ReplaySettings

    refused = [n for n in REPLAY_REFUSED if n in names]
    if refused:
        why = "; ".join(f"`{n}`: {REPLAY_REFUSED[n]}" for n in refused)
        raise ConfigError(
            f'`method = "replay"` does not use {", ".join(f"`{n}`" for n in refused)} ({why}); '
            "remove them from the config."
        )
    value = names.get("replay")
    if isinstance(value, Mapping):
        try:
            value = ReplaySettings(**value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"`replay` is not valid ReplaySettings: {exc}") from exc
    if "checkpoints" in names:
        checkpoints = _load_checkpoints(names["checkpoints"])
        if len(checkpoints) != 1:
            raise ConfigError(
                f'`method = "replay"` trains one run, from one state, but `checkpoints` holds '
                f"{len(checkpoints)}; give the one the run starts from, or leave `checkpoints` "
                "out to start from the model's own weights."
            )
    else:
        checkpoints = [{k: v.detach().clone() for k, v in model.state_dict().items()}]
    return checkpoints, value


def _load_checkpoints(value: Any) -> list[dict[str, Tensor]]:
    if isinstance(value, str | Path | Mapping) or not isinstance(value, Sequence) or not value:
        raise ConfigError(
            f"`checkpoints` must be a non-empty list of state dicts or paths, got "
            f"{type(value).__name__}; e.g. `checkpoints = ['ckpt0.pt', 'ckpt1.pt']`."
        )
    loaded = []
    for i, item in enumerate(value):
        if isinstance(item, str | Path):
            path = Path(item)
            if not path.is_file():
                raise ConfigError(
                    f"`checkpoints[{i}]` is the path {str(path)!r}, which does not exist; "
                    "save state dicts with torch.save(model.state_dict(), path)."
                )
            item = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(item, Mapping):
            raise ConfigError(
                f"`checkpoints[{i}]` must be a state dict or a path to one, got "
                f"{type(item).__name__}."
            )
        loaded.append(dict(item))
    return loaded


def _dataset_len(name: str, loader: Any) -> int:
    dataset = getattr(loader, "dataset", None)
    try:
        return len(dataset)  # type: ignore[arg-type]
    except TypeError:
        target = "train_set_size" if name == "train_loader" else "num_targets"
        raise ConfigError(
            f"`{name}` has no sized `dataset`, so the number of rows is unknown; set "
            f"`{target} = ...` in the config."
        ) from None


def _batches(
    config: Mapping[str, Any], name: str, settings: AttributeSettings
) -> Iterator[tuple[Any, int]]:
    """The batches of loader ``name`` on the device, with their row counts (counts checked)."""
    expected = settings.train_set_size if name == "train_loader" else settings.num_targets
    seen = 0
    for batch in config[name]:
        size = batch_size(batch)
        _check_rows(name, seen + size, expected, partial=True)
        yield to_device(batch, settings.device), size
        seen += size
    _check_rows(name, seen, expected)


def _check_rows(name: str, seen: int, expected: int, *, partial: bool = False) -> None:
    """Refuse a loader that yields more (or, at its end, fewer) rows than declared."""
    if seen > expected or (not partial and seen != expected):
        target = "train_set_size" if name == "train_loader" else "num_targets"
        got = f"more than {expected}" if partial else str(seen)
        raise ConfigError(
            f"`{name}` yielded {got} rows but `{target}` is {expected}; set `{target}` to the "
            "loader's row count or make the loader yield every row exactly once (no shuffling, "
            "drop_last=False)."
        )
