"""Index build against bergson 2.5.1: per-layer projected rows of GPT-2-shaped models, tokens/s.

The issue (49, item 5): an index build costs at most half of bergson's time at
the same projection, in tokens per second, on GPT-2-small's shape (width 768,
12 heads, vocabulary 50,257, 128-token documents); here at 2 and 4 layers so
that a run fits a loaded 2-core machine.

What is built, on both sides, from the same randomly initialised float32
``GPT2LMHeadModel`` and the same ``num_docs`` documents of 128 random token
ids, in batches of ``batch`` documents:

* bergson: ``collect_gradients`` (what ``bergson build`` runs in each worker,
  without the model loading and the dataset pipeline) with
  ``IndexConfig(projection_dim=k)``: every ``Conv1D`` of ``model.base_model``
  (GPT-2's ``transformer``: the lm_head is outside it), no bias
  (``include_bias=False``, its default), the summed next-token cross-entropy
  of each document, and ``P_out G P_in^T`` (``k x k`` per module, Rademacher
  factors, its default) written to its on-disk index.
* gradsketch: ``TRAKer(method="identity", projection=(k, k))`` over the same
  ``Conv1D`` weights (``grad_wrt``: no bias, no lm_head), the
  ``language_modeling`` task: ``load_checkpoint``, ``featurize`` of every
  batch, rows written to its zarr store (``k x k`` per layer, Gaussian
  factors: the factor draw is a once-per-layer cost, the same either way).
  What is differentiated differs in one respect: gradsketch's rows are
  gradients of the summed per-token log-odds, bergson's of the summed
  cross-entropy; both are one forward and one backward of the same model.

Timing: CPU seconds of this process (``time.process_time``), one intra-op
thread, the median of ``repeats`` interleaved runs after a warm-up run of
each (one document batch), with two floors measured alongside: ``floor``,
one forward + backward of each batch with every weight gradient formed (what
a plain training step costs), and ``floor_inputs_only``, the forward and the
backward to every layer's input with no weight gradient (the least any
hook-based projection can cost: ``inputs_only / bergson`` bounds the ratio
any such index can reach against bergson), and ``head_gemms``, only the two
vocabulary GEMMs (logits, and their gradient back to the last hidden state)
that every exact method does: ``head_gemms / bergson`` is a floor under the
ratio that no implementation beats. Tokens per second are ``num_docs *
128 / cpu_seconds``. One JSON line per layer count: ``bergson_tokens_per_s``,
``gradsketch_tokens_per_s``, ``ratio`` (gradsketch time over bergson's: the
issue asks for at most 0.5), and the floor's.

Run ``python benchmarks/bench_index.py`` (``--quick``: 8 documents, 1 repeat).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

SEQ = 128
VOCAB = 50257
WIDTH = 768


def log(message: str) -> None:
    print(json.dumps({"log": message}), flush=True)


def emit(row: dict[str, Any]) -> None:
    print(json.dumps(row), flush=True)


def gpt2(n_layer: int, seed: int = 0) -> nn.Module:
    """GPT-2-small's shape at ``n_layer`` blocks, randomly initialised, float32, eval mode."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=n_layer,
        n_embd=WIDTH,
        n_head=12,
        vocab_size=VOCAB,
        n_positions=SEQ,
        attn_pdrop=0.0,
        embd_pdrop=0.0,
        resid_pdrop=0.0,
    )
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config).eval()


def conv1d_weights(model: nn.Module) -> list[str]:
    """Names of the weights of every ``Conv1D`` in ``model.transformer`` (bergson's modules)."""
    from transformers.pytorch_utils import Conv1D

    return [
        f"{name}.weight"
        for name, module in model.named_modules()
        if isinstance(module, Conv1D) and name.startswith("transformer.")
    ]


def documents(num_docs: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (num_docs, SEQ), generator=g)


def floor(model: nn.Module, ids: torch.Tensor, batch: int) -> None:
    """One forward and backward of each batch (the summed cross-entropy), no hooks."""
    for first in range(0, int(ids.shape[0]), batch):
        x = ids[first : first + batch]
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=x).logits[:, :-1]
        loss = nn.functional.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="sum")
        loss.backward()
    model.zero_grad(set_to_none=True)


def floor_inputs_only(model: nn.Module, ids: torch.Tensor, batch: int) -> None:
    """The least any hook-based index does: forward, and backward to every layer's input only.

    No weight gradient is formed (the parameters are frozen; the embeddings'
    output is the leaf), which is all a per-layer projection needs: each
    layer's ``P_out G P_in^T`` comes from its inputs and output gradients.
    """
    flags = [p.requires_grad for p in model.parameters()]
    for p in model.parameters():
        p.requires_grad_(False)
    try:
        embed: nn.Module = model.get_input_embeddings()  # type: ignore[operator]
        for first in range(0, int(ids.shape[0]), batch):
            x = ids[first : first + batch]
            leaf = embed(x).requires_grad_(True)
            logits = model(inputs_embeds=leaf).logits[:, :-1]
            loss = nn.functional.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="sum")
            loss.backward()
    finally:
        for p, flag in zip(model.parameters(), flags):
            p.requires_grad_(flag)


def head_gemms(model: nn.Module, ids: torch.Tensor, batch: int) -> None:
    """The two vocabulary GEMMs of each batch: logits ``h Wᵀ`` and the hidden gradient ``dL W``.

    Any exact per-layer index does both (the logits for the loss, their
    gradient back to the last layer's output): a floor no method beats,
    measured here with random ``h`` and ``dL`` of the real shapes.
    """
    head = model.get_output_embeddings().weight.detach()  # type: ignore[union-attr, operator]
    g = torch.Generator().manual_seed(0)
    for first in range(0, int(ids.shape[0]), batch):
        rows = int(ids[first : first + batch].numel())
        h = torch.randn(rows, WIDTH, generator=g)
        logits = h @ head.T
        _ = logits @ head


def bergson_build(model: nn.Module, ids: torch.Tensor, batch: int, k: int, where: Path) -> Path:
    """bergson's index of ``ids`` at ``projection_dim=k`` under ``where`` (its worker's steps)."""
    from bergson.collection import collect_gradients
    from bergson.config.config import IndexConfig, PreprocessConfig
    from bergson.utils.worker_utils import processor_for
    from datasets import Dataset

    cfg = IndexConfig(
        run_path=str(where / "bergson"),
        projection_dim=k,
        token_batch_size=batch * SEQ,
        projection_seed=0,
    )
    cfg.partial_run_path.mkdir(parents=True, exist_ok=True)
    data = Dataset.from_dict({"input_ids": ids.tolist(), "length": [SEQ] * int(ids.shape[0])})
    processor = processor_for(cfg)
    batches = [list(range(i, min(i + batch, len(data)))) for i in range(0, len(data), batch)]
    with contextlib.redirect_stderr(io.StringIO()):  # its tqdm bar
        collect_gradients(
            model,  # type: ignore[arg-type]
            data,
            processor,
            cfg,
            batches=batches,
            preprocess_cfg=PreprocessConfig(),
        )
    return cfg.partial_run_path


def gradsketch_build(model: nn.Module, ids: torch.Tensor, batch: int, k: int, where: Path) -> Any:
    """gradsketch's per-layer projected rows of ``ids`` (identity method) under ``where``."""
    import gradsketch.attribution._lm  # noqa: F401  (registers "language_modeling")
    from gradsketch.attribution import TRAKer

    traker = TRAKer(
        model,
        "language_modeling",
        int(ids.shape[0]),
        save_dir=where / "gradsketch",
        device="cpu",
        method="identity",
        projection=(k, k),
        grad_wrt=conv1d_weights(model),
        progress=False,
        logging_level=logging.WARNING,
    )
    traker.load_checkpoint(model.state_dict(), model_id=0)
    for first in range(0, int(ids.shape[0]), batch):
        x = ids[first : first + batch]
        traker.featurize((x, torch.ones_like(x), x.clone()), num_samples=int(x.shape[0]))
    traker.store.flush()  # the rows' background writes belong to the build's time
    return traker


def cpu_seconds(fn: Callable[[], Any]) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def measure(n_layer: int, args: argparse.Namespace) -> dict[str, Any]:
    model = gpt2(n_layer)
    ids = documents(args.num_docs)
    warm = ids[: args.batch]
    sides: dict[str, Callable[[torch.Tensor, Path], Any]] = {
        "floor": lambda x, where: floor(model, x, args.batch),
        "floor_inputs_only": lambda x, where: floor_inputs_only(model, x, args.batch),
        "head_gemms": lambda x, where: head_gemms(model, x, args.batch),
        "bergson": lambda x, where: bergson_build(model, x, args.batch, args.k, where),
        "gradsketch": lambda x, where: gradsketch_build(model, x, args.batch, args.k, where),
    }
    times: dict[str, list[float]] = {name: [] for name in sides}
    with tempfile.TemporaryDirectory() as tmp:
        built = {}
        for name, fn in sides.items():  # warm-up: imports, kernels, projection matrices
            built[name] = fn(warm, Path(tmp) / f"warm-{name}")
        # The same index on both sides: k x k numbers per Conv1D, float32, per document.
        index_bytes = (built["bergson"] / "gradients.bin").stat().st_size
        width = int(built["gradsketch"].proj_dim)
        if index_bytes != int(warm.shape[0]) * width * 4:
            raise RuntimeError(
                f"bergson's index holds {index_bytes} bytes for {warm.shape[0]} documents, "
                f"gradsketch's rows {width} float32 numbers each: the projections differ"
            )
        for r in range(args.repeats):
            for name, fn in sides.items():
                where = Path(tmp) / f"{name}-{r}"
                times[name].append(cpu_seconds(lambda fn=fn, where=where: fn(ids, where)))
                log(f"{n_layer} layers, {name}, repeat {r}: {times[name][-1]:.2f} CPU s")
    tokens = int(ids.numel())
    med = {name: statistics.median(t) for name, t in times.items()}
    return {
        "bench": "index_build",
        "n_layer": n_layer,
        "width": WIDTH,
        "vocab": VOCAB,
        "seq": SEQ,
        "num_docs": args.num_docs,
        "batch": args.batch,
        "k_per_side": args.k,
        "repeats": args.repeats,
        **{f"{name}_cpu_s": round(med[name], 3) for name in sides},
        **{f"{name}_tokens_per_s": round(tokens / med[name], 1) for name in sides},
        "row_width": width,
        "ratio_gradsketch_over_bergson": round(med["gradsketch"] / med["bergson"], 3),
        "ratio_bergson_over_floor": round(med["bergson"] / med["floor"], 3),
        "ratio_gradsketch_over_floor": round(med["gradsketch"] / med["floor"], 3),
        "ratio_inputs_only_floor_over_bergson": round(med["floor_inputs_only"] / med["bergson"], 3),
        "ratio_head_gemms_over_bergson": round(med["head_gemms"] / med["bergson"], 3),
        "all_cpu_s": {name: [round(t, 3) for t in ts] for name, ts in times.items()},
    }


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 documents, 1 repeat")
    parser.add_argument("--layers", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--num-docs", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8, help="documents per batch")
    parser.add_argument("--k", type=int, default=16, help="projection per side (bergson's p)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if args.quick:
        args.num_docs, args.repeats = 8, 1
    torch.set_num_threads(args.threads)
    logging.disable(logging.INFO)  # bergson logs every batch at INFO
    from importlib.metadata import version

    from gradsketch.demos.protocols import machine_info

    emit({"bench": "machine", **machine_info(), "bergson": version("bergson")})
    rows = []
    for n_layer in args.layers:
        rows.append(measure(n_layer, args))
        emit(rows[-1])
    return rows


if __name__ == "__main__":
    main()
