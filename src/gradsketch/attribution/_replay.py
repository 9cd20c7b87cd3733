"""Exact metagradients of query outputs with respect to every training example's weight.

Training is a function of per-example data weights ``w``: step ``t`` takes the
gradient of ``L_t(θ, w) = Σ_{i ∈ B_t} w_i ℓ_i(θ) / W_t`` over its batch
``B_t``, and the optimizer maps it to the next parameters; ``W_t`` is
``Σ_{i ∈ B_t} w_i`` (``ReplaySettings.subset_loss="kept_mean"``, the default:
at a 0/1 mask, the run retrained on the kept rows) or ``|B_t|``
(``"full_batch"``). For a query output
``f_q(θ_T)`` the metagradient ``∂f_q / ∂w_i`` at ``w = 1`` says how the query
moves when example ``i`` is up- or down-weighted *in this very run* (same
initialization, same batch order). Removing example ``i`` changes ``f_q`` by
about ``-∂f_q / ∂w_i`` (MAGIC: Ilyas & Engstrom, "MAGIC: Near-Optimal Data
Attribution for Deep Learning", 2025; reverse-mode through training:
Maclaurin et al., "Gradient-based Hyperparameter Optimization through
Reversible Learning", ICML 2015). The expansion can be taken at other
weights ``w_0`` (``ReplaySettings.linearize_at``, e.g. a subset's mask):
``f(w_S) ≈ f(w_0) + Σ_i ∂f_q / ∂w_i (w_S,i - w_0,i)``. ``linearize_at="auto"``
chooses among candidate settings by LDS against a stated number of validation
retrains of the run (``_replay_auto``; the choice is kept with the scores).

:class:`ReplayAttributor` trains with its own functional optimizer (SGD with
momentum and weight decay, Adam, AdamW; a learning rate per step), keeps a
checkpoint every ``k ≈ √T`` steps, and then runs backwards through the steps:
each segment between checkpoints is recomputed forward, and each step is
reversed with the optimizer's own adjoint rules and one second-order product
through the weighted loss: ``H d̄`` and the per-example ``∇ℓ_i · d̄`` from one
forward-over-reverse ``torch.func.jvp`` of ``torch.func.grad`` (reverse-over-
reverse with a batched second backward for models ``vmap`` cannot trace). A
block of ``m`` queries is carried through one reverse pass as ``[m, ...]``
cotangents (``vmap`` over the step's product), so the recomputation, the
forward and the first backward are shared by the block; the FLOPs of the
products still grow with ``m``.

Memory: ``⌈T/k⌉ · S + k · (S + G)`` for checkpoints and one segment's states
and gradients, plus ``m · S`` for the adjoints and ``m · n_train`` scores,
plus one step's activations (times ``m + 2`` for the batched double backward;
blocks under :data:`JVP_MIN_BLOCK` also keep the segment's ``k`` step
graphs), where ``S = P · (1 + s) · bytes`` for ``P`` parameters and ``s``
optimizer state tensors per parameter (SGD 0, SGD with momentum 1, Adam /
AdamW 2), and ``G = P · bytes`` for Adam / AdamW (each step's gradient, kept
for the reverse rules) and 0 for SGD.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Generic, TypeVar

import numpy as np
import torch
from torch import Tensor, nn

from gradsketch._checks import check_int, check_number, positive_int
from gradsketch._device import to_device
from gradsketch._integrity import damage_message
from gradsketch._settings import read_record
from gradsketch._store import RowStore
from gradsketch.attribution import _plan
from gradsketch.attribution._modelout import AbstractModelOutput
from gradsketch.attribution._plan import AttributionPlan, refuse
from gradsketch.attribution._replay_auto import (
    AUTO_CANDIDATES,
    AUTO_RETRAINS,
    AutoLinearization,
    LinearizationChoice,
    choose,
)
from gradsketch.attribution._replay_losses import (
    TRAINING_LOSSES,
    BatchLoss,
    classification_loss,
    language_modeling_loss,
    register_training_loss,
    resolve_training_loss,
)
from gradsketch.attribution._replay_reverse import JVP_MIN_BLOCK, ReversePass
from gradsketch.attribution._replay_run import (
    REPLAY_OPTIMIZERS,
    SUBSET_LOSSES,
    Layout,
    Params,
    ReplayRun,
    ReplaySettings,
    batch_order,
    fingerprint,
    materialize,
)
from gradsketch.attribution._topk import TopK, TopKCollector
from gradsketch.errors import MemoryBudgetError, StoreIntegrityError

__all__ = [
    "AUTO_CANDIDATES",
    "AUTO_RETRAINS",
    "JVP_MIN_BLOCK",
    "REPLAY_OPTIMIZERS",
    "SUBSET_LOSSES",
    "TRAINING_LOSSES",
    "AutoLinearization",
    "BatchLoss",
    "LinearizationChoice",
    "MemoryEstimate",
    "ReplayAttributor",
    "ReplaySettings",
    "batch_order",
    "classification_loss",
    "language_modeling_loss",
    "register_training_loss",
]

logger = logging.getLogger(__name__)

# The name other modules imported before the training losses had their own module.
_resolve_loss = resolve_training_loss


@dataclass
class MemoryEstimate:
    """Bytes a reverse pass needs (see the module docstring for the formula).

    Attributes:
        checkpoints: kept checkpoints, ``⌈T/k⌉ · S``.
        segment: one segment's recomputed states, and for Adam / AdamW their
            gradients, ``k · (S + G)``.
        adjoints: the ``[m, ...]`` adjoints of parameters and state, ``m · S``.
        scores: the ``[m, n_train]`` metagradients.
        activations: one step's saved activations for the batched double
            backward (measured on the first batch, times ``m + 2``).
        graphs: the segment's kept step graphs when the block is pulled back
            by reverse-over-reverse (``m <`` :data:`JVP_MIN_BLOCK`): ``k``
            times one step's forward and first backward with its graph
            (measured on the first batch); 0 otherwise.
    """

    checkpoints: int
    segment: int
    adjoints: int
    scores: int
    activations: int
    graphs: int = 0

    @property
    def total(self) -> int:
        """The sum of the parts (every field)."""
        return sum(getattr(self, part.name) for part in fields(self))


def _note_unwarmed_adam(settings: ReplaySettings) -> None:
    """Log once per process when an Adam run's first step has a nonzero rate.

    That step is ``lr · g / (|g| + ε)``, the sign of the gradient: its exact
    derivative spikes (height ``lr / ε``) wherever a gradient entry is near 0,
    and those spikes are in the metagradients although finite removals,
    which flip signs, do not follow them. A warmup from 0 removes them. For a
    run already trained, only ``subset_loss="full_batch"`` offers another
    way: there ``linearize_at=α`` scales the loss, and so the gradients, by
    α, and Adam's ε acts as ``ε / α`` (``_SMOOTH_ADAM_EPS`` or more is not
    noted). That holds only without L2 decay: ``adam``'s ``weight_decay`` is
    not scaled with the loss, so at a small α it outweighs the loss and
    trains another model, and the note does not advise it. With
    ``"kept_mean"``, ``linearize_at`` keeps the run, and smooths nothing.
    """
    global _ADAM_NOTED
    first = settings.lr_at(0)
    if _ADAM_NOTED or settings.optimizer not in ("adam", "adamw") or first == 0.0:
        return
    at = settings.linearize_at
    full_batch = settings.subset_loss == "full_batch"
    l2 = settings.optimizer == "adam" and settings.weight_decay > 0
    # The margin lets eps=1e-8 at linearize_at=1e-4 (whose quotient rounds to
    # just under 1e-4) count as smoothed, as the advice itself suggests.
    smoothed = isinstance(at, float) and settings.eps / at >= _SMOOTH_ADAM_EPS * (1 - 1e-9)
    if full_batch and not l2 and smoothed:
        return
    _ADAM_NOTED = True
    low = settings.eps / _SMOOTH_ADAM_EPS
    if l2:
        other = (
            "Linearizing low does not help this run: its L2 weight_decay is not scaled with "
            "the loss, so at a small linearize_at it outweighs the loss and trains another model"
        )
    elif full_batch:
        other = (
            f"For a run already trained, linearize it at a small weight: linearize_at={low:g} "
            f"makes Adam's ε act as {_SMOOTH_ADAM_EPS:g}"
        )
    else:
        other = (
            "For a run already trained, linearize it low with subset_loss='full_batch' (which "
            "predicts retrains that divide each batch's loss by its full size): there "
            f"linearize_at={low:g} makes Adam's ε act as {_SMOOTH_ADAM_EPS:g}; with "
            "subset_loss='kept_mean' linearize_at keeps the run and smooths nothing"
        )
    logger.warning(
        "replaying %s whose first step has lr=%g: that step is the sign of the gradient, "
        "and its exact derivative spikes where a gradient entry is near 0, so these "
        "metagradients predict removals of many examples poorly. To predict retrains "
        "(LDS, datamodels), train the run with a learning-rate warmup from 0 (e.g. "
        "transformers' get_linear_schedule_with_warmup). %s. Measured effect: "
        "docs/attribution.md, 'Adam runs: warm the rate up, or linearize low'.",
        settings.optimizer,
        first,
        other,
    )


def _note_unpredictable_run(settings: ReplaySettings, n_train: int) -> bool:
    """Warn where the protocol suite measured the replay alone below K-FAC; True when it did.

    The runs: ``adam`` with L2 ``weight_decay``, full batch (every step sees
    every row), a nonzero rate at step 0. On the suite's two runs of that kind
    (:mod:`gradsketch.demos.protocols.suite`, one in each half) no
    ``linearize_at`` or ``subset_loss`` recovered retrain predictions; the rule
    the suite chose on its first half for Adam (``RECOMMENDED["replay"]["adam"]``)
    and reported on the second is the z-scored blend of the replay averaged
    over three checkpoints with K-FAC's scores (:meth:`ReplayAttributor.blend`),
    so the warning states what to expect and names that blend.
    """
    if (
        settings.optimizer != "adam"
        or settings.weight_decay == 0
        or settings.lr_at(0) == 0.0
        or settings.batch_size < n_train
    ):
        return False
    logger.warning(
        "replaying full-batch Adam with L2 weight_decay and no learning-rate warmup: on the "
        "protocol suite's runs of this kind (digits MLP, lr 1e-2, L2 1e-4, 100 and 300 "
        "full-batch steps) these metagradients alone scored LDS 0.46-0.53 against "
        "same-initialization retrains and 0.29-0.31 against fresh-seed retrains, below "
        "K-FAC's 0.57-0.59 and 0.41-0.46, at every linearize_at and subset_loss tried. To "
        "predict retrains, blend them with K-FAC's scores of the trained model (zero extra "
        "training): ReplayAttributor.blend(replay.metagradients(queries, at_steps='thirds'), "
        "kfac_scores), kfac_scores from TRAKer(method='kfac') on replay.load_final(); there "
        "it scored 0.65-0.71 same-init and 0.48-0.50 fresh seeds, level with or above K-FAC "
        "(benchmarks/RESULTS.md, 'Protocol suite'). Or train with a warmup from 0."
    )
    return True


def _checked_auto(linearize_at: Any, auto: AutoLinearization | None) -> AutoLinearization | None:
    """``auto`` where ``linearize_at`` is ``"auto"``; refused when one comes without the other."""
    is_auto = isinstance(linearize_at, str) and linearize_at == "auto"
    if auto is not None and not isinstance(auto, AutoLinearization):
        raise TypeError(
            f"`auto_linearize` must be an AutoLinearization, got {type(auto).__name__}; pass "
            "auto_linearize=AutoLinearization(queries=(x_val, y_val))."
        )
    if is_auto and auto is None:
        raise ValueError(
            "`linearize_at`='auto' chooses the setting on validation queries, but "
            "`auto_linearize` is None; pass auto_linearize=AutoLinearization(queries=(x_val, "
            "y_val)) with held-out examples, or a number as `linearize_at`."
        )
    if auto is not None and not is_auto:
        raise ValueError(
            f"`auto_linearize` is given but `linearize_at`={linearize_at!r}; it is read only "
            "with linearize_at='auto': pass that, or drop auto_linearize."
        )
    return auto


def _checked_steps(at_steps: Sequence[int] | str, total: int) -> tuple[int, ...]:
    """``at_steps`` as distinct sorted steps in ``1..total`` (``"thirds"``: ⌈T/3⌉, ⌈2T/3⌉, T)."""
    if isinstance(at_steps, str):
        if at_steps != "thirds":
            raise ValueError(
                f"`at_steps`={at_steps!r}: give step counts (e.g. [100, 200, 300]) or 'thirds'."
            )
        return tuple(sorted({math.ceil(total * k / 3) for k in (1, 2, 3)}))
    steps = tuple(sorted({int(t) for t in at_steps}))
    if not steps or steps[0] < 1 or steps[-1] > total:
        raise ValueError(
            f"`at_steps`={list(at_steps)}: give steps t with 1 <= t <= num_steps={total} (the "
            "parameters after t steps), or 'thirds'."
        )
    return steps


#: The effective Adam ε (``eps / linearize_at``) from which an unwarmed run's
#: metagradients are smooth enough to predict removals (measured on the
#: standard-library GPT-2, from scratch and fine-tuned; docs/attribution.md).
_SMOOTH_ADAM_EPS = 1e-4


_ADAM_NOTED = False


_T = TypeVar("_T")


class _Part(Generic[_T]):
    """An attribute of :class:`ReplayAttributor` that lives on one of its parts.

    The attributor composes a :class:`ReplayRun` and a :class:`ReversePass`;
    this keeps the names it has always had (``replay.final``, ``replay.order``,
    ...) pointing at them. Read-only unless ``writable``.
    """

    def __init__(self, part: str, name: str, *, writable: bool = False) -> None:
        self.part, self.name, self.writable = part, name, writable

    def __get__(self, obj: Any, objtype: Any = None) -> _T:
        if obj is None:
            return self  # type: ignore[return-value]
        value: _T = getattr(getattr(obj, self.part), self.name)
        return value

    def __set__(self, obj: Any, value: _T) -> None:
        if not self.writable:
            raise AttributeError(f"`{self.name}` is the replayed run's own; it cannot be set.")
        setattr(getattr(obj, self.part), self.name, value)


class ReplayAttributor:
    """Train a replayable run, then score queries by exact metagradients (MAGIC).

    Scores are ``[n_train, m]``: entry ``(i, j)`` is ``∂f_j(θ_T) / ∂w_i`` at
    ``w = 1`` (or ``linearize_at``), the derivative of query ``j``'s output (the task's, e.g. the
    classification margin) with respect to training example ``i``'s weight in
    the loss. Positive: up-weighting ``i`` raises the output (a proponent);
    leaving ``i`` out changes the output by about ``-scores[i, j]``.
    ``linearize_at`` moves the expansion to other weights (one per row, e.g.
    a subset's mask), and ``subset_loss`` says which retrains on subsets the
    scores predict: by default those that average each batch's loss over its
    kept rows (see :class:`ReplaySettings`).

    Args:
        model: the model; its current parameters are the run's initialization
            (they are not changed; :meth:`load_final` loads the trained ones).
        task: a task name or :class:`AbstractModelOutput` (the query output, and
            the training loss through :data:`TRAINING_LOSSES`).
        train_data: the training set: a tuple of ``[n, ...]`` tensors, a dict
            batch, a ``datasets.Dataset``, or an iterable of batches.
        settings: a :class:`ReplaySettings` (or pass its fields as keywords).
        order: explicit batches of training-row indices, one per step (overrides
            ``seed`` and ``num_steps``).
        loss_fn: ``(model, *batch) -> [B]`` per-example training losses of one
            batched forward (default: the task's, from :data:`TRAINING_LOSSES`).
        save_dir: where scores are stored (resumable; other settings refused).
        memory_budget: bytes a reverse pass may use; query blocks are sized to
            fit and :class:`MemoryBudgetError` is raised when none does.
        progress: show tqdm bars.
        auto_linearize: with ``linearize_at="auto"`` (and only then), how the
            setting is chosen: an :class:`AutoLinearization` with the
            validation queries (:meth:`train` chooses, then trains the chosen
            run; :attr:`linearization` holds the choice).

    Example:
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> model = torch.nn.Linear(4, 3).double()
        >>> x, y = torch.randn(12, 4, dtype=torch.float64), torch.arange(12) % 3
        >>> replay = ReplayAttributor(model, "image_classification", (x, y),
        ...                           num_steps=6, batch_size=4, lr=0.5, progress=False)
        >>> replay.train()
        >>> replay.score((x[:2], y[:2])).shape
        torch.Size([12, 2])
    """

    def __init__(
        self,
        model: nn.Module,
        task: str | AbstractModelOutput,
        train_data: Any,
        settings: ReplaySettings | None = None,
        *,
        order: Sequence[Any] | None = None,
        loss_fn: BatchLoss | None = None,
        save_dir: str | Path | None = None,
        memory_budget: int | None = None,
        progress: bool = True,
        auto_linearize: AutoLinearization | None = None,
        **settings_kwargs: Any,
    ) -> None:
        if settings is not None and settings_kwargs:
            raise TypeError(
                f"pass either `settings` or settings keywords, not both (got "
                f"{sorted(settings_kwargs)} with settings)."
            )
        self.run = ReplayRun(
            model, task, train_data, settings, settings_kwargs, order=order, loss_fn=loss_fn
        )
        self.reverse_pass = ReversePass(self.run)
        _note_unwarmed_adam(self.run.settings)
        _note_unpredictable_run(self.run.settings, self.run.n_train)
        self.save_dir = None if save_dir is None else Path(save_dir)
        check_int("memory_budget", memory_budget, low=1, optional=True)
        self.memory_budget = memory_budget
        self.progress = progress
        self._scores: dict[str, Tensor] = {}
        self._tokens: dict[str, int] = {}
        self._activation_bytes: tuple[int, int] | None = None
        self._auto = _checked_auto(self.run.settings.linearize_at, auto_linearize)
        #: What ``linearize_at="auto"`` chose (``None`` before :meth:`train`, or without it).
        self.linearization: LinearizationChoice | None = None

    @classmethod
    def from_trainer(
        cls,
        trainer: Any,
        callback: Any,
        task: str | AbstractModelOutput = "language_modeling",
        **kwargs: Any,
    ) -> ReplayAttributor:
        """The replay of a Hugging Face ``Trainer`` run recorded by a :class:`ReplayCallback`.

        Same as ``callback.attributor(trainer, task, **kwargs)``: a copy of
        ``trainer.model`` at the initial weights, the Trainer's rows, batch
        order, optimizer and per-step learning rates (call :meth:`train` next).
        """
        build = getattr(callback, "attributor", None)
        if not callable(build) or not hasattr(callback, "lrs"):
            raise TypeError(
                f"`callback` must be the ReplayCallback the Trainer trained with, got "
                f"{type(callback).__name__}."
            )
        replay: ReplayAttributor = build(trainer, task, **kwargs)
        return replay

    # The run's parts, read (and a few set) through the attributor as before the split.
    model: _Part[nn.Module] = _Part("run", "model")
    task: _Part[AbstractModelOutput] = _Part("run", "task")
    settings: _Part[ReplaySettings] = _Part("run", "settings")
    data: _Part[tuple[Tensor, ...]] = _Part("run", "data")
    n_train: _Part[int] = _Part("run", "n_train")
    order: _Part[list[Tensor]] = _Part("run", "order")
    every: _Part[int] = _Part("run", "every")
    params0: _Part[Params] = _Part("run", "params0")
    buffers: _Part[Params] = _Part("run", "buffers")
    checkpoints: _Part[dict[int, tuple[Tensor, dict[str, Tensor]]]] = _Part("run", "checkpoints")
    final: _Part[Params | None] = _Part("run", "final")
    timings: _Part[dict[str, float]] = _Part("run", "timings")
    _layout: _Part[Layout] = _Part("run", "layout")
    _vmap_ok: _Part[bool | None] = _Part("run", "vmap_ok", writable=True)
    _jvp_min_block: _Part[int] = _Part("reverse_pass", "jvp_min_block", writable=True)

    # -- the run ------------------------------------------------------------------------
    def train(self) -> None:
        """Train the run, keeping a checkpoint every ``checkpoint_every`` steps.

        With ``linearize_at="auto"`` the first call chooses the setting first
        (:meth:`choose_linearization` with ``auto_linearize``) and keeps the
        chosen candidate's trained run: the attributor is then the one built
        with that ``linearize_at`` and ``subset_loss``.
        """
        if self._auto is None or self.linearization is not None:
            self.run.train()
            return
        auto = self._auto
        choice, chosen = choose(self.run, auto)
        self.linearization = choice
        jvp_min_block = self.reverse_pass.jvp_min_block
        self.run, self.reverse_pass = chosen, ReversePass(chosen)
        self.reverse_pass.jvp_min_block = jvp_min_block
        self._activation_bytes = None

    def choose_linearization(
        self,
        queries: Any,
        *,
        candidates: Sequence[tuple[float, str]] = AUTO_CANDIDATES,
        retrains: int = AUTO_RETRAINS,
        seed: int = 0,
        side_by_side: int = 16,
    ) -> LinearizationChoice:
        """Score each candidate ``(linearize_at, subset_loss)`` on validation retrains.

        Draws ``retrains`` random halves (``seed``), retrains the run on each
        from its initialization and batch order with its ``subset_loss`` (the
        same-initialization truth), and returns the candidate whose
        metagradients of ``queries`` reach the highest LDS, with every
        candidate's LDS and the CPU seconds spent (logged too). The
        attributor is not changed; ``linearize_at="auto"`` adopts the choice.
        Cost: ``retrains`` runs plus one run and reverse pass per candidate.
        """
        options = AutoLinearization(queries, retrains, candidates, seed, side_by_side)
        return choose(self.run, options)[0]

    def retrain(self, weights: Tensor | None = None) -> Params:
        """Final parameters of the same run with per-example ``weights`` ``[n_train]``.

        With ``weights`` zero on left-out rows (and 1 on kept ones) this is
        MAGIC's leave-out model: same initialization, same batch order, only
        those rows' losses removed. The weights are taken as given, whatever
        ``linearize_at`` is; ``None`` means the run's own weights,
        ``linearize_at`` (the trained run itself).
        """
        return self.run.retrain(weights)

    def load_final(self) -> nn.Module:
        """Copy the trained parameters into ``model`` (and return it).

        They are the run at weights ``linearize_at``: with any weight under 1
        not the ordinary run's model.
        """
        final = self.run.require_trained()
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                p.copy_(final[n])
        return self.model

    def outputs(self, queries: Any, params: Params | None = None) -> Tensor:
        """``[m]`` query outputs ``f_j`` under ``params`` (default: the trained run's)."""
        return self.run.outputs(queries, params)

    def _require_trained(self) -> Params:
        return self.run.require_trained()

    # -- memory -----------------------------------------------------------------------
    def state_bytes(self) -> int:
        """``S``: bytes of the parameters plus the optimizer's state."""
        return self._param_bytes() * (1 + len(self.settings.state_names))

    def _param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params0.values())

    def _grad_bytes(self) -> int:
        """``G``: bytes of one step's gradient kept per segment step (Adam / AdamW only)."""
        return 0 if self.settings.optimizer == "sgd" else self._param_bytes()

    def _measure_activations(self) -> tuple[int, int]:
        """Bytes autograd saves for one step: a plain backward, and one kept for a second."""
        if self._activation_bytes is None:
            self._activation_bytes = self.reverse_pass.measure_activations()
        return self._activation_bytes

    def memory_estimate(self, num_queries: int) -> MemoryEstimate:
        """Bytes a reverse pass over ``num_queries`` queries needs (module docstring's formula)."""
        positive_int("num_queries", num_queries)
        s = self.state_bytes()
        steps = self.settings.num_steps
        item = next(iter(self.params0.values())).element_size()
        return MemoryEstimate(
            checkpoints=math.ceil(steps / self.every) * s,
            segment=min(self.every, steps) * (s + self._grad_bytes()),
            adjoints=num_queries * s,
            scores=num_queries * self.n_train * item,
            activations=(num_queries + 2) * self._measure_activations()[0],
            graphs=(
                min(self.every, steps) * self._measure_activations()[1]
                if self.reverse_pass.keeps_graphs(num_queries)
                else 0
            ),
        )

    def _block_size(self, num_queries: int, block: int | None) -> int:
        if block is not None:
            positive_int("query_block", block)
            size = min(block, num_queries)
        else:
            size = num_queries
        if self.memory_budget is None:
            return size
        while size >= 1 and self.memory_estimate(size).total > self.memory_budget:
            size //= 2
        if size < 1:
            need = self.memory_estimate(1)
            raise MemoryBudgetError(
                f"`memory_budget`={self.memory_budget} bytes is too small for even one query: "
                f"the replay needs {need.total} bytes ({need}). Raise the budget, or keep fewer "
                f"checkpoints (checkpoint_every={self.every} of {self.settings.num_steps} steps; "
                "about √T minimizes checkpoints plus segment)."
            )
        return size

    def plan(self, num_queries: int = 1) -> AttributionPlan:
        """The run's :class:`~gradsketch.attribution.AttributionPlan` for ``num_queries`` queries.

        Memory is :meth:`memory_estimate` (one step's activations measured on
        the first batch, the random state left as it was); the store keeps one
        float64 score per training row and query (with ``save_dir``).
        """
        with torch.random.fork_rng(devices=[]):
            estimate = self.memory_estimate(num_queries)
        stored = 8 * int(num_queries) if self.save_dir is not None else 0
        return AttributionPlan(
            method="replay",
            train_set_size=self.n_train,
            batch_rows=int(num_queries),
            store_bytes_per_row=stored,
            parameter_bytes=self._param_bytes(),
            working_bytes=estimate.total,
            # Through the module: what the machine offers is looked up (and overridden) there.
            available_memory=_plan.available_memory(),
            free_disk=None if self.save_dir is None else _plan.free_disk(self.save_dir),
            rows_left=self.n_train,
            notes=(f"reverse pass over {num_queries} queries: {estimate}",),
        )

    # -- metagradients over query blocks -------------------------------------------------
    def metagradients(
        self,
        queries: Any,
        *,
        query_block: int | None = None,
        at_steps: Sequence[int] | str | None = None,
    ) -> Tensor:
        """``[n_train, m]`` exact metagradients ``∂f_j(θ_T) / ∂w_i``, on the model's device.

        Those are ``settings.linearize_at`` (default 1 on every row, the
        ordinary run).

        Args:
            queries: the query examples, in any form ``train_data`` takes.
            query_block: queries carried through one reverse pass (default:
                all, or as many as fit ``memory_budget``).
            at_steps: average over checkpoints: the mean over ``t`` in
                ``at_steps`` of ``∂f_j(θ_t) / ∂w_i``, ``θ_t`` the parameters
                after ``t`` of the ``T`` steps (each ``1 ≤ t ≤ T``), in the same
                single reverse pass; ``"thirds"``: ``⌈T/3⌉, ⌈2T/3⌉, T``, the
                protocol suite's setting for Adam with L2 (with :meth:`blend`).
                Default: ``T`` alone.
        """
        steps = None if at_steps is None else _checked_steps(at_steps, self.settings.num_steps)
        self.run.require_trained()
        batch = to_device(materialize(queries, self.task), self.run.device)
        m = int(batch[0].shape[0])
        size = self._block_size(m, query_block)
        plan = self.plan(size)
        refuse(plan, layered=False)
        logger.info("%s", plan)
        blocks = [
            self.reverse_pass.reverse(
                tuple(t[j : j + size] for t in batch), progress=self.progress, at_steps=steps
            )
            for j in range(0, m, size)
        ]
        return torch.cat(blocks, dim=1)

    @staticmethod
    def blend(scores: Tensor, other: Tensor, *, weight: float = 0.5) -> Tensor:
        """``[n_train, m]`` ``weight · z(scores) + (1 − weight) · z(other)``, column by column.

        ``z`` standardizes each query's column over the training rows (mean 0,
        standard deviation 1; a column without spread becomes 0), so that
        metagradients and another method's scores of the same run and queries
        (e.g. ``TRAKer(method="kfac")``'s), on unrelated scales, average with
        equal say. On the protocol suite's Adam runs with L2 the mean of
        ``metagradients(..., at_steps="thirds")`` and K-FAC's scores predicts
        fresh-seed retrains better than either (``benchmarks/RESULTS.md``,
        'Protocol suite').

        Example:
            >>> a = torch.tensor([[1.0], [2.0], [3.0]])
            >>> ReplayAttributor.blend(a, -a).abs().max().item()
            0.0
        """
        if scores.shape != other.shape:
            raise ValueError(
                f"`scores` {tuple(scores.shape)} and `other` {tuple(other.shape)} differ: blend "
                "two methods' scores of the same training rows and queries."
            )
        check_number("weight", weight, low=0.0)
        if weight > 1.0:
            raise ValueError(f"`weight`={weight}: give a share of `scores` in [0, 1].")

        def z(s: Tensor) -> Tensor:
            s = s.to(torch.float64)
            std = s.std(dim=0, correction=0, keepdim=True)
            return (s - s.mean(dim=0, keepdim=True)) / torch.where(std > 0, std, 1.0)

        return weight * z(scores) + (1.0 - weight) * z(other.to(scores.device))

    # -- scores in a store ------------------------------------------------------------
    def _record(self, batch: tuple[Tensor, ...], tokens: int = 0) -> dict[str, Any]:
        """Everything that fixes the scores: settings, data, order, initialization, queries."""
        return {
            **self.settings.record(),
            "method": "replay",
            "task": type(self.task).__name__,
            "n_train": self.n_train,
            "checkpoint_every": self.every,
            "train_data": fingerprint(self.data),
            "order": fingerprint(self.order),
            "init": fingerprint(self.params0.values()),
            "queries": fingerprint(batch),
            "num_queries": int(batch[0].shape[0]),
            "per_token": tokens,
            **(
                {}
                if self.linearization is None
                else {"linearize_auto": self.linearization.record()}
            ),
        }

    def score(
        self,
        queries: Any,
        *,
        exp_name: str = "default",
        query_block: int | None = None,
        per_token: bool = False,
    ) -> Tensor:
        """Metagradient scores ``[n_train, m]`` of ``queries``, kept as ``exp_name``.

        With ``save_dir`` the scores go to a row store (one row per query,
        written block by block): a rerun with the same run and queries reads
        the finished queries back and computes only the rest, and a rerun with
        other settings, data, order, initialization or queries is refused
        (:class:`~gradsketch.errors.SettingsMismatchError`, both values shown).

        Args:
            queries: the query examples, in any form ``train_data`` takes.
            exp_name: name of the scores (a folder of ``save_dir``).
            query_block: queries carried through one reverse pass.
            per_token: for language tasks, one query per target token: scores
                ``[n_train, m, seq_len]`` whose sum over tokens is the
                whole-query score (the output is a sum over tokens).
        """
        batch = materialize(queries, self.task)
        tokens = 0
        if per_token:
            expand = getattr(self.task, "per_token_batch", None)
            if not callable(expand):
                raise ValueError(
                    f"`per_token=True` needs a task with per-token outputs (language_modeling, "
                    f"seq2seq_lm), but the task is {type(self.task).__name__}; drop per_token."
                )
            tokens = int(self.task.per_token_length(batch))  # type: ignore[attr-defined]
            batch = tuple(expand(batch))
        self._tokens[exp_name] = tokens
        m = int(batch[0].shape[0])
        if self.save_dir is None:
            scores = self.metagradients(batch, query_block=query_block)
            self._scores[exp_name] = scores.cpu()
            return self.finalize_scores(exp_name)
        store = RowStore(
            self.save_dir / exp_name, self._record(batch, tokens), what="replay scores"
        )
        store.require_array("scores", (m, self.n_train), np.float64)
        store.require_done("scores.done", m)
        damaged = store.unflag_damaged(["scores"], "scores.done")
        if damaged:
            logger.warning(
                "%s",
                damage_message(
                    damaged,
                    what=f"the replay scores `{store.path}` have missing or damaged rows",
                    fix="Scoring those queries again.",
                    by_rows=True,
                ),
            )
        todo = np.flatnonzero(~store.done_rows("scores.done"))
        if todo.size:
            size = self._block_size(int(todo.size), query_block)
            for j in range(0, todo.size, size):
                rows = todo[j : j + size]
                sel = torch.as_tensor(rows)
                block = self.metagradients(tuple(t[sel] for t in batch), query_block=size)
                store.write_rows(
                    rows, {"scores": block.T.double().cpu().numpy()}, done="scores.done"
                )
        scores = torch.from_numpy(np.asarray(store.array("scores")[:])).T.contiguous()
        self._scores[exp_name] = scores
        return self.finalize_scores(exp_name)

    def finalize_scores(self, exp_name: str = "default") -> Tensor:
        """The scores of ``exp_name`` (from this session or the store).

        ``[n_train, m]``, or ``[n_train, m, seq_len]`` for ``per_token`` scores.
        """
        flat = self._flat_scores(exp_name)
        tokens = self._tokens.get(exp_name, 0)
        return flat.reshape(flat.shape[0], -1, tokens) if tokens else flat

    def _flat_scores(self, exp_name: str) -> Tensor:
        if exp_name in self._scores:
            return self._scores[exp_name]
        if self.save_dir is not None and (self.save_dir / exp_name / "scores.done").exists():
            path = self.save_dir / exp_name
            record = read_record(path / "settings.json")
            self._tokens[exp_name] = int(record.get("per_token", 0))
            store = RowStore(path, record, what="replay scores")
            done = store.done_rows("scores.done")
            if not done.all():
                raise RuntimeError(
                    f"the replay scores `{path}` are incomplete ({int(done.sum())} of {done.size} "
                    "queries); call `score(queries, exp_name=...)` again to finish them."
                )
            damaged = store.unflag_damaged(["scores"], "scores.done")
            if damaged:
                raise StoreIntegrityError(
                    damage_message(
                        damaged,
                        what=f"the replay scores `{path}` have missing or damaged rows",
                        fix=f"They were unflagged: call `score(queries, exp_name={exp_name!r})` "
                        "again (only these queries are recomputed).",
                        by_rows=True,
                    )
                )
            return torch.from_numpy(np.asarray(store.array("scores")[:])).T.contiguous()
        raise KeyError(
            f"`exp_name`={exp_name!r} has no scores; call `score(queries, exp_name={exp_name!r})` "
            "first."
        )

    def topk(self, k: int, exp_name: str = "default") -> TopK:
        """The ``k`` strongest proponents and opponents of each query."""
        scores = self._flat_scores(exp_name)
        collector = TopKCollector(scores.shape[0], scores.shape[1], k)
        collector[0 : scores.shape[0], 0 : scores.shape[1]] = scores.cpu().numpy()
        return collector.result()
