"""The LLC of a local Hugging Face language model on a local dataset, for a command line.

:func:`run_llc_command` is the body of a ``gradsketch llc``-style command for
a HF model and dataset; it has no typer dependency (the CLI wires it). Nothing
is downloaded: the model is a directory written by ``save_pretrained``, the
data a ``datasets`` directory written by ``save_to_disk`` (with an
``input_ids`` column) or text files cut into token chunks (with the model's
tokenizer when its directory has one, bytes otherwise).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gradsketch.cli._paths import output_folder

__all__ = ["run_llc_command", "load_model", "load_tokens"]

SUMMARY_FILE = "llc_summary.json"
PLOT_FILE = "llc_trace.png"
SAMPLES_DIR = "samples.zarr"
#: Text files read when ``dataset`` is a directory of text.
TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".json", ".csv")


def load_model(path: str | Path) -> torch.nn.Module:
    """A causal LM from a ``save_pretrained`` directory (local files only)."""
    from transformers import AutoModelForCausalLM

    where = Path(path)
    if not (where / "config.json").is_file():
        raise FileNotFoundError(
            f"`model`={str(path)!r} is not a Hugging Face model directory (no config.json); "
            "pass a directory written by model.save_pretrained(...)."
        )
    return AutoModelForCausalLM.from_pretrained(str(where), local_files_only=True)


def _tokenizer(model_path: Path) -> Any:
    if not any((model_path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)


def load_tokens(
    dataset: str | Path,
    model_path: str | Path,
    *,
    context_length: int,
    max_sequences: int | None = None,
) -> tuple[torch.Tensor, str]:
    """``[n, context_length + 1]`` token ids from a local dataset, and how they were made.

    Args:
        dataset: A ``save_to_disk`` directory with ``input_ids``, a text file,
            or a directory of text files (read recursively, sorted).
        model_path: The model directory (its tokenizer is used for text, if any).
        context_length: Predicted positions per sequence (text is cut into
            ``context_length + 1`` tokens).
        max_sequences: Keep at most this many sequences (the first ones).
    """
    from gradsketch.slt import as_token_tensor

    where = Path(dataset)
    if context_length < 1:
        raise ValueError(f"`context_length` must be >= 1, got {context_length}.")
    if (where / "dataset_info.json").is_file() or (where / "state.json").is_file():
        from datasets import load_from_disk

        ids = as_token_tensor(load_from_disk(str(where)), name="dataset")
        how = "datasets.load_from_disk"
    else:
        if where.is_file():
            files = [where]
        elif where.is_dir():
            files = sorted(p for p in where.rglob("*") if p.suffix in TEXT_SUFFIXES)
        else:
            raise FileNotFoundError(f"`dataset`={str(dataset)!r} does not exist.")
        if not files:
            raise ValueError(
                f"`dataset`={str(dataset)!r} holds no text files ({', '.join(TEXT_SUFFIXES)}) "
                "and no saved datasets.Dataset."
            )
        seq = context_length + 1
        need = None if max_sequences is None else max_sequences * seq
        tokenizer = _tokenizer(Path(model_path))
        tokens: list[int] = []
        for f in files:
            if tokenizer is None:
                tokens.extend(f.read_bytes())
            else:
                tokens.extend(tokenizer(f.read_text(errors="replace"))["input_ids"])
            if need is not None and len(tokens) >= need:
                break
        n = len(tokens) // seq
        if n == 0:
            raise ValueError(
                f"`dataset`={str(dataset)!r} has {len(tokens)} tokens, fewer than one sequence "
                f"of {seq}; lower `context_length` or give more text."
            )
        ids = torch.tensor(tokens[: n * seq], dtype=torch.int64).view(n, seq)
        how = "tokenizer" if tokenizer is not None else "bytes"
    if max_sequences is not None:
        ids = ids[:max_sequences]
    return ids, how


def run_llc_command(
    model: str | Path,
    dataset: str | Path,
    *,
    out: str | Path = "llc_out",
    restriction: str | list[str] = "full",
    lr: float | str = 1e-4,
    n_beta: float | None = None,
    localization: float = 100.0,
    num_chains: int = 4,
    num_draws: int = 200,
    num_burnin_steps: int = 0,
    batch_size: int = 32,
    context_length: int = 64,
    max_sequences: int | None = None,
    sampling_method: str = "sgmcmc_sgld",
    save_metrics: bool = True,
    seed: int = 100,
    device: str | None = None,
    progress: bool = True,
    fast_path: str = "auto",
    observables: bool = False,
) -> dict[str, Any]:
    """Estimate a local HF model's LLC on a local dataset; write samples, summary and plot.

    Writes ``out/samples.zarr`` (the sample store: a rerun with the same
    arguments reuses it, an interrupted one resumes), ``out/llc_summary.json``
    and ``out/llc_trace.png`` (each chain's mean loss per step).

    Args:
        model: A ``save_pretrained`` directory.
        dataset: See :func:`load_tokens`.
        out: Output directory (created).
        restriction: Weights to sample (see :func:`~gradsketch.slt.create_param_masks`).
        lr: Step size, or ``"auto"`` (calibrated: see :func:`~gradsketch.slt.sample`).
        n_beta: Inverse temperature times sample size; default
            ``batch_size / log(batch_size)`` (:func:`~gradsketch.sampling.default_nbeta`).
        localization: Pull towards the trained weights.
        num_chains: Chains.
        num_draws: Draws per chain.
        num_burnin_steps: Steps before the first draw.
        batch_size: Sequences per step.
        context_length: Predicted positions per sequence (text input).
        max_sequences: Use at most this many sequences.
        sampling_method: A name in :data:`~gradsketch.slt.SAMPLING_METHODS`.
        save_metrics: Record the sampler's per-step norms.
        seed: ``init_seed`` of :func:`~gradsketch.slt.sample`.
        device: Where to sample (default CUDA when available).
        progress: tqdm bars on stderr (``lr="auto"``'s pilots, ``L(w*)``, the
            chains' steps), whether or not stderr is a terminal.
        fast_path: ``"auto"`` or ``"off"``: :func:`~gradsketch.slt.sample`'s
            ``fast_path`` (``"off"`` runs the model's own modules with torch's
            operations). What engaged is the summary's ``fast_path``.
        observables: Also record in the store the per-token losses of
            ``3 * batch_size`` fixed sequences at every draw (devinterp's
            ``train`` observable; :func:`~gradsketch.slt.sample`'s
            ``evaluate_observables``). The LLC does not read them, and they
            cost about half of each draw; the chains are the same either way.

    Returns:
        The summary written to ``llc_summary.json``: ``llc_mean``, ``llc_std``,
        ``llc_sem``, ``llc_per_chain``, ``init_loss``, ``n_beta``, the counts,
        the paths and ``fast_path`` (the store's record of what engaged).

    Raises:
        ValueError: ``fast_path`` is not ``"auto"`` or ``"off"`` (before any loading).
    """
    from gradsketch.sampling import default_nbeta, plot_trace
    from gradsketch.slt import FAST_PATH_ATTR, FAST_PATHS, compute_llc, create_param_masks, sample

    if fast_path not in FAST_PATHS:
        raise ValueError(
            f"`fast_path` must be one of {list(FAST_PATHS)}, got {fast_path!r}; 'auto' uses the "
            "faster train-mode kernels where they engage, 'off' the model's own modules."
        )
    start = time.perf_counter()
    out_dir = output_folder(out)
    lm = load_model(model)
    ids, how = load_tokens(
        dataset, model, context_length=context_length, max_sequences=max_sequences
    )
    vocab = getattr(lm.config, "vocab_size", None)
    if vocab is not None and int(ids.max()) >= int(vocab):
        raise ValueError(
            f"the dataset has token id {int(ids.max())} but the model's vocabulary has {vocab} "
            f"entries (tokens made by {how}); give a dataset tokenized for this model."
        )
    masks = create_param_masks(lm, restriction)
    beta = float(n_beta) if n_beta is not None else default_nbeta(batch_size)
    samples = sample(
        lm,
        ids,
        {"train": ids},
        lr=lr,
        n_beta=beta,
        param_masks=masks,
        num_chains=num_chains,
        num_draws=num_draws,
        num_burnin_steps=num_burnin_steps,
        batch_size=batch_size,
        sampling_method=sampling_method,
        localization=localization,
        save_metrics=save_metrics,
        init_seed=seed,
        device=device,
        output_path=out_dir / SAMPLES_DIR,
        progress=progress,
        fast_path=fast_path,
        evaluate_observables=observables,
    )
    est = compute_llc(samples)
    trace = np.asarray(est["loss_trace"].values, dtype=float)
    summary: dict[str, Any] = {
        "llc_mean": float(est["llc_mean"]),
        "llc_std": float(est["llc_std"]),
        "llc_sem": float(est["llc_sem"]),
        "llc_per_chain": [float(v) for v in est["llc_per_chain"].values],
        "init_loss": float(est["init_loss"]),
        "n_beta": beta,
        "lr": float(samples.attrs["metadata"]["config"]["sampler"]["lr"]),
        "restriction": restriction,
        "selected_weights": masks.numel,
        "total_weights": masks.total,
        "sequences": int(ids.shape[0]),
        "context_length": int(ids.shape[1] - 1),
        "tokens_from": how,
        "samples": str(out_dir / SAMPLES_DIR),
        "plot": str(out_dir / PLOT_FILE),
        "fast_path": samples.attrs.get(FAST_PATH_ATTR),
        "seconds": time.perf_counter() - start,
    }
    plot_trace(
        {
            "loss/trace": trace,
            "init_loss": summary["init_loss"],
            "llc/mean": summary["llc_mean"],
            "llc/std": summary["llc_std"],
        },
        out_dir / PLOT_FILE,
    )
    finite = {
        k: (None if isinstance(v, float) and not math.isfinite(v) else v)
        for k, v in summary.items()
    }
    (out_dir / SUMMARY_FILE).write_text(json.dumps(finite, indent=2) + "\n")
    return summary
