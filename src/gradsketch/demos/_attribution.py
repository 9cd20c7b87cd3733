"""The digits demo: TRAK end to end on a model trained in seconds.

``run_demo`` trains a few independently seeded MLPs on scikit-learn's bundled
digits, featurizes the training set with :class:`TRAKer`, scores held-out
test digits, checks the scores against ground truth with the linear
datamodeling score (LDS; Park et al., "TRAK: Attributing Model Behavior at
Scale", ICML 2023, section 2) and writes a gallery, a JSON summary and a
short report. ``gradsketch demo`` (and ``make demo``) call it.

LDS protocol: ``lds_models`` models are retrained from scratch on random
halves ``S_j`` of the training set; for each target ``t`` the Spearman
correlation over ``j`` between the predicted effect ``sum_{i in S_j}
score[i, t]`` and the retrained model's margin on ``t`` is averaged over
targets.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm

from gradsketch._checks import check_int, check_number
from gradsketch._plotting import new_figure, save_figure
from gradsketch.demos._digits import (
    ARCHITECTURES,
    DigitsSplit,
    TrainSettings,
    accuracy,
    build_model,
    load_digits_split,
    make_loader,
    margins,
    replay_settings,
    train_digits_model,
)
from gradsketch.demos._errors import DemoSettingsError

logger = logging.getLogger(__name__)

#: Name of the TRAK experiment the demo scores.
EXPERIMENT = "digits_test"

#: Sizes ``run_demo(quick=True)`` uses: a smoke test of every step in seconds.
QUICK: dict[str, Any] = {
    "num_checkpoints": 2,
    "num_targets": 20,
    "lds_models": 5,
    "train": TrainSettings(epochs=5),
}

#: How the report names the LDS entries that are not TRAK dampings.
_METHOD_NAMES = {
    "ekfac": "EK-FAC influence",
    "replay": "replay metagradients through checkpoint 0's run, its targets",
    "ekfac_replay_targets": "EK-FAC influence, the replay's targets",
}

#: Test digits shown in the gallery and proponents / opponents per digit.
GALLERY_ROWS = 6
GALLERY_TOP = 5


@dataclass(frozen=True)
class DemoSettings:
    """Everything that determines a demo run (saved in ``summary.json``).

    Attributes:
        num_checkpoints: independently trained models TRAK ensembles over.
        num_targets: test digits scored (at most the 359 test images).
        lds_models: models retrained on random halves for the LDS.
        proj_dim: projection size k. Kept below the 1,438 training rows so
            ``Phi^T Phi`` is invertible at ``lambda_reg=0``.
        lambda_reg: ridge term for ``Phi^T Phi``; a float or ``"auto"``.
        report_auto: also run ``lambda_reg="auto"`` and report its LDS.
        report_ekfac: also attribute with EK-FAC influence
            (``TRAKer(method="ekfac")``, damping ``"auto"``) and report its LDS.
        report_replay: also attribute by exact metagradients through the
            first checkpoint's training run (``TRAKer(method="replay")``,
            MAGIC), write its gallery and report its LDS. Off by default: it
            costs several training runs (minutes on two cores).
        replay_targets: test digits the replay scores (the first ones; its
            reverse pass grows with them); its LDS, and EK-FAC's beside it,
            are over these.
        replay_linearize_at: the data weight at which the replay trains and
            differentiates (``ReplaySettings.linearize_at``): 0.25, below the
            centre (0.5) of the random halves the LDS retrains on, where this
            run's metagradients predict those retrains best (both same-run
            and fresh-seed; ``benchmarks/RESULTS.md``).
        seed: seeds the split, the checkpoints, the projector and the subsets.
        arch: ``"mlp"`` (64-256-256-10) or ``"cnn"``.
        batch_size: rows per featurize / score call.
        train: optimiser settings of every trained model.
    """

    num_checkpoints: int = 3
    num_targets: int = 100
    lds_models: int = 30
    proj_dim: int = 512
    lambda_reg: float | str = 0.0
    report_auto: bool = True
    report_ekfac: bool = True
    report_replay: bool = False
    replay_targets: int = 16
    replay_linearize_at: float = 0.25
    seed: int = 0
    arch: str = "mlp"
    batch_size: int = 256
    train: TrainSettings = field(default_factory=TrainSettings)

    def __post_init__(self) -> None:
        for name, low in (
            ("num_checkpoints", 1),
            ("num_targets", 1),
            ("lds_models", 3),
            ("replay_targets", 1),
            ("proj_dim", 1),
            ("batch_size", 1),
        ):
            check_int(
                name,
                getattr(self, name),
                low=low,
                fix=f"the default is {getattr(DemoSettings, name)!r}",
                error=DemoSettingsError,
            )
        check_int("seed", self.seed, error=DemoSettingsError)
        if self.arch not in ARCHITECTURES:
            allowed = ", ".join(repr(a) for a in sorted(ARCHITECTURES))
            raise DemoSettingsError(
                f"`arch` must be one of {allowed}, got {self.arch!r}; pick one of those."
            )
        fix = "pass e.g. lambda_reg=0.0 or lambda_reg='auto'"
        check_number(
            "lambda_reg", self.lambda_reg, low=0, also=("auto",), fix=fix, error=DemoSettingsError
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready settings (the training settings nested)."""
        return dataclasses.asdict(self)


def run_demo(
    out_dir: str | Path,
    *,
    num_checkpoints: int = 3,
    num_targets: int = 100,
    lds_models: int = 30,
    proj_dim: int = 512,
    lambda_reg: float | str = 0.0,
    report_auto: bool = True,
    report_ekfac: bool = True,
    report_replay: bool = False,
    replay_targets: int = 16,
    seed: int = 0,
    arch: str = "mlp",
    batch_size: int = 256,
    train: TrainSettings | None = None,
    overwrite: bool = False,
    progress: bool = True,
    quick: bool = False,
) -> dict[str, Any]:
    """Train, attribute and evaluate on digits; write a gallery and a summary.

    Steps: split the bundled digits; train ``num_checkpoints`` models with
    seeds ``seed, seed + 1, ...``; featurize every training digit with
    :class:`TRAKer` per checkpoint; score ``num_targets`` test digits; retrain
    ``lds_models`` models on random halves and compute the LDS of the scores
    (and of ``lambda_reg="auto"``'s when ``report_auto``).

    Writes to ``out_dir``: ``gallery.png`` (6 test digits, each with its
    top-5 proponents and opponents and their scores), ``scores.npy``
    (``[n_train, num_targets]``; ``scores_auto.npy`` for ``"auto"``),
    ``summary.json`` (settings, timings, accuracies, LDS) and the TRAK store
    under ``trak_store/``.

    Args:
        out_dir: output folder (created if missing).
        num_checkpoints: independently trained models (>= 3 for the real demo).
        num_targets: test digits to score (>= 100 for the real demo).
        lds_models: retrained models for the LDS (>= 30 for the real demo).
        proj_dim: projection size k.
        lambda_reg: ridge term for the TRAK inverse (TRAKer's default 0.0).
        report_auto: also score with ``lambda_reg="auto"`` and report its LDS.
        report_ekfac: also attribute with EK-FAC influence and report its LDS.
        report_replay: also attribute by metagradients through checkpoint
            0's run (``TRAKer(method="replay")``): ``gallery_replay.png``,
            ``scores_replay.npy`` and its LDS on the same retrained halves.
        replay_targets: how many of the targets (the first) the replay
            scores; EK-FAC's LDS on the same targets is reported beside.
        seed: master seed.
        arch: ``"mlp"`` or ``"cnn"``.
        batch_size: rows per featurize / score call.
        train: optimiser settings; defaults to :class:`TrainSettings()`.
        overwrite: replace an earlier run in ``out_dir`` made with other
            settings (a rerun with the same settings always replaces it).
        progress: show tqdm progress bars.
        quick: smoke-test sizes (:data:`QUICK`: 2 checkpoints, 20 targets,
            5 LDS models, 5 epochs), replacing those four arguments.

    Returns:
        The summary (also in ``summary.json``); ``summary["report"]`` is a
        short text report for printing.

    Raises:
        DemoSettingsError: for invalid settings, or when ``out_dir`` holds a
            run made with different settings and ``overwrite`` is False.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:  # doctest: +SKIP
        ...     print(run_demo(d, num_targets=10, lds_models=5)["report"])
    """
    sizes: dict[str, Any] = {
        "num_checkpoints": num_checkpoints,
        "num_targets": num_targets,
        "lds_models": lds_models,
        "train": TrainSettings() if train is None else train,
    }
    if quick:
        sizes.update(QUICK)
    settings = DemoSettings(
        proj_dim=proj_dim,
        lambda_reg=lambda_reg,
        report_auto=report_auto,
        report_ekfac=report_ekfac,
        report_replay=report_replay,
        replay_targets=replay_targets,
        seed=seed,
        arch=arch,
        batch_size=batch_size,
        **sizes,
    )
    out = Path(out_dir)
    _claim_out_dir(out, settings, overwrite=overwrite)
    timings: dict[str, float] = {}
    start = time.perf_counter()

    with _timed(timings, "data"):
        split = load_digits_split(seed=settings.seed)
    if settings.num_targets > split.n_test:
        raise DemoSettingsError(
            f"`num_targets`={settings.num_targets} exceeds the {split.n_test} test digits; "
            f"pass num_targets <= {split.n_test}."
        )
    x_target = split.x_test[: settings.num_targets]
    y_target = split.y_test[: settings.num_targets]

    with _timed(timings, "train_checkpoints"):
        checkpoints, accuracies = train_checkpoints(split, settings, progress=progress)

    scores, trak_timings = attribute_digits(
        checkpoints,
        split,
        settings,
        save_dir=out / "trak_store",
        lambda_reg=settings.lambda_reg,
        progress=progress,
        fresh=True,
    )
    timings.update(trak_timings)
    np.save(out / "scores.npy", scores)

    with _timed(timings, "lds_retrain"):
        masks, outputs = digits_lds_ground_truth(
            split, x_target, y_target, settings, progress=progress
        )
    # Each LDS with its bootstrap interval over the retrained models (30 retrains
    # leave it ±0.03-0.07); the replay's lead over EK-FAC is paired on the same
    # targets and retrains.
    lds: dict[str, float] = {}
    lds_ci95: dict[str, list[float]] = {}

    def evaluate(key: str, value: np.ndarray, truth: np.ndarray) -> None:
        lds[key], lds_ci95[key] = _lds_with_interval(value, masks, truth)

    evaluate(_lambda_key(settings.lambda_reg), scores, outputs)

    with_auto = settings.report_auto and settings.lambda_reg != "auto"
    if with_auto:
        auto_scores, auto_timings = attribute_digits(
            checkpoints,
            split,
            settings,
            save_dir=out / "trak_store",
            lambda_reg="auto",
            progress=progress,
            fresh=False,
            exp_name=EXPERIMENT + "_auto",
        )
        timings["attribution_auto_total"] = sum(auto_timings.values())
        np.save(out / "scores_auto.npy", auto_scores)
        evaluate("auto", auto_scores, outputs)

    candidates = {_lambda_key(settings.lambda_reg): scores}
    if with_auto:
        candidates["auto"] = auto_scores
    if settings.report_ekfac:
        ekfac_scores, ekfac_timings = attribute_digits(
            checkpoints,
            split,
            settings,
            save_dir=out / "ekfac_store",
            lambda_reg="auto",
            progress=progress,
            fresh=True,
            method="ekfac",
        )
        timings["attribution_ekfac_total"] = sum(ekfac_timings.values())
        np.save(out / "scores_ekfac.npy", ekfac_scores)
        evaluate("ekfac", ekfac_scores, outputs)
        candidates["ekfac"] = ekfac_scores
    same_label = {
        key: top_share_same_label(value, split.y_train, y_target, GALLERY_TOP)
        for key, value in candidates.items()
    }
    if settings.report_replay:
        # Checkpoint 0's own run, replayed from its initialization by the same TRAK loop.
        init = build_model(settings.arch, seed=settings.seed).state_dict()
        r = min(settings.replay_targets, settings.num_targets)
        replay_scores, replay_timings = attribute_digits(
            [init],
            split,
            dataclasses.replace(settings, num_targets=r),
            save_dir=out / "replay_store",
            lambda_reg=0.0,
            progress=progress,
            fresh=True,
            method="replay",
        )
        timings["attribution_replay_total"] = sum(replay_timings.values())
        np.save(out / "scores_replay.npy", replay_scores)
        evaluate("replay", replay_scores, outputs[:, :r])
        if settings.report_ekfac:
            evaluate("ekfac_replay_targets", ekfac_scores[:, :r], outputs[:, :r])
            _, lds_ci95["replay_minus_ekfac"] = _lds_with_interval(
                replay_scores, masks, outputs[:, :r], baseline=ekfac_scores[:, :r]
            )
        same_label["replay"] = top_share_same_label(
            replay_scores, split.y_train, y_target[:r], GALLERY_TOP
        )
        with _timed(timings, "gallery_replay"):
            write_gallery(
                out / "gallery_replay.png",
                replay_scores,
                split,
                gallery_rows(y_target[:r], GALLERY_ROWS),
                top=GALLERY_TOP,
            )

    # The gallery shows the scores the LDS validates best, so the picture a
    # user sees is the most trustworthy attribution the run produced.
    gallery_key = max(candidates, key=lambda key: lds[key])
    gallery_scores = candidates[gallery_key]
    with _timed(timings, "gallery"):
        rows = gallery_rows(y_target, GALLERY_ROWS)
        write_gallery(out / "gallery.png", gallery_scores, split, rows, top=GALLERY_TOP)
    timings["total"] = time.perf_counter() - start

    summary: dict[str, Any] = {
        "settings": settings.to_dict(),
        "n_train": split.n_train,
        "n_targets": settings.num_targets,
        "num_params": sum(p.numel() for p in build_model(settings.arch).parameters()),
        "checkpoint_test_accuracy": accuracies,
        "lds": lds,
        "lds_ci95": lds_ci95,
        f"top{GALLERY_TOP}_same_label": same_label,
        "gallery_lambda_reg": gallery_key,
        "timings_s": {k: round(v, 3) for k, v in timings.items()},
        "files": {
            "gallery": str(out / "gallery.png"),
            "scores": str(out / "scores.npy"),
            **({"scores_auto": str(out / "scores_auto.npy")} if with_auto else {}),
            **({"scores_ekfac": str(out / "scores_ekfac.npy")} if settings.report_ekfac else {}),
            **(
                {
                    "gallery_replay": str(out / "gallery_replay.png"),
                    "scores_replay": str(out / "scores_replay.npy"),
                }
                if settings.report_replay
                else {}
            ),
            "summary": str(out / "summary.json"),
        },
    }
    summary["report"] = format_report(summary)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    logger.info("demo finished in %.1f s; outputs in %s", timings["total"], out)
    return summary


def attribute_digits(
    checkpoints: list[dict[str, Tensor]],
    split: DigitsSplit,
    settings: DemoSettings,
    *,
    save_dir: Path,
    lambda_reg: float | str,
    progress: bool = True,
    fresh: bool = True,
    exp_name: str = EXPERIMENT,
    method: str = "trak",
) -> tuple[np.ndarray, dict[str, float]]:
    """Run the TRAKer pipeline on digits checkpoints.

    The store keeps each checkpoint's projected gradients and ``XᵀX``, and
    ``lambda_reg`` only enters at scoring time, so a second damping reuses
    the store (``fresh=False``, another ``exp_name``): featurizing skips the
    stored rows and only the targets are scored again.

    Args:
        checkpoints: state dicts of models built by ``build_model(settings.arch)``.
        split: the digits split; all training rows are featurized.
        settings: demo settings (``proj_dim``, ``batch_size``, ``num_targets``).
        save_dir: TRAK store folder.
        lambda_reg: ridge term passed to :class:`TRAKer`.
        progress: show progress bars.
        fresh: delete ``save_dir`` first (the demo owns it), so timings
            measure a full run.
        exp_name: TRAK experiment name of the targets.
        method: ``TRAKer``'s ``method`` (``"trak"``, or ``"ekfac"`` etc. for
            curvature-aware influence; those need a ``save_dir`` of their own).
            ``"replay"``: ``checkpoints`` is the one run's initialization and
            the TRAKer replays :func:`train_model`'s loop from it
            (:func:`replay_settings`); ``proj_dim`` and ``lambda_reg`` are
            not used.

    Returns:
        ``(scores [n_train, num_targets], timings)`` with timings for
        featurize, finalize_features, score and finalize_scores.
    """
    from gradsketch.attribution import TRAKer

    if fresh and save_dir.exists():
        shutil.rmtree(save_dir)
    timings: dict[str, float] = {}
    features: dict[str, Any] = {
        "proj_dim": settings.proj_dim,
        "use_half_precision": False,
        "projector_seed": settings.seed,
        "lambda_reg": lambda_reg,
    }
    if method == "replay":
        run = replay_settings(split.n_train, settings.train, seed=settings.seed)
        # The figures in summary.json were measured with the full-batch normalization.
        run = dataclasses.replace(
            run, linearize_at=settings.replay_linearize_at, subset_loss="full_batch"
        )
        features = {"replay": run}
    traker = TRAKer(
        model=build_model(settings.arch, seed=settings.seed),
        task="image_classification",
        train_set_size=split.n_train,
        save_dir=str(save_dir),
        load_from_save_dir=True,
        device="cpu",
        logging_level=logging.WARNING,
        progress=progress,
        method=method,
        **features,
    )
    train_loader = make_loader(split.x_train, split.y_train, batch_size=settings.batch_size)
    target_loader = make_loader(
        split.x_test[: settings.num_targets],
        split.y_test[: settings.num_targets],
        batch_size=settings.batch_size,
    )
    label = f"lambda={lambda_reg}" if method == "trak" else method
    with _timed(timings, "featurize"):
        bar = tqdm(
            total=len(checkpoints) * split.n_train,
            desc=f"featurize ({label})",
            unit="ex",
            disable=not progress,
        )
        for model_id, ckpt in enumerate(checkpoints):
            traker.load_checkpoint(ckpt, model_id=model_id)
            for batch in train_loader:
                traker.featurize(batch=batch, num_samples=len(batch[0]))
                bar.update(len(batch[0]))
        bar.close()
    with _timed(timings, "finalize_features"):
        traker.finalize_features()
    with _timed(timings, "score"):
        for model_id, ckpt in enumerate(
            tqdm(checkpoints, desc=f"score ({label})", unit="ckpt", disable=not progress)
        ):
            traker.start_scoring_checkpoint(
                exp_name=exp_name,
                checkpoint=ckpt,
                model_id=model_id,
                num_targets=settings.num_targets,
            )
            for batch in target_loader:
                traker.score(batch=batch, num_samples=len(batch[0]))
    with _timed(timings, "finalize_scores"):
        scores = to_numpy(traker.finalize_scores(exp_name=exp_name))
    return scores, timings


def digits_lds_ground_truth(
    split: DigitsSplit,
    x_target: Tensor,
    y_target: Tensor,
    settings: DemoSettings,
    *,
    progress: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Retrain on random halves of the training set; record the targets' margins.

    Uses :func:`gradsketch.attribution.lds_ground_truth` with seed
    ``settings.seed + 10_000`` (so the retrained models' seeds never collide
    with the checkpoints' ``seed, seed + 1, ...``): subset ``j`` has
    ``round(n_train / 2)`` rows drawn without replacement and model ``j`` is
    :func:`train_digits_model` on it with seed ``seed + 10_001 + j``.

    Returns:
        ``(subset_masks [lds_models, n_train] bool, margins [lds_models, n_targets])``.
    """
    from gradsketch.attribution import lds_ground_truth

    def train_fn(indices: np.ndarray, seed: int) -> torch.nn.Module:
        idx = torch.from_numpy(np.asarray(indices, dtype=np.int64))
        return train_digits_model(
            split.x_train[idx],
            split.y_train[idx],
            arch=settings.arch,
            seed=seed,
            settings=settings.train,
        )

    def eval_fn(model: torch.nn.Module) -> Tensor:
        return margins(model, x_target, y_target)

    truth = lds_ground_truth(
        train_fn,
        eval_fn,
        split.n_train,
        settings.lds_models,
        0.5,
        seed=settings.seed + 10_000,
        progress=progress,
    )
    return np.asarray(truth.subset_masks), np.asarray(truth.target_outputs)


def write_gallery(
    path: str | Path,
    scores: np.ndarray,
    split: DigitsSplit,
    rows: list[int],
    *,
    top: int = GALLERY_TOP,
) -> Path:
    """Plot test digits with their strongest proponents and opponents.

    Row ``r`` shows test digit ``rows[r]``, then the ``top`` training digits
    with the largest scores (proponents, green titles) and the ``top`` with
    the smallest (opponents, red titles), each titled with label and score.

    Args:
        path: PNG file to write.
        scores: ``[n_train, n_targets]`` attribution scores.
        split: the digits split (for the raw images and labels).
        rows: target columns to show.
        top: proponents and opponents per row.

    Returns:
        The written path.
    """
    cols = 1 + 2 * top
    fig, axes = new_figure(
        width=1.25 * cols, height=1.45 * len(rows), nrows=len(rows), ncols=cols, squeeze=False
    )
    for r, target in enumerate(rows):
        column = scores[:, target]
        order = np.argsort(column, kind="stable")
        proponents, opponents = order[::-1][:top], order[:top]
        _show(
            axes[r, 0],
            split.images_test[target],
            f"test #{target}\nlabel {int(split.y_test[target])}",
            "black",
        )
        for c, i in enumerate(proponents):
            _show(
                axes[r, 1 + c],
                split.images_train[i],
                f"{int(split.y_train[i])}: {column[i]:+.2g}",
                "tab:green",
            )
        for c, i in enumerate(opponents):
            _show(
                axes[r, 1 + top + c],
                split.images_train[i],
                f"{int(split.y_train[i])}: {column[i]:+.2g}",
                "tab:red",
            )
    axes[0, 1 + top // 2].annotate(
        "proponents (top scores)", (0.5, 1.55), xycoords="axes fraction", ha="center"
    )
    axes[0, 1 + top + top // 2].annotate(
        "opponents (lowest scores)", (0.5, 1.55), xycoords="axes fraction", ha="center"
    )
    fig.tight_layout()
    return save_figure(fig, path, dpi=90)


def format_report(summary: Mapping[str, Any]) -> str:
    """A few lines for the terminal: accuracy, LDS, timings, where the files are.

    Example:
        >>> print(format_report({"n_train": 10, "n_targets": 2, "lds": {"0.0": 0.3},
        ...     "checkpoint_test_accuracy": [0.9], "timings_s": {"total": 1.0},
        ...     "settings": {"num_checkpoints": 1, "proj_dim": 8, "lds_models": 3}}))
        gradsketch demo: TRAK on digits (10 training digits, 2 test digits scored)
          checkpoints: 1, test accuracy 0.900 (min 0.900)
          projection: k=8; LDS over 3 retrained half-data models
          LDS (lambda_reg=0.0): 0.300
          total time: 1.0 s
    """
    s = summary["settings"]
    acc = summary["checkpoint_test_accuracy"]
    lines = [
        f"gradsketch demo: TRAK on digits ({summary['n_train']} training digits, "
        f"{summary['n_targets']} test digits scored)",
        f"  checkpoints: {s['num_checkpoints']}, test accuracy {float(np.mean(acc)):.3f} "
        f"(min {min(acc):.3f})",
        f"  projection: k={s['proj_dim']}; LDS over {s['lds_models']} retrained half-data models",
    ]
    shares: Mapping[str, float] = next(
        (v for k, v in summary.items() if k.endswith("_same_label")), {}
    )
    intervals: Mapping[str, list[float]] = summary.get("lds_ci95", {})
    for key, value in summary["lds"].items():
        name = _METHOD_NAMES.get(key, f"lambda_reg={key}")
        interval = (
            f" [{intervals[key][0]:.2f}, {intervals[key][1]:.2f}]" if key in intervals else ""
        )
        share = (
            f"; top-{GALLERY_TOP} proponents share the label {shares[key]:.0%}"
            if key in shares
            else ""
        )
        lines.append(f"  LDS ({name}): {value:.3f}{interval}{share}")
    if "replay_minus_ekfac" in intervals and {"replay", "ekfac_replay_targets"} <= set(
        summary["lds"]
    ):
        diff = summary["lds"]["replay"] - summary["lds"]["ekfac_replay_targets"]
        low, high = intervals["replay_minus_ekfac"]
        lines.append(
            f"  replay minus EK-FAC on the replay's targets: {diff:+.3f} [{low:.2f}, {high:.2f}]"
        )
    if intervals:
        lines.append("  [ ]: bootstrap 95 % intervals over the retrained models")
    timings = summary["timings_s"]
    phases = [
        k
        for k in ("train_checkpoints", "featurize", "finalize_features", "score", "lds_retrain")
        if k in timings
    ]
    if phases:
        lines.append("  time: " + ", ".join(f"{k} {timings[k]:.1f} s" for k in phases))
    lines.append(f"  total time: {timings['total']:.1f} s")
    if "files" in summary:
        lines.append(
            f"  gallery: {summary['files']['gallery']} ({summary.get('gallery_lambda_reg', '?')})"
        )
        if "gallery_replay" in summary["files"]:
            lines.append(f"  replay gallery: {summary['files']['gallery_replay']}")
        lines.append(f"  summary: {summary['files']['summary']}")
    return "\n".join(lines)


def to_numpy(scores: Any) -> np.ndarray:
    """Scores as an in-memory float64 numpy array (from torch, numpy, memmap or zarr)."""
    if isinstance(scores, Tensor):
        return scores.detach().cpu().double().numpy()
    return np.asarray(scores[...] if hasattr(scores, "shape") else scores, dtype=np.float64)


def train_checkpoints(
    split: DigitsSplit, settings: DemoSettings, *, progress: bool
) -> tuple[list[dict[str, Tensor]], list[float]]:
    """The demo's independently trained models and their test accuracies.

    Model ``i`` is :func:`train_digits_model` with seed ``settings.seed + i``;
    there are ``settings.num_checkpoints`` of them.
    """
    checkpoints, accuracies = [], []
    for i in tqdm(
        range(settings.num_checkpoints),
        desc="train checkpoints",
        unit="model",
        disable=not progress,
    ):
        model = train_digits_model(
            split.x_train,
            split.y_train,
            arch=settings.arch,
            seed=settings.seed + i,
            settings=settings.train,
        )
        checkpoints.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        accuracies.append(round(accuracy(model, split.x_test, split.y_test), 4))
    return checkpoints, accuracies


def top_share_same_label(
    scores: np.ndarray, train_labels: Tensor, target_labels: Tensor, top: int
) -> float:
    """Fraction of each target's ``top`` proponents (highest scores) that share its label.

    Example:
        >>> s = np.array([[3.0, 0.0], [2.0, 1.0], [1.0, 2.0]])  # [n_train, n_targets]
        >>> top_share_same_label(s, torch.tensor([0, 0, 1]), torch.tensor([0, 1]), 2)
        0.75
    """
    order = np.argsort(-np.asarray(scores), axis=0, kind="stable")[:top]  # [top, m]
    labels = np.asarray(train_labels)[order]
    return float((labels == np.asarray(target_labels)[None, :]).mean())


def _lds_with_interval(
    scores: np.ndarray, masks: np.ndarray, outputs: np.ndarray, baseline: np.ndarray | None = None
) -> tuple[float, list[float]]:
    """The LDS (minus ``baseline``'s) and its bootstrap 95 % interval ``[low, high]``."""
    from gradsketch.attribution import linear_datamodeling_interval

    est, low, high = linear_datamodeling_interval(scores, masks, outputs, baseline_scores=baseline)
    return round(est, 4), [round(low, 4), round(high, 4)]


def _lambda_key(value: float | str) -> str:
    return str(value)


def gallery_rows(labels: Tensor, count: int) -> list[int]:
    """First target of each of ``count`` different classes (fewer targets: first ones)."""
    rows: list[int] = []
    seen: set[int] = set()
    for i, y in enumerate(labels.tolist()):
        if y not in seen:
            rows.append(i)
            seen.add(y)
        if len(rows) == count:
            return rows
    extra = [i for i in range(len(labels)) if i not in rows]
    return (rows + extra)[: min(count, len(labels))]


def _show(ax: Any, image: np.ndarray, title: str, color: str) -> None:
    ax.imshow(image, cmap="gray_r", vmin=0, vmax=16)
    ax.set_title(title, fontsize=8, color=color)
    ax.set_xticks([])
    ax.set_yticks([])
    for spine in ax.spines.values():
        spine.set_edgecolor(color)


def _claim_out_dir(out: Path, settings: DemoSettings, *, overwrite: bool) -> None:
    """Refuse to mix a new run with one made under other settings."""
    summary_path = out / "summary.json"
    if summary_path.exists() and not overwrite:
        try:
            previous = json.loads(summary_path.read_text()).get("settings")
        except (OSError, json.JSONDecodeError):
            previous = None
        current = json.loads(json.dumps(settings.to_dict()))
        if previous is not None:
            # Fields added since that run was written take their defaults.
            defaults = json.loads(json.dumps(DemoSettings().to_dict()))
            previous = {**{k: v for k, v in defaults.items() if k not in previous}, **previous}
        if previous is not None and previous != current:
            raise DemoSettingsError(
                f"`out_dir` {str(out)!r} holds a demo run with other settings.\n"
                f"  stored:    {json.dumps(previous, sort_keys=True)}\n"
                f"  requested: {json.dumps(current, sort_keys=True)}\n"
                "Pick another out_dir or pass overwrite=True to replace it."
            )
    out.mkdir(parents=True, exist_ok=True)


@contextmanager
def _timed(timings: dict[str, float], name: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    timings[name] = time.perf_counter() - start
