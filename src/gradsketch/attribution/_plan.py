"""The plan of an attribution run: store bytes, peak memory and time, before the work.

Users bring 100M-7B-parameter models; a run that cannot fit must say so
before it allocates, not be killed by the kernel. :class:`AttributionPlan`
is what :class:`~gradsketch.attribution.TRAKer` estimates from the model
(at construction) and from the first training batch (before featurizing
it), logs, and refuses with (:class:`~gradsketch.errors.MemoryBudgetError`,
naming the estimate, what is free and the fixes) where it does not fit the
machine's available memory or the store's free disk.

The estimates are upper-bound-minded, not exact:

- parameters: the model's parameters and buffers, and one gradient of them;
- curvature: K-FAC / EK-FAC's float64 factors ``d_in² + d_out²`` per layer,
  their eigenbases (as many again) and the eigenvalues (``2 d_in d_out``);
  TRAK's ``k²`` Gram matrix and its inverse;
- gradients: one batch's per-example gradients (TRAK: ``B × d`` float32, twice:
  per parameter and flattened for the projector; with a streaming projector
  only the largest parameter that is neither a factored weight nor an
  embedding is formed whole;
  per-layer methods: each layer's inputs and output gradients, ``B T (d_in +
  d_out)``, and dense rows where they are kept dense) and the activations of
  the model's linear layers (``2 B T Σ (d_in + d_out)`` float32);
- projection: the tensors the projector holds;
- working: the finalize and scoring blocks (``memory_budget``, or 64 MiB);
- per-token scoring (``stage="score"``, :func:`plan_per_token`, checked at
  each scored batch before it is expanded): each of ``B`` targets becomes
  ``T`` rows of ``T`` tokens, ``max(1, B // T)`` targets a pass, planned as a
  training batch of that many rows; a language task's loss head adds one
  ``[rows, T, V]`` float32 tensor (:func:`~gradsketch.attribution._lm.token_log_odds`)
  beside the logits and their gradient, which the activations count;
- store: the rows of each document in the form they will be kept (``[a, g]``
  per position, dense ``vec(G)``, or projected features) and Q; with
  ``rows="recompute"`` only Q and a done flag (the rows are recomputed while
  scoring, :mod:`~gradsketch.attribution._traker_recompute`).

``TRAKer(rows="auto")`` (:func:`choose_rows`) keeps the rows on disk unless
they would not fit the free disk in their widest form, and then recomputes
them.

The time per document is measured on the first batch, in wall seconds and
in the process's CPU seconds (the wall clock overstates the work on a
loaded machine). The plan's peak counts the parts above; the process's
peak (:meth:`AttributionPlan.process_bytes`) adds what was resident
when it was planned (the interpreter and libraries, about 0.5 GB), which
the available memory it is checked against already excludes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from gradsketch._distributed import all_gather_object, rank_and_world
from gradsketch._store import SETTINGS_FILE
from gradsketch.attribution._hook_computer import REST_CHUNK_BYTES
from gradsketch.attribution._io import DEFAULT_BLOCK_BYTES
from gradsketch.attribution._layer_capture import FactoredLayer, find_layers
from gradsketch.errors import MemoryBudgetError

__all__ = [
    "AttributionPlan",
    "available_memory",
    "cache_refusal",
    "choose_rows",
    "free_disk",
    "model_plan",
    "plan_first_batch",
    "plan_per_token",
    "resident_memory",
    "traker_plan",
    "with_cache",
]

#: The stages a plan is checked at, and how a refusal names their memory.
STAGES = {
    "featurize": "peak memory",
    "finalize": "finalize_features needs",
    "score": "per-token scoring needs",
}

#: Methods whose curvature is K-FAC's factors (registered per-layer methods are counted so too).
_NO_CURVATURE = ("identity",)


def available_memory() -> int | None:
    """Bytes of memory available to this process's allocations, or ``None`` if unknown.

    The machine's (:func:`machine_memory`) in one process; under
    ``torch.distributed`` this rank's share of it, as the ranks on one machine
    allocate from the same memory (:func:`ranks_on_machine`).
    """
    whole = machine_memory()
    return None if whole is None else whole // ranks_on_machine()


def ranks_on_machine() -> int:
    """Ranks sharing this machine's memory: torchrun's ``LOCAL_WORLD_SIZE`` (1 without a group).

    At most the process group's size (a group made without torchrun, or one of
    one rank, counts one rank per machine unless ``LOCAL_WORLD_SIZE`` says more).
    """
    world = rank_and_world()[1]
    if world == 1:
        return 1
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        local = 1
    return max(1, min(local, world))


def rank_share() -> str:
    """How a plan's memory is this rank's: ``""`` in one process (a note's words, else).

    Every rank holds what one process holds at each stage, for its own rows
    (the model, one batch's per-example gradients, the whole reduced curvature
    at ``finalize_features``, the scoring blocks of its target columns), so
    its estimate is one process's, and is compared with its share of the
    machine's memory.
    """
    rank, world = rank_and_world()
    if world == 1:
        return ""
    local = ranks_on_machine()
    whole = machine_memory()
    machine = "" if whole is None else f" of {_gb(whole)}"
    return f"rank {rank} of {world}: 1/{local} of this machine's memory{machine}"


def refuse_on_any_rank(plan: AttributionPlan, layered: bool, stage: str = "featurize") -> None:
    """:func:`refuse` on every rank where any rank's plan does not fit ``stage``.

    Collective under ``torch.distributed`` (every rank must call it): the
    ranks' problems are gathered, so that all of them stop with the same
    message, naming each rank that does not fit, instead of one rank
    stopping and the others waiting for it.

    Raises:
        MemoryBudgetError: a rank's plan does not fit (:meth:`AttributionPlan.problems`).
    """
    if rank_and_world()[1] == 1:
        refuse(plan, layered, stage)
        return
    mine = "; ".join(plan.problems(stage))
    every = all_gather_object((mine, str(plan)))
    failing = [(r, problems, text) for r, (problems, text) in enumerate(every) if problems]
    if not failing:
        return
    r, _, text = failing[0]
    raise MemoryBudgetError(
        f"attribution with method={plan.method!r} does not fit on "
        + ", ".join(f"rank {rank} ({problems})" for rank, problems, _ in failing)
        + f". Fixes: {fixes(plan.method, layered, stage)}; or fewer ranks per machine "
        f"(`--nproc_per_node`): each rank holds a whole model and batch. The plan of "
        f"rank {r}:\n{text}"
    )


def rank_rows(plan: AttributionPlan, owned: Any, done: Any) -> AttributionPlan:
    """``plan`` for the rows this rank featurizes (its ``owned`` rows not ``done``).

    The ranks write one store on one filesystem, so each is held to its
    share of the free disk, ``1 / world``. Unchanged in one process.
    """
    world = rank_and_world()[1]
    if world == 1 or owned is None or done is None:
        return plan
    disk = None if plan.free_disk is None else plan.free_disk // world
    return replace(plan, rows_left=int((owned & ~done).sum()), free_disk=disk)


def machine_memory() -> int | None:
    """Bytes of this machine's memory available to a new allocation (``MemAvailable``).

    Read from ``/proc/meminfo`` (Linux), else ``os.sysconf``; the environment
    variable ``GRADSKETCH_AVAILABLE_MEMORY`` (bytes) overrides both. ``None``: unknown.
    """
    forced = os.environ.get("GRADSKETCH_AVAILABLE_MEMORY")
    if forced:
        return int(forced)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def resident_memory() -> int:
    """The resident memory of this process in bytes, now (0 if unknown).

    ``/proc/self/statm`` (Linux), else the peak so far from ``getrusage``.
    """
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * int(os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, IndexError, AttributeError):
        pass
    try:
        import resource

        peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    except (ImportError, OSError):
        return 0
    return peak if sys.platform == "darwin" else peak * 1024  # macOS: bytes; Linux: KiB


def free_disk(path: Path) -> int | None:
    """Free bytes on the filesystem of ``path`` (its nearest existing folder), or ``None``.

    The environment variable ``GRADSKETCH_AVAILABLE_DISK`` (bytes) overrides it.
    """
    forced = os.environ.get("GRADSKETCH_AVAILABLE_DISK")
    if forced:
        return int(forced)
    folder = Path(path)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return int(shutil.disk_usage(folder).free)
    except OSError:
        return None


def _gb(n: float) -> str:
    if n >= 1e8:
        return f"{n / 1e9:.2f} GB"
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


@dataclass(frozen=True)
class AttributionPlan:
    """What an attribution run needs: store bytes, peak memory and time per document.

    Read-only: :attr:`TRAKer.plan <gradsketch.attribution.TRAKer.plan>` gives the
    latest (from the model alone until the first training batch, then from it).

    Attributes:
        method: the method (``"trak"``, ``"ekfac"``, ``"replay"``...).
        train_set_size: documents n.
        batch_rows: rows of the first batch (``None``: before it).
        tokens: positions per document in the first batch (``None``: before it).
        store_bytes_per_row: bytes stored per document (0 before the first batch).
        parameter_bytes: the model's parameters, buffers and one gradient.
        curvature_bytes: the method's factors, eigenbases, Gram matrix.
        gradient_bytes: one batch's per-example gradients and activations.
        projection_bytes: what the projector holds.
        working_bytes: finalize and scoring blocks.
        seconds_per_row: featurize wall seconds per document, measured on the first
            batch (on a loaded machine larger than the work: see ``cpu_seconds_per_row``).
        available_memory: bytes available when planned (``None``: unknown).
        free_disk: free bytes at the store (``None``: unknown).
        rows_left: documents still to featurize (the store may hold some).
        notes: what the plan assumed or left out, one line each.
        curvature_at_finalize: the curvature is formed by ``finalize_features``
            (TRAK's Gram matrix with stored rows), not while featurizing: it is
            checked there (``stage="finalize"``), so that a run trak accepts
            at construction and featurizing is accepted at those calls too.
        scoring_bytes: one per-token scoring pass's per-example gradients,
            activations and loss head (:func:`plan_per_token`; 0 until a
            ``per_token=True`` batch is scored).
        scoring_rows: rows of that pass: ``T`` copies of each target in it.
        cache_bytes: what the TRAKer holds between query sets
            (:mod:`~gradsketch.attribution._score_cache`: each checkpoint's
            damped factor, ``8 k²``, and its rows where they fit), counted in
            every stage; admitted by :func:`cache_refusal`.
        baseline_bytes: the process's resident memory when planned (the
            interpreter, torch and the libraries, about 0.5 GB, and whatever
            the caller holds): :meth:`process_bytes` adds it to a stage's
            peak. Not in :meth:`stage_bytes`, which are compared with the
            available memory, from which the resident memory is already gone.
        cpu_seconds_per_row: CPU seconds of the process per document on the
            first batch (``time.process_time``: every thread, not the time
            the machine gave other processes).
    """

    method: str
    train_set_size: int
    batch_rows: int | None = None
    tokens: int | None = None
    store_bytes_per_row: int = 0
    parameter_bytes: int = 0
    curvature_bytes: int = 0
    gradient_bytes: int = 0
    projection_bytes: int = 0
    working_bytes: int = 0
    seconds_per_row: float | None = None
    available_memory: int | None = None
    free_disk: int | None = None
    rows_left: int | None = None
    notes: tuple[str, ...] = ()
    curvature_at_finalize: bool = False
    scoring_bytes: int = 0
    scoring_rows: int | None = None
    cache_bytes: int = 0
    baseline_bytes: int = 0
    cpu_seconds_per_row: float | None = None

    @property
    def store_bytes(self) -> int:
        """Bytes of the whole store's rows (``train_set_size`` documents)."""
        return self.store_bytes_per_row * self.train_set_size

    @property
    def peak_bytes(self) -> int:
        """Estimated peak memory: the sum of the parts."""
        return (
            self.parameter_bytes
            + self.curvature_bytes
            + self.gradient_bytes
            + self.projection_bytes
            + self.working_bytes
            + self.cache_bytes
        )

    def process_bytes(self, stage: str = "featurize") -> int:
        """The process's estimated resident memory at ``stage``'s peak.

        :attr:`baseline_bytes` + :meth:`stage_bytes`: what a measured peak
        RSS (``VmHWM``) compares with; the stage's own parts alone came out
        1.15-1.45x under it (the interpreter and libraries, ~0.5 GB).
        """
        return self.baseline_bytes + self.stage_bytes(stage)

    @property
    def seconds(self) -> float | None:
        """Estimated featurize seconds of the documents left (``None`` before the first batch)."""
        if self.seconds_per_row is None:
            return None
        left = self.train_set_size if self.rows_left is None else self.rows_left
        return self.seconds_per_row * left

    def stage_bytes(self, stage: str = "featurize") -> int:
        """Memory needed by ``stage``: ``"featurize"`` (its peak), ``"finalize"`` or ``"score"``.

        A curvature formed at ``finalize_features`` (:attr:`curvature_at_finalize`)
        counts at ``"finalize"`` only, beside the parameters, the projector and
        the working blocks; otherwise both stages need :attr:`peak_bytes`.
        ``"score"`` (per-token scoring, :func:`plan_per_token`): the parameters,
        the projector, the working blocks and :attr:`scoring_bytes` in place of
        the training batch's gradients; a curvature formed while featurizing is
        still held. Every stage counts :attr:`cache_bytes` (held between calls).
        """
        if stage == "score":
            curvature = 0 if self.curvature_at_finalize else self.curvature_bytes
            return (
                self.parameter_bytes
                + curvature
                + self.projection_bytes
                + self.working_bytes
                + self.scoring_bytes
                + self.cache_bytes
            )
        if not self.curvature_at_finalize:
            return self.peak_bytes
        if stage == "finalize":
            return (
                self.parameter_bytes
                + self.curvature_bytes
                + self.projection_bytes
                + self.working_bytes
                + self.cache_bytes
            )
        return self.peak_bytes - self.curvature_bytes

    def problems(self, stage: str = "featurize") -> list[str]:
        """What does not fit ``stage`` (:meth:`stage_bytes`): memory and disk, one sentence each.

        Empty: it fits. The disk is a featurize stage's problem only.
        """
        if stage not in STAGES:
            raise ValueError(f"`stage` must be one of {list(STAGES)}, got {stage!r}.")
        out = []
        need = self.stage_bytes(stage)
        if self.available_memory is not None and need > self.available_memory:
            what = STAGES[stage]
            if stage == "score":
                what = f"per-token scoring ({self.scoring_rows} rows a pass) needs"
            out.append(f"{what} ~{_gb(need)} but {_gb(self.available_memory)} is available")
        if stage != "featurize":
            return out
        left = self.train_set_size if self.rows_left is None else self.rows_left
        need = self.store_bytes_per_row * left
        if self.free_disk is not None and need > self.free_disk:
            out.append(f"the store needs ~{_gb(need)} on disk but {_gb(self.free_disk)} is free")
        return out

    def __str__(self) -> str:
        per_row = (
            "after the first batch"
            if self.batch_rows is None
            else f"{_gb(self.store_bytes_per_row)} per document"
        )
        lines = [
            f"attribution plan (method={self.method!r}, {self.train_set_size} documents"
            + ("" if self.tokens is None else f" of {self.tokens} tokens")
            + "):",
            f"  store:       {per_row}"
            + ("" if self.batch_rows is None else f", {_gb(self.store_bytes)} in total"),
            f"  peak memory: ~{_gb(self.peak_bytes)} = parameters {_gb(self.parameter_bytes)}"
            f" + curvature {_gb(self.curvature_bytes)} + per-example gradients "
            f"{_gb(self.gradient_bytes)} + projection {_gb(self.projection_bytes)} + working "
            f"{_gb(self.working_bytes)}"
            + (f" + scoring cache {_gb(self.cache_bytes)}" if self.cache_bytes else ""),
        ]
        if self.baseline_bytes:
            lines.append(
                f"  process:     ~{_gb(self.process_bytes())} resident at the featurize peak "
                f"({_gb(self.baseline_bytes)} resident when planned, plus its part)"
            )
        if self.scoring_rows is not None:
            lines.append(
                f"  per-token:   ~{_gb(self.stage_bytes('score'))} while scoring, "
                f"{self.scoring_rows} rows a pass ({_gb(self.scoring_bytes)} of gradients, "
                "activations and the loss head)"
            )
        if self.seconds_per_row is not None:
            total = self.seconds or 0.0
            cpu = (
                ""
                if self.cpu_seconds_per_row is None
                else f" ({self.cpu_seconds_per_row:.3g} CPU s)"
            )
            lines.append(
                f"  time:        {self.seconds_per_row:.3g} s per document{cpu} (first batch), "
                f"~{_duration(total)} for the {self.rows_left} left"
            )
        free = []
        if self.available_memory is not None:
            share = rank_share()
            free.append(
                f"{_gb(self.available_memory)} memory available" + (f" ({share})" if share else "")
            )
        if self.free_disk is not None:
            free.append(f"{_gb(self.free_disk)} free at the store")
        if free:
            lines.append("  machine:     " + ", ".join(free))
        lines += [f"  note:        {n}" for n in self.notes]
        return "\n".join(lines)

    def with_time(
        self, seconds_per_row: float, cpu_seconds_per_row: float | None = None
    ) -> AttributionPlan:
        """The plan with the measured featurize time per document (wall, and CPU)."""
        cpu = None if cpu_seconds_per_row is None else float(cpu_seconds_per_row)
        return replace(self, seconds_per_row=float(seconds_per_row), cpu_seconds_per_row=cpu)


def cache_refusal(
    plan: AttributionPlan, memory_budget: int | None, held: int, extra: int
) -> str | None:
    """Why ``extra`` more cached bytes beside ``held`` do not fit (``None``: they fit).

    With ``memory_budget`` the scoring cache holds at most half of it (the
    scoring blocks are planned in the rest); without one, the plan's
    ``"finalize"`` stage with the cache counted must fit the available memory.
    """
    total = held + extra
    if memory_budget is not None:
        if total > memory_budget // 2:
            return (
                f"it would hold {_gb(total)} but `memory_budget`={memory_budget} allows the "
                f"cache half of it ({_gb(memory_budget // 2)})"
            )
        return None
    problems = replace(plan, cache_bytes=total).problems("finalize")
    return "; ".join(problems) or None


def fixes(method: str, layered: bool, stage: str = "featurize") -> str:
    """The ways out, as one sentence for the refusal."""
    if stage == "score":
        return (
            "score fewer tokens per target (each target is expanded into T rows of T tokens, so "
            "a pass costs T² positions; truncate the targets to the tokens of interest); "
            "per_token=False where per-token scores are not needed; "
            + (
                "`projection=(k_in, k_out)`"
                if layered
                else "`grad_wrt` naming fewer layers (e.g. '*.h.*.weight')"
            )
        )
    ways = []
    if layered:
        ways.append(
            "`projection=(k_in, k_out)` to project each layer's inputs and output gradients "
            "(e.g. (16, 16))"
        )
    elif method != "replay":
        ways.append("a smaller `proj_dim` (or a `projector`)")
    else:
        ways.append("a smaller `query_block` or `checkpoint_every` near √(steps)")
    if method != "replay":
        ways.append(
            "`grad_wrt` naming fewer layers (e.g. the blocks' attention and MLP weights, "
            "'*.h.*.weight')"
        )
    ways.append("`memory_budget` (bytes) to bound the finalize and scoring blocks")
    ways.append("fewer tokens per document or smaller batches")
    return "; ".join(ways)


def refuse(plan: AttributionPlan, layered: bool, stage: str = "featurize") -> None:
    """Raise :class:`MemoryBudgetError` naming the estimate, what is free and the fixes.

    Raises:
        MemoryBudgetError: the plan does not fit ``stage``
            (:meth:`AttributionPlan.problems`).
    """
    problems = plan.problems(stage)
    if problems:
        raise MemoryBudgetError(
            f"attribution with method={plan.method!r} does not fit this machine: "
            + "; ".join(problems)
            + f". Fixes: {fixes(plan.method, layered, stage)}. The plan:\n{plan}"
        )


def _tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors an object holds as attributes (one level deep)."""
    seen: set[int] = set()
    total = 0
    for value in vars(obj).values() if hasattr(obj, "__dict__") else ():
        items = value if isinstance(value, (list, tuple)) else [value]
        for t in items:
            if isinstance(t, Tensor) and id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total


def model_bytes(model: nn.Module) -> int:
    """The model's parameters (twice: values and one gradient) and buffers."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return 2 * params + buffers


def _all_layers(model: nn.Module) -> list[FactoredLayer]:
    try:
        return find_layers(model, None, None)
    except ValueError:
        return []


def _largest_per_example(model: nn.Module, layers: list[FactoredLayer]) -> int:
    """Numbers of the largest parameter whose per-example gradient the streamed hooks form.

    A factored layer's weight is projected from its Kronecker factors a chunk
    at a time and an embedding's rows where they are; every other parameter's
    ``[B, *shape]`` gradient is formed whole, one at a time.
    """
    weights = (getattr(x.module, "weight", None) for x in layers if x.param is None)
    skipped = {id(w) for w in weights if isinstance(w, Tensor)}
    skipped |= {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return max((p.numel() for p in model.parameters() if id(p) not in skipped), default=0)


def vocabulary_head(model: nn.Module) -> int:
    """The output vocabulary of a Hugging Face language model (0 if it has none)."""
    head = getattr(model, "get_output_embeddings", None)
    module = head() if callable(head) else None
    weight = getattr(module, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, Tensor) else 0


def curvature_bytes(method: str, layers: list[FactoredLayer], width: int) -> int:
    """The method's curvature: per-layer float64 factors and eigenbases, or TRAK's Gram."""
    if method == "trak":
        return 2 * 8 * width * width  # XᵀX and its inverse
    if method in _NO_CURVATURE or not layers:
        return 0
    # A and S sums, their eigenvectors; the eigenvalues and EK-FAC's sums of squares.
    return sum(8 * (2 * (x.k_in**2 + x.k_out**2) + 2 * x.k_in * x.k_out) for x in layers)


def first_batch_shape(batch: Any) -> tuple[int, int]:
    """``(rows, positions per row)`` of a batch: token ids ``[B, T]`` give ``T``, else 1."""
    first = batch[0] if isinstance(batch, (tuple, list)) else batch
    if isinstance(batch, dict):
        first = batch.get("input_ids", next(iter(batch.values())))
    rows = int(first.shape[0])
    tokens = int(first.shape[1]) if first.dim() == 2 and not first.is_floating_point() else 1
    return rows, tokens


def plan_features(
    *,
    method: str,
    model: nn.Module,
    layers: list[FactoredLayer],
    featurizer: Any,
    projector: Any,
    train_set_size: int,
    width: int,
    grad_dim: int,
    itemsize: int,
    sampled: bool,
    memory_budget: int | None,
    save_dir: Path,
    batch: Any = None,
    rows_left: int | None = None,
    recompute: bool = False,
    head_width: int = 0,
) -> AttributionPlan:
    """The plan of a stored-features method (TRAK, identity, K-FAC, EK-FAC, registered ones).

    Args:
        method: the method.
        model: the model.
        layers: the factored layers (per-layer methods; else empty).
        featurizer: the per-layer featurizer (``None`` for projected methods).
        projector: the flat projector (projected methods).
        train_set_size: n.
        width: stored features per row k.
        grad_dim: differentiated coordinates d (projected methods).
        itemsize: bytes per stored number.
        sampled: ``curvature="sampled"`` (a second set of rows).
        memory_budget: the TRAKer's ``memory_budget``.
        save_dir: the store.
        batch: the first training batch (``None``: the model-only plan).
        rows_left: documents not featurized yet.
        recompute: ``rows="recompute"``: Q and a done flag are stored per document.
        head_width: the vocabulary of a language task's loss head: its log-odds
            hold one ``[B, T, V]`` float32 tensor at a time (the forward's
            ``exp``, then the backward's gradient) beside the logits and their
            gradient (those are counted with the activations).
    """
    layered = featurizer is not None
    notes = []
    every = _all_layers(model)
    rows, tokens = first_batch_shape(batch) if batch is not None else (0, 1)
    activations = 2 * 4 * rows * tokens * sum(x.d_in + x.d_out for x in every)
    activations += 4 * rows * tokens * head_width
    if layered:
        side = sum(x.k_in + x.k_out for x in layers)
        dense = featurizer.dense_width()
        if tokens == 1:
            row = featurizer.row_width("rank_one")
            form = "each layer's [a, g]"
        else:
            factored = featurizer.row_width("token_factors", [tokens] * len(layers))
            row = min(factored, dense)
            form = "each position's [a, g]" if factored < dense else "dense vec(G)"
        per_row = row * itemsize * (2 if sampled else 1) + 8
        gradients = 4 * rows * tokens * side + (4 * rows * dense if row == dense else 0)
        if batch is not None:
            notes.append(f"rows kept as {form} ({row} numbers per document)")
    else:
        per_row = width * itemsize + 4
        if getattr(projector, "streams_by_coordinates", False):
            # The hooks project each layer as it comes (HookGradientComputer.project): one
            # REST_CHUNK_BYTES chunk of a weight with Kronecker factors, or one other
            # parameter's per-example gradient, at a time; vmap holds each [B, *shape] once.
            largest = _largest_per_example(model, every)
            held = min(4 * rows * grad_dim, REST_CHUNK_BYTES + 4 * rows * largest)
        else:
            # The per-parameter gradients and their flat copy for the projector: GPT-2
            # small, 16 x 128 tokens, peaked at 17.3 GB RSS for 2 x 8 GB of them.
            held = 2 * 4 * rows * grad_dim
        gradients = held + 4 * rows * width
    if recompute:
        per_row = 8 + 1  # Q (float64) and the done flag; the rows are recomputed
        if batch is not None:
            notes.append("rows='recompute': no training rows stored, recomputed while scoring")
    working = memory_budget if memory_budget is not None else DEFAULT_BLOCK_BYTES
    return AttributionPlan(
        method=method,
        train_set_size=train_set_size,
        batch_rows=rows if batch is not None else None,
        tokens=tokens if batch is not None else None,
        store_bytes_per_row=per_row if batch is not None else 0,
        parameter_bytes=model_bytes(model),
        curvature_bytes=curvature_bytes(method, layers, width),
        gradient_bytes=gradients + activations if batch is not None else 0,
        projection_bytes=0 if projector is None else _tensor_bytes(projector),
        working_bytes=int(working),
        available_memory=available_memory(),
        baseline_bytes=resident_memory(),
        free_disk=free_disk(save_dir),
        rows_left=rows_left,
        notes=tuple(notes),
        curvature_at_finalize=method == "trak" and not recompute,
    )


def warn_finalize(plan: AttributionPlan, layered: bool, logger: logging.Logger) -> None:
    """Warn, before any work, where ``finalize_features`` will be refused (it refuses there)."""
    problems = plan.problems("finalize")
    if problems:
        logger.warning(
            "finalize_features will be refused with this plan: %s. Fixes: %s.",
            "; ".join(problems),
            fixes(plan.method, layered),
        )


def plan_replay(
    *,
    model: nn.Module,
    replay: Any,
    train_set_size: int,
    memory_budget: int | None,
    save_dir: Path,
    batch: Any = None,
    rows_left: int | None = None,
) -> AttributionPlan:
    """The plan of ``method="replay"``: the training rows it keeps, and the run's memory.

    The run's own memory (checkpoints, segment, adjoints) is
    :meth:`ReplayAttributor.memory_estimate` of one query where ``replay`` is a
    :class:`~gradsketch.attribution.ReplayAttributor`; a
    :class:`~gradsketch.attribution.ReplaySettings` builds the run at
    ``finalize_features``, so only the model's part is planned here.
    """
    notes = []
    planner = getattr(replay, "plan", None)
    working = 0
    # Measuring the run's activations runs a step: done at the first batch, not at construction.
    if callable(planner) and batch is not None:
        working = int(planner(1).working_bytes)
        notes.append("the run's memory: ReplayAttributor.plan(1)")
    else:
        notes.append("the run's memory is estimated when it is built (finalize_features)")
    if memory_budget is not None:
        working = min(working, int(memory_budget)) if working else int(memory_budget)
    per_row = 0
    if batch is not None:
        tensors = batch.values() if isinstance(batch, dict) else batch
        rows = int(first_batch_shape(batch)[0])
        kept = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, Tensor))
        # The row itself, and one float64 score per query later: 8 n per query.
        per_row = math.ceil(kept / max(rows, 1))
    rows, tokens = first_batch_shape(batch) if batch is not None else (0, 1)
    return AttributionPlan(
        method="replay",
        train_set_size=train_set_size,
        batch_rows=rows if batch is not None else None,
        tokens=tokens if batch is not None else None,
        store_bytes_per_row=per_row,
        parameter_bytes=model_bytes(model),
        working_bytes=working,
        available_memory=available_memory(),
        baseline_bytes=resident_memory(),
        free_disk=free_disk(save_dir),
        rows_left=rows_left,
        notes=tuple(notes),
    )


def model_plan(traker: Any, maker: Any, curvature: str) -> AttributionPlan:
    """A stored-features TRAKer's plan from the model alone, from its feature maker ``maker``.

    Made before the TRAKer's store, so a refused run leaves nothing behind.
    """
    return plan_features(
        method=traker.method,
        model=traker.model,
        layers=list(maker.layers),
        featurizer=maker.featurizer if maker.layered else None,
        projector=maker.projector,
        train_set_size=traker.train_set_size,
        width=maker.proj_dim,
        grad_dim=maker.grad_dim,
        itemsize=maker.dtype.itemsize,
        sampled=curvature == "sampled",
        memory_budget=traker.memory_budget,
        save_dir=traker.save_dir,
    )


def traker_plan(traker: Any, batch: Any = None, rows_left: int | None = None) -> AttributionPlan:
    """The plan of a :class:`~gradsketch.attribution.TRAKer` (and its first batch ``batch``)."""
    common: dict[str, Any] = dict(
        train_set_size=traker.train_set_size,
        memory_budget=traker.memory_budget,
        save_dir=traker.save_dir,
        batch=batch,
        rows_left=rows_left,
    )
    if traker.method == "replay":
        replay = getattr(traker._method, "_attributor", None)
        return plan_replay(model=traker.model, replay=replay, **common)
    layered = traker._kind == "per-layer"
    plan = plan_features(
        method=traker.method,
        model=traker.model,
        layers=list(traker.layers),
        featurizer=traker.featurizer if layered else None,
        projector=traker.projector,
        width=traker.proj_dim,
        grad_dim=traker.grad_dim,
        itemsize=traker.dtype.itemsize,
        sampled=traker.settings.curvature == "sampled",
        recompute=getattr(traker, "rows", "stored") == "recompute",
        head_width=_head_width(traker),
        **common,
    )
    return with_cache(plan, traker._method)


def with_cache(plan: AttributionPlan, method: Any) -> AttributionPlan:
    """``plan`` with what ``method``'s scoring cache holds (its ``cache_bytes``)."""
    cache = getattr(method, "score_cache", None)
    held = 0 if cache is None else int(cache.nbytes)
    return plan if held == plan.cache_bytes else replace(plan, cache_bytes=held)


def _head_width(traker: Any) -> int:
    """The vocabulary a TRAKer's task scores over (language tasks: per-token outputs)."""
    return vocabulary_head(traker.model) if hasattr(traker.task, "per_token_batch") else 0


def per_token_rows(task: Any, batch: Any) -> tuple[int, int]:
    """``(rows, tokens)`` of the largest pass of per-token scoring over ``batch``.

    Each of the ``B`` targets becomes ``T`` rows of ``T`` tokens, a few
    targets at a time (``max(1, B // T)``, as
    :meth:`~gradsketch.attribution._traker_features.FeatureMaker.token_features`
    groups them), so that a pass holds at most ``max(B, T)`` rows.
    """
    size = int(first_batch_shape(batch)[0])
    count = getattr(task, "per_token_length", None)
    first = batch[0] if isinstance(batch, (tuple, list)) else batch
    length = int(count(batch)) if callable(count) else int(first.shape[1])
    group = min(size, max(1, size // max(length, 1)))
    return group * length, length


def plan_per_token(traker: Any, batch: Any) -> AttributionPlan:
    """The TRAKer's plan with per-token scoring of ``batch`` counted; refused if it does not fit.

    Per-token scoring featurizes ``T`` copies of each target, each keeping
    one target token (:func:`per_token_rows`): the pass is planned as a
    training batch of that many rows would be (per-example gradients,
    activations, the loss head), and :meth:`AttributionPlan.stage_bytes`
    (``"score"``) adds the model, projector and working blocks. Logged at
    the first pass of each shape.

    Raises:
        MemoryBudgetError: the pass does not fit the available memory (before
            any of it is computed), naming the fixes.
    """
    current = traker.plan
    if traker.method == "replay":
        # The replay scores each token's query in its own reverse pass (ReplayAttributor.plan).
        return current
    rows, tokens = per_token_rows(traker.task, batch)
    if current.scoring_rows == rows and current.scoring_bytes:
        plan = replace(current, available_memory=available_memory())
    else:
        shape = torch.zeros(rows, tokens, dtype=torch.long)
        expanded = traker_plan(traker, (shape,), current.rows_left)
        plan = replace(
            current,
            scoring_bytes=expanded.gradient_bytes,
            scoring_rows=rows,
            available_memory=expanded.available_memory,
        )
    refuse(plan, traker._kind == "per-layer", stage="score")
    if plan.scoring_rows != current.scoring_rows:
        traker.logger.info("%s", plan)
    return plan


def stored_row_bytes(maker: Any, sampled: bool) -> int:
    """Bytes per document of stored rows in their widest form, and Q.

    Per-layer rows are kept narrower where the layers see few positions
    (``[a, g]``), but how many is known only from the first batch; the
    dense ``vec(G)`` bounds every form.
    """
    if maker.layered:
        width = maker.kronecker().dense_width() * (2 if sampled else 1)
    else:
        width = maker.proj_dim
    return int(width) * maker.dtype.itemsize + 8


def _rows_of_store(save_dir: Path) -> str | None:
    """The ``rows`` of the store at ``save_dir`` (``None``: no store there yet)."""
    path = Path(save_dir) / SETTINGS_FILE
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return str(record.get("rows", "stored")) if isinstance(record, dict) else None


def choose_rows(
    rows: str, plan: AttributionPlan, row_bytes: int, save_dir: Path, logger: logging.Logger
) -> str:
    """``"stored"`` or ``"recompute"`` for ``TRAKer(rows=rows)``; ``"auto"`` decided and logged.

    ``"auto"``: an existing store keeps its own mode; otherwise the rows are
    stored unless ``row_bytes`` per document (:func:`stored_row_bytes`) for
    every document exceed the free disk at the store (``GRADSKETCH_AVAILABLE_DISK``
    overrides it).
    """
    if rows != "auto":
        return rows
    existing = _rows_of_store(save_dir)
    if existing is not None:
        logger.info("rows='auto': %r, as the store at `%s` was made", existing, save_dir)
        return existing
    need = row_bytes * plan.train_set_size
    free = plan.free_disk if plan.free_disk is not None else free_disk(save_dir)
    if free is not None and need > free:
        logger.info(
            "rows='auto': 'recompute': the stored rows would need ~%s on disk but %s is free; "
            "training gradients are recomputed while scoring instead (only the curvature and "
            "Q are stored)",
            _gb(need),
            _gb(free),
        )
        return "recompute"
    logger.info(
        "rows='auto': 'stored': the rows need at most ~%s on disk%s",
        _gb(need),
        "" if free is None else f" and {_gb(free)} is free",
    )
    return "stored"


class FirstBatch:
    """The first batch's plan, timed while it is featurized (see :func:`plan_first_batch`)."""

    def __init__(self, plan: AttributionPlan, rows: int, logger: logging.Logger) -> None:
        self.plan, self.rows, self.logger = plan, rows, logger
        self.start, self.start_cpu = time.perf_counter(), time.process_time()

    def done(self) -> AttributionPlan:
        """The plan with the measured wall and CPU time per document (logged)."""
        rows = max(self.rows, 1)
        plan = self.plan.with_time(
            (time.perf_counter() - self.start) / rows, (time.process_time() - self.start_cpu) / rows
        )
        self.logger.info(
            "featurize: %.3g s per document on the first batch (%.3g CPU s), ~%s for the %s left",
            plan.seconds_per_row,
            plan.cpu_seconds_per_row,
            _duration(plan.seconds or 0.0),
            plan.rows_left,
        )
        return plan


@contextlib.contextmanager
def plan_first_batch(traker: Any, batch: Any, idx: Any) -> Iterator[FirstBatch | None]:
    """Plan from the first batch with rows to do, log it, refuse if it does not fit, then time it.

    Yields ``None`` where every row of the batch is stored already (nothing to plan from).

    Raises:
        MemoryBudgetError: the plan does not fit (before the batch is computed).
    """
    done = traker._method.done
    if done is not None and bool(done[idx].all()):
        yield None
        return
    left = traker.train_set_size - (0 if done is None else int(done.sum()))
    plan = rank_rows(traker_plan(traker, batch, left), getattr(traker._method, "owned", None), done)
    refuse(plan, traker._kind == "per-layer")
    traker.logger.info("%s", plan)
    yield FirstBatch(plan, len(idx), traker.logger)
