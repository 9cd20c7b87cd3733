"""Stored rows against recomputed rows (``TRAKer(rows=...)``), side by side in one run.

A causal LM (GPT-2 layout built from a config, random init, no dropout) is
attributed with EK-FAC twice per repeat, in the same process, alternating:
``rows="stored"`` keeps each training sequence's per-layer rows on disk,
``rows="recompute"`` keeps the factors, eigenbases, corrected eigenvalues
and Q only, and computes the training gradients again while scoring (and
once more for EK-FAC's correction). Reported per mode: CPU seconds of the
whole flow (featurize, finalize, score targets, finalize_scores; median of
the repeats, ``time.process_time`` with one torch thread), the bytes the
store holds under ``checkpoints/`` and the ratios recompute / stored; and
the largest difference of the two score matrices relative to their largest
entry.

Run ``python benchmarks/bench_recompute.py`` (``--quick``: fewer sequences, one repeat).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from gradsketch.attribution import TRAKer
from gradsketch.demos.protocols import emit, setup_torch


def _model(layers: int, width: int, tokens: int) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=256,
        n_positions=tokens,
        n_embd=width,
        n_layer=layers,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(cfg).eval()


def _disk_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _run(rows: str, model: torch.nn.Module, ids: torch.Tensor, n: int, folder: Path):
    """CPU seconds of the whole flow, the bytes under checkpoints/, and the scores."""
    start = time.process_time()
    traker = TRAKer(
        model,
        "language_modeling",
        n,
        save_dir=folder,
        device="cpu",
        method="ekfac",
        rows=rows,
        progress=False,
        logging_level=logging.WARNING,
    )
    state = model.state_dict()
    traker.load_checkpoint(state, model_id=0)
    traker.featurize_loader([{"input_ids": ids[i : min(i + 8, n)]} for i in range(0, n, 8)])
    traker.finalize_features()
    traker.start_scoring_checkpoint("q", state, model_id=0, num_targets=int(ids.shape[0]) - n)
    traker.score_loader([{"input_ids": ids[n:]}])
    scores = np.asarray(traker.finalize_scores("q"))
    seconds = time.process_time() - start
    return seconds, _disk_bytes(folder / "checkpoints"), scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sequences, one repeat")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    setup_torch(1)
    layers, width, tokens, n, m = (2, 64, 32, 32, 4) if args.quick else (2, 64, 64, 128, 8)
    repeats = 1 if args.quick else args.repeats
    model = _model(layers, width, tokens)
    ids = torch.randint(0, 256, (n + m, tokens), generator=torch.Generator().manual_seed(1))
    seconds: dict[str, list[float]] = {"stored": [], "recompute": []}
    disk: dict[str, int] = {}
    scores: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):
            for rows in ("stored", "recompute"):
                s, b, sc = _run(rows, model, ids, n, Path(tmp) / f"{rows}{r}")
                seconds[rows].append(s)
                disk[rows], scores[rows] = b, sc
    scale = float(np.abs(scores["stored"]).max())
    shape = {"layers": layers, "width": width, "tokens": tokens, "n": n, "m": m}
    for rows in ("stored", "recompute"):
        emit(
            {
                "bench": "recompute",
                "rows": rows,
                **shape,
                "cpu_seconds_median": statistics.median(seconds[rows]),
                "repeats": repeats,
                "checkpoint_bytes": disk[rows],
            }
        )
    emit(
        {
            "bench": "recompute",
            "rows": "recompute / stored",
            **shape,
            "cpu_seconds_ratio": statistics.median(seconds["recompute"])
            / statistics.median(seconds["stored"]),
            "checkpoint_bytes_ratio": disk["recompute"] / disk["stored"],
            "max_score_difference_relative": float(
                np.abs(scores["recompute"] - scores["stored"]).max() / scale
            ),
        }
    )


if __name__ == "__main__":
    main()
