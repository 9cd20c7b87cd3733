"""TRAK attribution, gradsketch vs traker on CPU: scoring, featurization, LDS.

Run ``python benchmarks/bench_attribution.py`` (``--section scoring``,
``featurize`` or ``lds`` for one part; ``--quick`` for a smoke run at small
sizes). Prints one JSON line per measurement; ratios compare numbers measured
in the same run. Needs the ``bench`` extra (``make bench-setup``: traker is
installed with ``--no-deps``; its modules used here do not import
torchvision, so no stub is needed).

Sections (``--section`` or ``--part``):

- scoring-kernel: traker's scoring (:data:`TRAKER_SCORING`),
  ``trak_scores`` and the float32 floor (:data:`FLOOR_SCOPE`) timed
  round-robin in one process on the same float32 data, at n, k, m =
  20,000 / 2,048 / 2,000, 20,000 / 2,048 / 256 and 50,000 / 1,024 / 512
  (``--shape N K M`` for one), on 1 and 2 threads (``--threads``): median
  wall and CPU seconds, speedup over traker, ratio to the floor, the scores'
  agreement, the ATen CPU capability and the load average. For AVX2-only
  kernels run it again under ``ATEN_CPU_CAPABILITY=avx2
  MKL_ENABLE_INSTRUCTIONS=AVX2 OPENBLAS_CORETYPE=Haswell`` (torch, MKL and
  SciPy's OpenBLAS each pick their kernels by themselves).
- pipeline: both TRAKers end to end after featurizing (:func:`bench_pipeline`):
  ``finalize_features`` and ``finalize_scores`` of two query sets, each
  phase timed, at the shapes of :data:`PIPELINE_SHAPES` (``--shape`` for one)
  and each ``--threads`` count.
- scoring: n training rows, k features, m targets (default 50,000 / 2,048 /
  5,000). traker's ``BasicScoreComputer`` phases (get_xtx, get_x_xtx_inv,
  get_scores, plus the out-to-loss weighting of ``finalize_scores``) against
  gradsketch's ``trak_scores``, each in a fresh process (peak RSS measured),
  median of repeats; scores compared after undoing traker's rescaling of the
  inverse by its mean absolute entry.
- featurize: examples/s of ``TRAKer.featurize`` on the digits MLP
  (64-256-256-10) and the small CNN at proj_dim 2,048: gradsketch's CPU
  default (per-example gradients by vmap, CountSketchProjector), gradsketch's
  layer hooks (``gradient_computer=HookGradientComputer``) with their default
  CountSketchProjector and with ``FactorizedProjector.from_budget(proj_dim)``,
  traker's CPU default (BasicProjector, block_size 100) and traker
  with one dense block; per-example gradients alone for both.
- lds: digits, 3 MLP checkpoints, proj_dim 512, LDS over retrained half-data
  models: traker vs gradsketch (lambda_reg=0 and "auto").
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median_time, run_isolated

from gradsketch.demos.protocols import emit, machine_info, setup_torch, time_once

QUIET = logging.WARNING


# -- scoring ----------------------------------------------------------------------


def _scoring_data(n: int, k: int, m: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=gen)
    t = torch.randn(m, k, generator=gen)
    q = torch.rand(n, generator=gen)
    return x, t, q


def scoring_traker(n: int, k: int, m: int, repeats: int, out_path: str) -> dict:
    """traker's BasicScoreComputer phases; saves ``c * scores`` (see module doc)."""
    setup_torch()
    from trak.score_computers import BasicScoreComputer

    x, t, q = _scoring_data(n, k, m)
    sc = BasicScoreComputer(dtype=torch.float32, device="cpu", logging_level=QUIET)
    timings = {}
    timings["get_xtx"] = median_time(lambda: sc.get_xtx(x), repeats, 0)
    xtx = sc.get_xtx(x)
    timings["get_x_xtx_inv"] = median_time(lambda: sc.get_x_xtx_inv(x, xtx), repeats, 0)
    features = sc.get_x_xtx_inv(x, xtx)
    acc = torch.zeros(n, m)

    def scores() -> None:
        acc.zero_()
        sc.get_scores(features, t, accumulator=acc)

    timings["get_scores"] = median_time(scores, repeats, 0)
    scores()
    # finalize_scores: mean over checkpoints (one here) times the mean Q.
    timings["weight_q"] = median_time(lambda: acc.numpy() * q.numpy()[:, None], repeats, 0)
    final = acc.numpy() * q.numpy()[:, None]
    # traker divides the inverse by its mean absolute entry; undo it.
    scale = float(torch.linalg.inv(xtx).abs().mean())
    np.save(out_path, final * scale)
    return timings


def scoring_gradsketch(
    n: int, k: int, m: int, repeats: int, out_path: str, precision: str = "float32"
) -> dict:
    """gradsketch's ``trak_scores`` on the same data."""
    setup_torch()
    from gradsketch.attribution import trak_scores

    x, t, q = _scoring_data(n, k, m)

    def run():
        return trak_scores(x, t, q, precision=precision)

    timings = {"trak_scores": median_time(run, repeats, 0)}
    np.save(out_path, run())
    return timings


def scoring_traker_pipeline(n: int, k: int, m: int, repeats: int) -> dict:
    """gradsketch TRAKer's finalize_features + finalize_scores at the same n, k, m.

    Features come from a bias-free ``Linear(k // 2, 4)`` (2k gradient
    coordinates, of rank 3k/2 since margin gradients of 4 classes span 3
    directions per input) sketched to k by the default projector, so the
    stored ``[n, k]`` and ``[m, k]`` matrices have the benchmark's sizes and
    full rank; featurizing is not timed.
    """
    setup_torch()
    timings: dict[str, list[float]] = {"finalize_features": [], "finalize_scores": []}
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            traker, model, x, y = _featurized_traker(n, k, tmp)
            timings["finalize_features"].append(time_once(traker.finalize_features)[0])
            _score_targets(traker, "bench", model, x, y, m)
            seconds, scores = time_once(functools.partial(traker.finalize_scores, "bench"))
            timings["finalize_scores"].append(seconds)
            assert tuple(scores.shape) == (n, m)
    return {phase: float(np.median(v)) for phase, v in timings.items()}


def bench_scoring(n: int, k: int, m: int, repeats: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ref_path, our_path = f"{tmp}/traker.npy", f"{tmp}/gradsketch.npy"
        ref = run_isolated("bench_attribution:scoring_traker", n, k, m, repeats, ref_path)
        ours = {}
        diffs = {}
        for precision in ("float32", "bf16x3"):
            ours[precision] = run_isolated(
                "bench_attribution:scoring_gradsketch", n, k, m, repeats, our_path, precision
            )
            diffs[precision] = _max_rel_diff(ref_path, our_path, n)
    pipeline = run_isolated("bench_attribution:scoring_traker_pipeline", n, k, m, repeats)
    ref_t = ref["result"]
    three = ref_t["get_xtx"] + ref_t["get_x_xtx_inv"] + ref_t["get_scores"]
    full = three + ref_t["weight_q"]
    emit(
        {
            "bench": "scoring",
            "impl": "traker.BasicScoreComputer",
            "n": n,
            "k": k,
            "m": m,
            **{f"{p}_s": v for p, v in ref_t.items()},
            "total_3_phases_s": three,
            "total_s": full,
            "peak_rss_mb": ref["peak_rss_mb"],
            "repeats": repeats,
        }
    )
    for precision, run in ours.items():
        seconds = run["result"]["trak_scores"]
        emit(
            {
                "bench": "scoring",
                "impl": f"gradsketch.trak_scores(precision={precision!r})",
                "n": n,
                "k": k,
                "m": m,
                "total_s": seconds,
                "speedup_vs_traker_3_phases": three / seconds,
                "speedup_vs_traker_total": full / seconds,
                "max_rel_diff": diffs[precision],
                "peak_rss_mb": run["peak_rss_mb"],
                "repeats": repeats,
            }
        )
    phases = pipeline["result"]
    total = phases["finalize_features"] + phases["finalize_scores"]
    emit(
        {
            "bench": "scoring",
            "impl": "gradsketch.TRAKer finalize_features + finalize_scores",
            "n": n,
            "k": k,
            "m": m,
            **{f"{p}_s": v for p, v in phases.items()},
            "total_s": total,
            "speedup_vs_traker_total": full / total,
            "peak_rss_mb": pipeline["peak_rss_mb"],
            "repeats": repeats,
        }
    )


#: traker's scoring as timed by ``--section scoring-kernel``: everything its
#: TRAKer does after featurization, minus disk I/O (``finalize_features`` is
#: get_xtx + get_x_xtx_inv, ``finalize_scores`` is get_scores + the
#: out-to-loss weighting; ``score`` only featurizes the targets).
TRAKER_SCORING = "BasicScoreComputer.get_xtx + get_x_xtx_inv + get_scores, then * Q"

#: ``(n_train, k, n_targets)`` of ``--section scoring-kernel``; the first is
#: the issue-48 workload (n = 20,000, k = 2,048, 2,000 targets).
KERNEL_SHAPES = ((20_000, 2048, 2_000), (20_000, 2048, 256), (50_000, 1024, 512))
KERNEL_SHAPES_QUICK = ((4_000, 512, 400), (8_000, 256, 128))

#: The float32 floor timed next to both: the two products no TRAK scorer can
#: skip, at the best speed this machine's BLAS gives them.
FLOOR_SCOPE = "scipy BLAS ssyrk for XᵀX + one torch.mm [n, k] x [k, m] for the scores"


def bench_scoring_kernel(shapes, threads: tuple[int, ...], repeats: int) -> None:
    """traker's scoring phases, ``gradsketch.trak_scores`` and the float32 floor, interleaved.

    Same float32 data, λ = 0 for both, CPU, torch (and SciPy's BLAS) pinned
    to ``threads``. traker's side is :data:`TRAKER_SCORING`; gradsketch's is
    ``trak_scores(x, t, q)`` (XᵀX by syrk, certified Cholesky inverse
    applied to the targets, one ``n k m`` product, the Q weighting): the
    same inputs to the same ``[n, m]`` scores. The floor
    (:data:`FLOOR_SCOPE`) is what any scorer must at least spend. Each
    repeat runs one call of each, round-robin, so load swings on a shared
    machine hit all three; medians of wall and CPU seconds
    (``time.process_time``) are reported with the 1-minute load average
    before and after. Run it under ``taskset -c <core>`` with ``--threads 1``
    on a shared machine: CPU seconds then measure the work, wall seconds the
    share of the core it got.
    """
    for n, k, m in shapes:
        for count in threads:
            setup_torch(count)
            emit(_scoring_kernel_row(n, k, m, repeats))
    setup_torch()


def _interleaved(fns: dict, repeats: int) -> tuple[dict[str, float], dict[str, float]]:
    """Median wall and CPU seconds of each function, one call of each per round (1 warmup)."""
    import statistics
    import time

    for fn in fns.values():
        fn()
    wall: dict[str, list[float]] = {name: [] for name in fns}
    cpu: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            cpu[name].append(time.process_time() - c0)
            wall[name].append(time.perf_counter() - w0)
    med = statistics.median
    return {n: med(v) for n, v in wall.items()}, {n: med(v) for n, v in cpu.items()}


def _scoring_kernel_row(n: int, k: int, m: int, repeats: int) -> dict:
    import os

    from scipy.linalg import blas
    from threadpoolctl import threadpool_limits
    from trak.score_computers import BasicScoreComputer

    from gradsketch.attribution import trak_scores

    x, t, q = _scoring_data(n, k, m)
    phases: dict[str, list[float]] = {
        "get_xtx": [],
        "get_x_xtx_inv": [],
        "get_scores": [],
        "weight_q": [],
    }
    sc = BasicScoreComputer(dtype=torch.float32, device="cpu", logging_level=QUIET)
    results: dict[str, np.ndarray] = {}
    threads = torch.get_num_threads()

    def theirs() -> None:
        seconds, xtx = time_once(lambda: sc.get_xtx(x))
        phases["get_xtx"].append(seconds)
        seconds, feats = time_once(lambda: sc.get_x_xtx_inv(x, xtx))
        phases["get_x_xtx_inv"].append(seconds)
        acc = torch.zeros(n, m)
        phases["get_scores"].append(time_once(lambda: sc.get_scores(feats, t, acc))[0])
        seconds, final = time_once(lambda: acc.numpy() * q.numpy()[:, None])
        phases["weight_q"].append(seconds)
        results["traker"] = final

    def ours() -> None:
        results["gradsketch"] = trak_scores(x, t, q)

    def floor() -> None:
        with threadpool_limits(threads, user_api="blas"):
            blas.ssyrk(1.0, x.numpy().T, trans=0, lower=1)  # XᵀX, one triangle
        torch.mm(x, t.T, out=torch.empty(n, m))

    load_before = os.getloadavg()[0]
    fns = {"traker": theirs, "gradsketch": ours, "floor": floor}
    wall, cpu = _interleaved(fns, repeats)
    load_after = os.getloadavg()[0]
    # traker divides the inverse by its mean absolute entry; undo it.
    scale = float(torch.linalg.inv(x.T.double() @ x.double()).abs().mean())
    ref = results["traker"].astype(np.float64) * scale
    diff = float(np.abs(results["gradsketch"] - ref).max() / np.abs(ref).max())
    return {
        "bench": "scoring_kernel",
        "n": n,
        "k": k,
        "m": m,
        "dtype": "float32",
        "threads": threads,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "env": {
            v: os.environ.get(v)
            for v in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "OPENBLAS_CORETYPE")
        },
        "traker_scope": TRAKER_SCORING,
        "floor_scope": FLOOR_SCOPE,
        "traker_s": wall["traker"],
        **{f"traker_{p}_s": float(np.median(v[1:])) for p, v in phases.items()},
        "gradsketch_s": wall["gradsketch"],
        "floor_s": wall["floor"],
        "traker_cpu_s": cpu["traker"],
        "gradsketch_cpu_s": cpu["gradsketch"],
        "floor_cpu_s": cpu["floor"],
        "speedup": wall["traker"] / wall["gradsketch"],
        "speedup_cpu": cpu["traker"] / cpu["gradsketch"],
        "over_floor": wall["gradsketch"] / wall["floor"],
        "over_floor_cpu": cpu["gradsketch"] / cpu["floor"],
        "max_rel_diff_vs_traker": diff,
        "repeats": repeats,
        "load_1min": [load_before, load_after],
    }


#: ``(n_train, k, n_targets)`` of ``--section pipeline`` (the issue-48 workload first).
PIPELINE_SHAPES = ((20_000, 2048, 2_000), (20_000, 2048, 500), (20_000, 2048, 5_000))
PIPELINE_SHAPES_QUICK = ((4_000, 512, 400),)


def bench_pipeline(shapes, repeats: int) -> None:
    """Both TRAKers end to end after featurizing: finalize_features, then finalize_scores twice.

    The same phases on both sides, each reading its own on-disk store and
    writing its scores there: ``finalize_features`` (traker: XᵀX and the
    ``[n, k]`` features ``X (XᵀX)⁻¹`` written to disk; gradsketch: XᵀX kept
    in the store's record), then ``finalize_scores`` of a first and a
    second query set of ``m`` targets (traker: one ``n k m`` product from
    the stored features; gradsketch: the damped solve of the targets and
    the ``n k m`` product), so the split shows where each pays. Rows are
    written into traker's store directly (its featurizing at this size
    would take minutes) and gradsketch's are featurized from a bias-free
    ``Linear(k // 2, 4)`` (:func:`scoring_traker_pipeline`); neither is
    timed. λ = 0, float32, torch and BLAS at the threads set by
    :func:`setup_torch`; one round of each side per repeat (1 warmup),
    medians of CPU seconds (``time.process_time``, every thread of the
    process) and wall seconds. gradsketch's phases include what traker's
    skip: checking the stored rows before using them (each chunk's crc32c
    and NaN holes; a later phase reads only chunks changed since) and, in
    ``finalize_features``, the featurizing writes still queued behind it.
    A third side, ``gradsketch_uncached``, turns the scoring cache off
    (:mod:`gradsketch.attribution._score_cache`: the factor of XᵀX + λI and
    X kept between query sets), so the second query set's gain is measured
    against its own baseline in the same run.
    """
    for n, k, m in shapes:
        emit(_pipeline_row(n, k, m, repeats))


def _pipeline_traker(n: int, k: int, m: int) -> dict[str, tuple[float, float]]:
    """traker 0.3.2's TRAKer phases on injected rows: ``{phase: (cpu_s, wall_s)}``."""
    from trak import TRAKer as RefTRAKer
    from trak.projectors import NoOpProjector

    x, t, q = _scoring_data(n, k, m)
    model = torch.nn.Linear(k // 2, 2, bias=False)
    out: dict[str, tuple[float, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        ref = RefTRAKer(
            model,
            "image_classification",
            n,
            save_dir=tmp,
            device="cpu",
            projector=NoOpProjector(),
            proj_dim=k,
            use_half_precision=False,
            logging_level=QUIET,
        )
        ref.load_checkpoint(model.state_dict(), model_id=0)
        store = ref.saver.current_store
        store["grads"][:] = x.numpy()
        store["out_to_loss"][:] = q.numpy()[:, None]
        store["is_featurized"][:] = 1
        ref.saver.serialize_current_model_id_metadata()
        out["finalize_features"] = _cpu_wall(ref.finalize_features)
        for name in ("first", "second"):
            ref.start_scoring_checkpoint(name, model.state_dict(), model_id=0, num_targets=m)
            ref.saver.current_store[f"{name}_grads"][:] = t.numpy()
            out[f"finalize_scores_{name}"] = _cpu_wall(lambda e=name: ref.finalize_scores(e))
    return out


def _pipeline_ours(n: int, k: int, m: int, cache: bool = True) -> dict[str, tuple[float, float]]:
    """gradsketch's TRAKer phases after featurizing (untimed): ``{phase: (cpu_s, wall_s)}``.

    ``cache=False``: the scoring cache is off (each query set factorises
    XᵀX + λI and reads X again, as before it existed), the same run's baseline.
    """
    out: dict[str, tuple[float, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        ours, model, x, y = _featurized_traker(n, k, tmp)
        ours._method.score_cache.enabled = cache
        out["finalize_features"] = _cpu_wall(ours.finalize_features)
        for name in ("first", "second"):
            _score_targets(ours, name, model, x, y, m)
            out[f"finalize_scores_{name}"] = _cpu_wall(lambda e=name: ours.finalize_scores(e))
    return out


def _featurized_traker(n: int, k: int, save_dir: str) -> tuple[Any, Any, Any, Any]:
    """A TRAKer over ``n`` rows of width ``k`` featurized (untimed): ``(traker, model, x, y)``.

    The rows are a bias-free ``Linear(k // 2, 4)``'s gradients (see
    :func:`scoring_traker_pipeline`).
    """
    from gradsketch.attribution import TRAKer

    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Linear(k // 2, 4, bias=False)
    x = torch.randn(n, k // 2, generator=gen)
    y = torch.randint(0, 4, (n,), generator=gen)
    traker = TRAKer(
        model,
        "image_classification",
        n,
        save_dir=save_dir,
        device="cpu",
        proj_dim=k,
        use_half_precision=False,
        logging_level=QUIET,
        progress=False,
    )
    traker.load_checkpoint(model.state_dict(), model_id=0)
    for start in range(0, n, 5000):
        stop = min(n, start + 5000)
        traker.featurize((x[start:stop], y[start:stop]), num_samples=stop - start)
    return traker, model, x, y


def _score_targets(traker: Any, name: str, model: Any, x: Any, y: Any, m: int) -> None:
    """Featurize the first ``m`` rows as experiment ``name``'s targets (untimed)."""
    traker.start_scoring_checkpoint(name, model.state_dict(), model_id=0, num_targets=m)
    for start in range(0, m, 5000):
        stop = min(m, start + 5000)
        traker.score((x[start:stop], y[start:stop]), num_samples=stop - start)


def _cpu_wall(fn) -> tuple[float, float]:
    import time

    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.process_time() - c0, time.perf_counter() - w0


def _pipeline_row(n: int, k: int, m: int, repeats: int) -> dict:
    import os
    import statistics

    sides: dict[str, Any] = {
        "traker": _pipeline_traker,
        "gradsketch": _pipeline_ours,
        "gradsketch_uncached": functools.partial(_pipeline_ours, cache=False),
    }
    for fn in sides.values():
        fn(n, k, m)  # warmup
    runs: dict[str, list[dict[str, tuple[float, float]]]] = {s: [] for s in sides}
    load_before = os.getloadavg()[0]
    for _ in range(repeats):
        for side, fn in sides.items():
            runs[side].append(fn(n, k, m))
    row: dict = {
        "bench": "scoring_pipeline",
        "n": n,
        "k": k,
        "m": m,
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "env": {
            v: os.environ.get(v)
            for v in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "OPENBLAS_CORETYPE")
        },
    }
    totals: dict[str, dict[str, float]] = {}
    for side, rounds in runs.items():
        totals[side] = {}
        for which, index in (("cpu", 0), ("wall", 1)):
            for phase in rounds[0]:
                value = statistics.median(r[phase][index] for r in rounds)
                row[f"{side}_{phase}_{which}_s"] = value
            first = [
                r["finalize_features"][index] + r["finalize_scores_first"][index] for r in rounds
            ]
            totals[side][which] = statistics.median(first)
            row[f"{side}_features_plus_first_scores_{which}_s"] = totals[side][which]
    for which in ("cpu", "wall"):
        row[f"speedup_features_plus_first_scores_{which}"] = (
            totals["traker"][which] / totals["gradsketch"][which]
        )
        for side in ("gradsketch", "gradsketch_uncached"):
            suffix = "" if side == "gradsketch" else "_uncached"
            row[f"speedup_second_scores{suffix}_{which}"] = (
                row[f"traker_finalize_scores_second_{which}_s"]
                / row[f"{side}_finalize_scores_second_{which}_s"]
            )
    row["repeats"] = repeats
    row["load_1min"] = [load_before, os.getloadavg()[0]]
    return row


def _max_rel_diff(ref_path: str, our_path: str, n: int) -> float:
    """``max |ours - ref| / max |ref|``, read in row blocks."""
    a, b = np.load(ref_path, mmap_mode="r"), np.load(our_path, mmap_mode="r")
    max_diff, max_ref = 0.0, 0.0
    for start in range(0, n, 5000):
        block_a = np.asarray(a[start : start + 5000], dtype=np.float64)
        block_b = np.asarray(b[start : start + 5000], dtype=np.float64)
        max_diff = max(max_diff, float(np.abs(block_a - block_b).max()))
        max_ref = max(max_ref, float(np.abs(block_a).max()))
    return max_diff / max_ref


# -- featurization ------------------------------------------------------------------


def _models():
    from gradsketch.demos import build_cnn, build_mlp

    return {"mlp": build_mlp(seed=0), "cnn": build_cnn(seed=0)}


def _featurize_all(traker, x, y, batch: int) -> None:
    n = x.shape[0]
    for start in range(0, n, batch):
        traker.featurize(
            batch=(x[start : start + batch], y[start : start + batch]),
            num_samples=min(batch, n - start),
        )
    flush = getattr(getattr(traker, "store", None), "flush", None)
    if flush is not None:  # gradsketch writes behind: time the rows until they are on disk
        flush()


def _featurize_rate(make_traker, model, x, y, batch: int, repeats: int) -> float:
    """Examples/s of TRAKer.featurize over (x, y), a fresh store per repeat."""
    n = x.shape[0]
    times = []
    for r in range(repeats + 1):
        with tempfile.TemporaryDirectory() as tmp:
            traker = make_traker(model, n, tmp)
            traker.load_checkpoint(model.state_dict(), model_id=0)
            elapsed, _ = time_once(functools.partial(_featurize_all, traker, x, y, batch))
            if r > 0:  # the first pass warms caches and builds tables
                times.append(elapsed)
    return n / float(np.median(times))


def _grad_rate(make_traker, model, x, y, batch: int, repeats: int) -> float:
    """Examples/s of the per-example gradients alone (the TRAKer's gradient computer)."""
    n = x.shape[0]
    with tempfile.TemporaryDirectory() as tmp:
        traker = make_traker(model, n, tmp)
        traker.load_checkpoint(model.state_dict(), model_id=0)
        gc = traker.gradient_computer

        def run() -> None:
            for start in range(0, n, batch):
                gc.compute_per_sample_grad(
                    batch=(x[start : start + batch], y[start : start + batch])
                )

        return n / median_time(run, repeats, 1)


def bench_featurize(proj_dim: int, batch: int, repeats: int, quick: bool) -> None:
    import trak
    from trak.projectors import BasicProjector

    from gradsketch.attribution import HookGradientComputer, TRAKer
    from gradsketch.demos import load_digits_split
    from gradsketch.sketch import FactorizedProjector

    split = load_digits_split(seed=0)
    x, y = split.x_train, split.y_train

    def ours(model, n, tmp, **options):
        return TRAKer(
            model,
            "image_classification",
            n,
            save_dir=tmp,
            device="cpu",
            proj_dim=proj_dim,
            use_half_precision=False,
            logging_level=QUIET,
            progress=False,
            **options,
        )

    def ours_hooks(model, n, tmp):
        # The hook computer's default projector: CountSketchProjector(proj_dim).
        return ours(model, n, tmp, gradient_computer=HookGradientComputer)

    def ours_hooks_factorized(model, n, tmp):
        projector = FactorizedProjector.from_budget(model, proj_dim, seed=0)
        return ours(model, n, tmp, gradient_computer=HookGradientComputer, projector=projector)

    def ref(model, n, tmp, **options):
        return trak.TRAKer(
            model,
            "image_classification",
            n,
            save_dir=tmp,
            device="cpu",
            use_half_precision=False,
            logging_level=QUIET,
            **options,
        )

    def ref_default(model, n, tmp):
        return ref(model, n, tmp, proj_dim=proj_dim)

    def ref_dense(model, n, tmp):
        grad_dim = sum(p.numel() for p in model.parameters())
        projector = BasicProjector(
            grad_dim=grad_dim,
            proj_dim=proj_dim,
            seed=0,
            proj_type="normal",
            device="cpu",
            block_size=proj_dim,
            dtype=torch.float32,
        )
        return ref(model, n, tmp, projector=projector)

    for name, model in _models().items():
        params = sum(p.numel() for p in model.parameters())
        # Slow references run on fewer rows so the benchmark stays bounded.
        n_ours = 256 if quick else x.shape[0]
        n_default = 64 if quick else 2 * batch
        n_dense = 128 if quick else 4 * batch
        rates = {
            "gradsketch.TRAKer (CountSketchProjector)": _featurize_rate(
                ours, model, x[:n_ours], y[:n_ours], batch, repeats
            ),
            "gradsketch.TRAKer (HookGradientComputer + CountSketchProjector)": _featurize_rate(
                ours_hooks, model, x[:n_ours], y[:n_ours], batch, repeats
            ),
            "gradsketch.TRAKer (HookGradientComputer + FactorizedProjector)": _featurize_rate(
                ours_hooks_factorized, model, x[:n_ours], y[:n_ours], batch, repeats
            ),
            "traker.TRAKer (BasicProjector, block_size=100)": _featurize_rate(
                ref_default, model, x[:n_default], y[:n_default], batch, 1 if quick else 2
            ),
            "traker.TRAKer (BasicProjector, one dense block)": _featurize_rate(
                ref_dense, model, x[:n_dense], y[:n_dense], batch, repeats
            ),
        }
        grad_rates = {
            "gradsketch": _grad_rate(ours, model, x[:n_ours], y[:n_ours], batch, repeats),
            "traker": _grad_rate(ref_default, model, x[:n_ours], y[:n_ours], batch, repeats),
        }
        ours_rate = rates["gradsketch.TRAKer (CountSketchProjector)"]
        hooks_rate = rates["gradsketch.TRAKer (HookGradientComputer + FactorizedProjector)"]
        hooks_dim = FactorizedProjector.from_budget(model, proj_dim, seed=0).proj_dim
        for impl, rate in rates.items():
            emit(
                {
                    "bench": "featurize",
                    "model": name,
                    "params": params,
                    "proj_dim": hooks_dim if "Factorized" in impl else proj_dim,
                    "batch": batch,
                    "impl": impl,
                    "examples_per_s": rate,
                    "gradsketch_speedup": ours_rate / rate,
                    "gradsketch_hooks_speedup": hooks_rate / rate,
                }
            )
        for impl, rate in grad_rates.items():
            emit(
                {
                    "bench": "per_example_grads",
                    "model": name,
                    "params": params,
                    "batch": batch,
                    "impl": impl,
                    "examples_per_s": rate,
                }
            )


# -- LDS ----------------------------------------------------------------------------


def _trak_loop(traker, checkpoints, split, num_targets: int, batch: int) -> np.ndarray:
    """The TRAK script both packages run unchanged (only the TRAKer differs)."""
    from gradsketch.demos import to_numpy

    x, y = split.x_train, split.y_train
    for model_id, ckpt in enumerate(checkpoints):
        traker.load_checkpoint(ckpt, model_id=model_id)
        for start in range(0, x.shape[0], batch):
            traker.featurize(
                batch=(x[start : start + batch], y[start : start + batch]),
                num_samples=min(batch, x.shape[0] - start),
            )
    traker.finalize_features()
    xt, yt = split.x_test[:num_targets], split.y_test[:num_targets]
    for model_id, ckpt in enumerate(checkpoints):
        traker.start_scoring_checkpoint(
            exp_name="lds", checkpoint=ckpt, model_id=model_id, num_targets=num_targets
        )
        for start in range(0, num_targets, batch):
            traker.score(
                batch=(xt[start : start + batch], yt[start : start + batch]),
                num_samples=min(batch, num_targets - start),
            )
    return to_numpy(traker.finalize_scores(exp_name="lds"))


def bench_lds(proj_dim: int, lds_models: int, num_targets: int, batch: int) -> None:
    import trak

    from gradsketch.attribution import TRAKer, linear_datamodeling_score
    from gradsketch.demos import (
        DemoSettings,
        build_mlp,
        digits_lds_ground_truth,
        load_digits_split,
        train_checkpoints,
    )

    split = load_digits_split(seed=0)
    settings = DemoSettings(
        num_checkpoints=3, num_targets=num_targets, lds_models=lds_models, proj_dim=proj_dim
    )
    checkpoints, accuracies = train_checkpoints(split, settings, progress=False)
    xt, yt = split.x_test[:num_targets], split.y_test[:num_targets]
    masks, outputs = digits_lds_ground_truth(split, xt, yt, settings, progress=False)
    n = split.n_train
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:

        def make_ref():
            return trak.TRAKer(
                build_mlp(seed=0),
                "image_classification",
                n,
                save_dir=f"{tmp}/ref",
                device="cpu",
                proj_dim=proj_dim,
                use_half_precision=False,
                logging_level=QUIET,
            )

        def make_ours(lam):
            return TRAKer(
                build_mlp(seed=0),
                "image_classification",
                n,
                save_dir=f"{tmp}/ours_{lam}",
                device="cpu",
                proj_dim=proj_dim,
                use_half_precision=False,
                logging_level=QUIET,
                lambda_reg=lam,
                progress=False,
            )

        runs["traker (lambda_reg=0)"] = time_once(
            lambda: _trak_loop(make_ref(), checkpoints, split, num_targets, batch)
        )
        runs["gradsketch (lambda_reg=0)"] = time_once(
            lambda: _trak_loop(make_ours(0.0), checkpoints, split, num_targets, batch)
        )
        runs["gradsketch (lambda_reg='auto')"] = time_once(
            lambda: _trak_loop(make_ours("auto"), checkpoints, split, num_targets, batch)
        )
    ref_lds = linear_datamodeling_score(runs["traker (lambda_reg=0)"][1], masks, outputs)
    for impl, (seconds, scores) in runs.items():
        lds = linear_datamodeling_score(scores, masks, outputs)
        emit(
            {
                "bench": "lds",
                "impl": impl,
                "checkpoints": 3,
                "proj_dim": proj_dim,
                "lds_models": lds_models,
                "targets": num_targets,
                "checkpoint_accuracy": accuracies,
                "lds": lds,
                "lds_minus_traker": lds - ref_lds,
                "pipeline_s": seconds,
            }
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--section",
        "--part",
        dest="section",
        choices=["all", "scoring", "scoring-kernel", "pipeline", "featurize", "lds"],
        default="all",
    )
    parser.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=[1, 2],
        help="torch / BLAS threads of the scoring-kernel section (one line per count)",
    )
    parser.add_argument(
        "--shape",
        type=int,
        nargs=3,
        action="append",
        metavar=("N", "K", "M"),
        help="(n_train, k, n_targets) for the scoring-kernel and pipeline sections (repeatable)",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    setup_torch()
    logging.basicConfig(level=logging.WARNING)
    emit({"bench": "machine", **machine_info(), "torchvision_stub": False})
    if args.section in ("all", "scoring"):
        if args.quick:
            bench_scoring(5_000, 256, 500, args.repeats)
        else:
            bench_scoring(50_000, 2048, 5_000, args.repeats)
    given = [(int(n), int(k), int(m)) for n, k, m in args.shape or ()]
    if args.section in ("all", "scoring-kernel"):
        shapes = given or list(KERNEL_SHAPES_QUICK if args.quick else KERNEL_SHAPES)
        bench_scoring_kernel(shapes, tuple(args.threads), args.repeats)
    if args.section in ("all", "pipeline"):
        shapes = given or list(PIPELINE_SHAPES_QUICK if args.quick else PIPELINE_SHAPES)
        for count in args.threads:
            setup_torch(count)
            bench_pipeline(shapes, args.repeats)
        setup_torch()
    if args.section in ("all", "featurize"):
        bench_featurize(2048, 128, args.repeats, args.quick)
    if args.section in ("all", "lds"):
        if args.quick:
            bench_lds(512, lds_models=5, num_targets=50, batch=256)
        else:
            bench_lds(512, lds_models=30, num_targets=359, batch=256)


if __name__ == "__main__":
    main()
