"""Exact metagradients of query outputs with respect to every training example's weight.

Training is a function of per-example data weights ``w``: step ``t`` takes the
gradient of ``L_t(θ, w) = (1 / |B_t|) Σ_{i ∈ B_t} w_i ℓ_i(θ)`` over its batch
``B_t``, and the optimizer maps it to the next parameters. For a query output
``f_q(θ_T)`` the metagradient ``∂f_q / ∂w_i`` at ``w = 1`` says how the query
moves when example ``i`` is up- or down-weighted *in this very run* (same
initialization, same batch order). Removing example ``i`` changes ``f_q`` by
about ``-∂f_q / ∂w_i`` (MAGIC: Ilyas & Engstrom, "MAGIC: Near-Optimal Data
Attribution for Deep Learning", 2025; reverse-mode through training:
Maclaurin et al., "Gradient-based Hyperparameter Optimization through
Reversible Learning", ICML 2015). For subsets keeping a fraction ``α`` of
the rows the expansion is taken at ``w = α·1`` instead
(``ReplaySettings.linearize_at``):
``f(w_S) ≈ f(α·1) + Σ_i ∂f_q / ∂w_i (w_S,i - α)``.

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

import dataclasses
import functools
import hashlib
import logging
import math
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from gradsketch._checks import check_int, check_number, positive_int
from gradsketch._device import to_device
from gradsketch._settings import read_record
from gradsketch._store import RowStore
from gradsketch.attribution._lm import IGNORE_INDEX, LanguageModelingModelOutput, _call_model
from gradsketch.attribution._lm_data import as_loader, as_task_batch, is_hf_dataset
from gradsketch.attribution._modelout import (
    AbstractModelOutput,
    ImageClassificationModelOutput,
    IterativeImageClassificationModelOutput,
    TextClassificationModelOutput,
    resolve_batch_output,
    resolve_task,
)
from gradsketch.attribution._scores import MemoryBudgetError
from gradsketch.attribution._topk import TopK, TopKCollector

logger = logging.getLogger(__name__)

#: Query blocks of at least this many are pulled back by ``vmap`` over forward-over-reverse
#: ``jvp``; smaller ones by reverse-over-reverse from the recomputation's kept graphs
#: (on the digits MLP, CPU, one thread, the two tie at 16 queries; the jvp path keeps
#: no graphs, so ties go to it).
JVP_MIN_BLOCK = 16

#: Optimizers the replay can reverse, and how many state tensors each keeps per parameter.
REPLAY_OPTIMIZERS: dict[str, str] = {
    "sgd": "SGD with optional momentum (dampening 0) and L2 weight decay (torch.optim.SGD)",
    "adam": "Adam with bias correction and L2 weight decay (torch.optim.Adam)",
    "adamw": "Adam with decoupled weight decay (torch.optim.AdamW)",
}

#: ``loss(model, *batch) -> [B]``: per-example training losses of one batched forward.
#: It calls ``model`` as usual; the replay swaps the run's parameters in.
BatchLoss = Callable[..., Tensor]

#: Per-example training loss of each task class (checked along the MRO).
TRAINING_LOSSES: dict[type[AbstractModelOutput], Callable[..., Tensor]] = {}


def register_training_loss(
    *task_types: type[AbstractModelOutput],
) -> Callable[[Callable[..., Tensor]], Callable[..., Tensor]]:
    """Decorator: the per-example training losses the replay uses for a task class.

    The function takes ``(task, model, *batch)`` and returns ``[B]`` losses
    of one batched forward (``model`` is called as usual).
    """
    for t in task_types:
        if not (isinstance(t, type) and issubclass(t, AbstractModelOutput)):
            raise TypeError(f"`task_types` must be AbstractModelOutput subclasses, got {t!r}.")

    def decorator(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
        for t in task_types:
            TRAINING_LOSSES[t] = fn
        return fn

    return decorator


@register_training_loss(
    ImageClassificationModelOutput,
    IterativeImageClassificationModelOutput,
    TextClassificationModelOutput,
)
def classification_loss(task: AbstractModelOutput, model: nn.Module, *batch: Tensor) -> Tensor:
    """``[B]`` cross-entropies ``softplus(-margin) = -log p_y`` (the margin is TRAK's output f)."""
    return torch.nn.functional.softplus(-resolve_batch_output(task)(model, *batch))


@register_training_loss(LanguageModelingModelOutput)
def language_modeling_loss(
    task: AbstractModelOutput, model: nn.Module, ids: Tensor, mask: Tensor, labels: Tensor
) -> Tensor:
    """``[B]`` mean next-token cross-entropies over each example's predicted tokens."""
    logits = _call_model(model, None, {"input_ids": ids, "attention_mask": mask})[:, :-1]
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    target = labels[:, 1:]
    valid = target != IGNORE_INDEX
    logp = logits.log_softmax(-1).gather(-1, target.masked_fill(~valid, 0).long().unsqueeze(-1))
    count = valid.sum(1).clamp(min=1).to(logp.dtype)
    return -(logp.squeeze(-1) * valid.to(logp.dtype)).sum(1) / count


def _resolve_loss(task: AbstractModelOutput, loss_fn: BatchLoss | None) -> BatchLoss:
    if loss_fn is not None:
        if not callable(loss_fn):
            raise TypeError(
                f"`loss_fn` must be callable as loss_fn(model, *batch) -> [B] per-example "
                f"losses, got {type(loss_fn).__name__}."
            )
        return loss_fn
    for cls in type(task).__mro__:
        if cls in TRAINING_LOSSES:
            return functools.partial(TRAINING_LOSSES[cls], task)
    known = ", ".join(sorted(c.__name__ for c in TRAINING_LOSSES))
    raise ValueError(
        f"`task` of type {type(task).__name__} has no registered training loss (known: {known}). "
        "Pass `loss_fn(model, *batch) -> [B]` per-example losses, or register one with "
        "@register_training_loss(YourTask)."
    )


class _Loss(nn.Module):
    """The model under a batched loss, so ``functional_call`` swaps the run's parameters in."""

    def __init__(self, model: nn.Module, loss: BatchLoss) -> None:
        super().__init__()
        self.model = model
        self.loss = loss

    def forward(self, *batch: Tensor) -> Tensor:
        return self.loss(self.model, *batch)


# -- settings -----------------------------------------------------------------------------
@dataclass
class ReplaySettings:
    """How the replayable run trains (saved beside stored scores; reruns must match).

    Attributes:
        optimizer: one of :data:`REPLAY_OPTIMIZERS`.
        lr: learning rate, a list of one rate per step, or a callable
            ``step -> rate`` (expanded to the list at construction).
        num_steps: optimizer steps ``T`` (ignored when an explicit order is given:
            its length is used).
        batch_size: examples per step; each epoch is a fresh permutation cut into
            batches (the last one of an epoch may be smaller).
        seed: seed of the batch order (``torch.Generator``).
        momentum: SGD momentum (dampening 0, no Nesterov).
        weight_decay: L2 for ``sgd`` / ``adam``, decoupled for ``adamw``.
        betas: Adam's ``(β1, β2)``.
        eps: Adam's ε (added to the bias-corrected ``√v̂``, as torch does).
        checkpoint_every: steps between kept checkpoints (``None``: ``⌈√T⌉``).
        no_decay: names of parameters without weight decay (as Hugging Face's
            ``Trainer`` leaves biases and norms).
        max_grad_norm: the run's gradient-norm clipping threshold (``None``:
            none). The replay cannot reverse clipping; it checks that no step
            clips (the global norm stays under the threshold, so torch's
            ``clip_grad_norm_`` multiplies by exactly 1) and refuses a run
            where one does.
        linearize_at: the data weights of the run that is trained,
            checkpointed and reversed: a number ``a`` for ``w = a·1`` (default
            1: the ordinary run), or one weight per training row (a sequence
            of ``n_train`` numbers in [0, 1], e.g. a random subset's 0/1
            mask). The metagradients are ``∂f / ∂w_i`` there. To predict
            retrains on random subsets holding a fraction ``α`` of the rows
            (datamodels, LDS over halves), expand near the subsets' weights:
            with SGD, ``a = α`` or a little below (or the mean of the
            metagradients at ``α/2`` and ``α``); with Adam / AdamW the update
            is nearly invariant to the loss's scale, so ``a·1`` barely moves
            the run. What each choice scored: ``docs/attribution.md``. The
            trained model (:meth:`ReplayAttributor.load_final`) is the run at
            those weights.
    """

    optimizer: str = "sgd"
    lr: Any = 0.1
    num_steps: int = 100
    batch_size: int = 32
    seed: int = 0
    momentum: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    checkpoint_every: int | None = None
    no_decay: list[str] = dataclasses.field(default_factory=list)
    max_grad_norm: float | None = None
    linearize_at: Any = 1.0

    def __post_init__(self) -> None:
        if self.optimizer not in REPLAY_OPTIMIZERS:
            raise ValueError(
                f"`optimizer`={self.optimizer!r} cannot be replayed; choose one of "
                f"{sorted(REPLAY_OPTIMIZERS)}."
            )
        positive_int("num_steps", self.num_steps)
        positive_int("batch_size", self.batch_size)
        check_int("seed", self.seed)
        check_int("checkpoint_every", self.checkpoint_every, low=1, optional=True)
        if callable(self.lr):
            schedule = self.lr
            self.lr = [float(schedule(t)) for t in range(self.num_steps)]
        if isinstance(self.lr, (list, tuple)):
            self.lr = [float(check_number("lr", v, low=0.0)) for v in self.lr]
            if not self.lr:
                raise ValueError("`lr` is an empty list; give one learning rate per step.")
        else:
            self.lr = float(check_number("lr", self.lr, low=0.0))
        check_number("momentum", self.momentum, low=0.0)
        check_number("weight_decay", self.weight_decay, low=0.0)
        check_number("eps", self.eps, low=0.0, strict=True)
        if isinstance(self.no_decay, str) or not all(isinstance(n, str) for n in self.no_decay):
            raise TypeError(f"`no_decay` must be a list of parameter names, got {self.no_decay!r}.")
        self.no_decay = sorted(self.no_decay)
        if self.max_grad_norm is not None:
            self.max_grad_norm = float(
                check_number("max_grad_norm", self.max_grad_norm, low=0.0, strict=True)
            )
        betas = tuple(float(b) for b in self.betas)
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"`betas` must be two numbers in [0, 1), got {self.betas!r}.")
        self.betas = (betas[0], betas[1])
        if self.momentum >= 1.0:
            raise ValueError(f"`momentum` must be in [0, 1), got {self.momentum!r}.")
        fix = (
            "pass the fraction of rows the predicted retrains keep (e.g. linearize_at=0.5 for "
            "halves), 1.0 for the ordinary run, or one weight in [0, 1] per training row"
        )
        if isinstance(self.linearize_at, (list, tuple, np.ndarray, Tensor)):
            per_row = np.asarray(
                self.linearize_at.detach().cpu()
                if isinstance(self.linearize_at, Tensor)
                else self.linearize_at
            )
            if per_row.ndim != 1 or per_row.size == 0 or per_row.dtype.kind not in "biuf":
                raise ValueError(
                    f"`linearize_at` as per-row weights must be a non-empty 1-d sequence of "
                    f"numbers, got shape {per_row.shape} of {per_row.dtype}; {fix}."
                )
            per_row = per_row.astype(np.float64)
            bad = np.flatnonzero(~np.isfinite(per_row) | (per_row < 0) | (per_row > 1))
            if bad.size:
                raise ValueError(
                    f"`linearize_at` row {int(bad[0])} is {float(per_row[bad[0]])!r}; per-row "
                    f"weights must be finite and in [0, 1]; {fix}."
                )
            if not per_row.any():
                raise ValueError(f"`linearize_at` weighs every row 0: nothing trains; {fix}.")
            self.linearize_at = per_row.tolist()
            return
        at = check_number("linearize_at", self.linearize_at, low=0.0, strict=True, fix=fix)
        if at > 1.0:
            raise ValueError(
                f"`linearize_at` must be a finite number in (0, 1], got {self.linearize_at!r}; "
                f"{fix}."
            )
        self.linearize_at = float(at)

    def record(self) -> dict[str, Any]:
        """The settings as a stored record (per-row ``linearize_at`` by its fingerprint)."""
        out = dataclasses.asdict(self)
        if isinstance(self.linearize_at, list):
            weights = torch.tensor(self.linearize_at, dtype=torch.float64)
            out["linearize_at"] = f"{weights.numel()} rows, sha256 {_fingerprint([weights])}"
        return out

    def lr_at(self, step: int) -> float:
        """The learning rate of step ``step``."""
        if isinstance(self.lr, list):
            if step >= len(self.lr):
                raise ValueError(
                    f"`lr` lists {len(self.lr)} rates but step {step} was asked for; give one "
                    "rate per step (or a callable)."
                )
            return float(self.lr[step])
        return float(self.lr)

    @property
    def state_names(self) -> tuple[str, ...]:
        """Optimizer state tensors kept per parameter."""
        if self.optimizer == "sgd":
            return ("momentum_buffer",) if self.momentum > 0 else ()
        return ("exp_avg", "exp_avg_sq")


def batch_order(n_train: int, batch_size: int, num_steps: int, *, seed: int) -> list[Tensor]:
    """Batches of training-row indices: epochs of permutations cut into ``batch_size`` pieces.

    Example:
        >>> [b.tolist() for b in batch_order(5, 2, 4, seed=0)]
        [[4, 0], [1, 3], [2], [3, 4]]
    """
    gen = torch.Generator().manual_seed(int(seed))
    order: list[Tensor] = []
    while len(order) < num_steps:
        perm = torch.randperm(n_train, generator=gen)
        order.extend(perm.split(batch_size))
    return order[:num_steps]


# -- data ----------------------------------------------------------------------------------
def _materialize(data: Any, task: AbstractModelOutput) -> tuple[Tensor, ...]:
    """The whole training set as the task's canonical tuple of ``[n, ...]`` tensors."""
    if is_hf_dataset(data):
        data = as_loader(data, task, batch_size=max(1, len(data)))
    if isinstance(data, Mapping):
        return as_task_batch(task, data)
    if isinstance(data, (tuple, list)) and data and all(isinstance(t, Tensor) for t in data):
        first = data[0].shape[0] if data[0].dim() else None
        if first is not None and all(t.dim() and t.shape[0] == first for t in data):
            return as_task_batch(task, tuple(data))
    if not isinstance(data, Iterable):
        raise TypeError(
            f"`train_data` must be a tuple of [n, ...] tensors, a dict batch, a datasets.Dataset "
            f"or an iterable of batches, got {type(data).__name__}."
        )
    batches = [as_task_batch(task, b) for b in data]
    if not batches:
        raise ValueError("`train_data` holds no batches; give at least one example.")
    columns = []
    for j in range(len(batches[0])):
        parts = [b[j] for b in batches]
        if parts[0].dim() == 2 and len({p.shape[1] for p in parts}) > 1:
            raise ValueError(
                f"`train_data` batches have column {j} of different lengths "
                f"{sorted({p.shape[1] for p in parts})}; pad every batch to one length (or pass "
                "a datasets.Dataset, which is padded as one batch)."
            )
        columns.append(torch.cat(parts))
    return tuple(columns)


def _rows(data: tuple[Tensor, ...], idx: Tensor) -> tuple[Tensor, ...]:
    return tuple(t[idx] for t in data)


def _fingerprint(tensors: Iterable[Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


# -- the functional optimizer and its reverse rules ---------------------------------------
Params = dict[str, Tensor]


@dataclass(frozen=True)
class _Layout:
    """Where each parameter lives in one flat ``[P]`` buffer.

    The run's parameters, optimizer state, gradients and ``[m, P]`` adjoints
    are flat buffers, so that the optimizer and its reverse rules are a few
    whole-buffer operations per step, not a few per parameter tensor (a
    small model on a GPU is bound by the number of kernel launches).
    Parameters with weight decay come first and those in ``no_decay`` after
    them, so each decay is one contiguous ``group``; the model sees views.
    """

    names: tuple[str, ...]  # the model's order (the views' dict order)
    shapes: dict[str, torch.Size]
    spans: dict[str, tuple[int, int]]  # flat order: decayed, then not decayed
    flat_order: tuple[str, ...]
    groups: tuple[tuple[int, int, float], ...]  # (start, stop, weight decay)
    size: int

    @classmethod
    def of(cls, params: Params, settings: ReplaySettings) -> _Layout:
        kinds = {(p.dtype, p.device) for p in params.values()}
        if len(kinds) > 1:
            raise ValueError(
                f"`model` holds parameters of {len(kinds)} dtypes or devices "
                f"({sorted(str(k) for k in kinds)}); the replay trains them as one buffer. "
                "Move and cast the model to one, e.g. model.to(torch.float64)."
            )
        no_decay = set(settings.no_decay)
        wd = settings.weight_decay
        decayed = [n for n in params if wd and n not in no_decay]
        rest = [n for n in params if not (wd and n not in no_decay)]
        spans: dict[str, tuple[int, int]] = {}
        groups: list[tuple[int, int, float]] = []
        at = 0
        for names, decay in ((decayed, wd), (rest, 0.0)):
            first = at
            for n in names:
                spans[n] = (at, at + params[n].numel())
                at += params[n].numel()
            if at > first:
                groups.append((first, at, decay))
        return cls(
            names=tuple(params),
            shapes={n: p.shape for n, p in params.items()},
            spans=spans,
            flat_order=(*decayed, *rest),
            groups=tuple(groups),
            size=at,
        )

    def flat(self, tensors: Params, batch: int | None = None) -> Tensor:
        """One ``[P]`` (or ``[batch, P]``) buffer of per-parameter ``tensors`` (a copy)."""
        lead = () if batch is None else (batch,)
        return torch.cat([tensors[n].reshape(*lead, -1) for n in self.flat_order], dim=-1)

    def views(self, flat: Tensor) -> Params:
        """Per-parameter views of a ``[..., P]`` buffer, in the model's order."""
        lead = flat.shape[:-1]
        return {
            n: flat[..., self.spans[n][0] : self.spans[n][1]].view(*lead, *self.shapes[n])
            for n in self.names
        }


def _joined(pieces: list[Tensor]) -> Tensor:
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)


def _opt_step(
    s: ReplaySettings,
    layout: _Layout,
    step: int,
    theta: Tensor,
    state: dict[str, Tensor],
    grad: Tensor,
) -> tuple[Tensor, dict[str, Tensor]]:
    """One optimizer step on flat buffers, written as torch's single-tensor paths.

    The float operations of every element are torch's, in the same order.
    """
    lr = s.lr_at(step)
    new_theta: list[Tensor] = []
    new_state: dict[str, list[Tensor]] = {k: [] for k in s.state_names}
    for a, b, wd in layout.groups:
        p, g = theta[a:b], grad[a:b]
        if s.optimizer == "sgd":
            d = g.add(p, alpha=wd) if wd else g
            if s.momentum > 0:
                buf = state["momentum_buffer"][a:b] * s.momentum + d if step > 0 else d
                new_state["momentum_buffer"].append(buf)
                d = buf
            new_theta.append(p.add(d, alpha=-lr))
            continue
        b1, b2 = s.betas
        if s.optimizer == "adamw":
            p = p * (1 - lr * wd)
            d = g
        else:
            d = g.add(p, alpha=wd) if wd else g
        m = state["exp_avg"][a:b].lerp(d, 1 - b1)
        v = state["exp_avg_sq"][a:b] * b2 + d * d * (1 - b2)
        c1, c2 = 1 - b1 ** (step + 1), 1 - b2 ** (step + 1)
        denom = v.sqrt() / math.sqrt(c2) + s.eps
        new_theta.append(p - (lr / c1) * m / denom)
        new_state["exp_avg"].append(m)
        new_state["exp_avg_sq"].append(v)
    return _joined(new_theta), {k: _joined(v) for k, v in new_state.items()}


def _reverse_step(
    s: ReplaySettings,
    layout: _Layout,
    step: int,
    theta: Tensor,
    state: dict[str, Tensor],
    grad: Tensor | None,
    bar_theta: Tensor,
    bar_state: dict[str, Tensor],
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Adjoints through one step, for ``[m, P]`` cotangent blocks, in place.

    Given the pre-step parameters and state, the step's gradient (read by
    Adam's rules only), and the adjoints of the step's outputs (``bar_theta``
    of θ_{t+1}, ``bar_state`` of the state after the step), returns
    ``(d̄, θ̄_direct, statē_before)``: the adjoint ``d̄`` of the loss gradient
    (to be pulled back through the double backward by the caller, which adds
    ``H d̄`` to θ̄ and ``∂g/∂w ᵀ d̄`` to w̄), the part of θ̄_t that does not
    pass through the gradient, and the state's adjoint before the step.

    The ``[m, P]`` adjoints are parameter-sized times ``m``, so each
    elementwise pass over them costs memory bandwidth: ``bar_theta`` and
    ``bar_state`` are overwritten (they must be the caller's own buffers) and
    the results may alias them. SGD's momentum adjoint is carried unscaled:
    ``bar_state["momentum_buffer"]`` is ``b̄``, the adjoint of the buffer the
    step wrote, and the state adjoint before the step, ``μ·b̄``, is formed
    when the step before reads it.
    """
    lr = s.lr_at(step)
    bar_g: list[Tensor] = []
    for a, b, wd in layout.groups:
        tb = bar_theta[:, a:b]
        if s.optimizer == "sgd":
            # θ' = θ - lr·b,  b = μ·b_prev + g + wd·θ  (b = g + wd·θ without momentum)
            if s.momentum > 0:
                bar_b = bar_state["momentum_buffer"][:, a:b].mul_(s.momentum).add_(tb, alpha=-lr)
            else:
                bar_b = tb * -lr
            bar_g.append(bar_b)
            if wd:
                tb.add_(bar_b, alpha=wd)
            continue
        assert grad is not None
        p, g = theta[a:b], grad[a:b]
        b1, b2 = s.betas
        decay = 1 - lr * wd if s.optimizer == "adamw" else 1.0
        d = g if s.optimizer == "adamw" or not wd else g.add(p, alpha=wd)
        m = state["exp_avg"][a:b].lerp(d, 1 - b1)
        v = state["exp_avg_sq"][a:b] * b2 + d * d * (1 - b2)
        c1, c2 = 1 - b1 ** (step + 1), 1 - b2 ** (step + 1)
        root = v.sqrt() / math.sqrt(c2)
        denom = root + s.eps
        # u = (m / c1) / (√(v / c2) + ε);  θ' = decay·θ - lr·u
        du_dm = 1.0 / (c1 * denom)
        # ∂u/∂v = -(m / c1) / denom² · 1 / (2 √(v c2)); zero where v = 0 (then m = 0 too).
        safe = torch.where(v > 0, v, torch.ones_like(v))
        du_dv = torch.where(
            v > 0, -(m / c1) / (denom * denom) / (2 * torch.sqrt(safe * c2)), torch.zeros_like(v)
        )
        bar_m = bar_state["exp_avg"][:, a:b].addcmul_(tb, du_dm, value=-lr)
        bar_v = bar_state["exp_avg_sq"][:, a:b].addcmul_(tb, du_dv, value=-lr)
        bar_d = (bar_v * ((2 * (1 - b2)) * d)).add_(bar_m, alpha=1 - b1)
        bar_m.mul_(b1)
        bar_v.mul_(b2)
        bar_g.append(bar_d)
        if decay != 1.0:
            tb.mul_(decay)
        if wd and s.optimizer == "adam":
            tb.add_(bar_d, alpha=wd)
    return _joined(bar_g), bar_theta, bar_state


_FORWARD_AD_READY = False


def _load_forward_ad_rules() -> None:
    """Load torch's forward-mode decompositions once, quietly.

    The first dual tensor makes torch script its jvp decompositions, which on
    torch >= 2.9 warns that ``torch.jit.script`` is deprecated: torch's own
    internals, nothing the caller can act on.
    """
    global _FORWARD_AD_READY
    if _FORWARD_AD_READY:
        return
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"`torch.jit.script` is deprecated", category=DeprecationWarning
        )
        torch.func.jvp(torch.sin, (torch.zeros(()),), (torch.ones(()),))
    _FORWARD_AD_READY = True


# -- the replayable run -------------------------------------------------------------------
@dataclass
class _StepGraph:
    """One step's leaves and gradient with its graph, kept for the second backward."""

    params: Params
    weights: Tensor
    grads: tuple[Tensor, ...]


@dataclass
class _Saved:
    """One recomputed step of a segment: flat parameters, state and gradient before it."""

    theta: Tensor
    state: dict[str, Tensor]
    grad: Tensor | None
    graph: _StepGraph | None


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
        """The sum of the parts."""
        return (
            self.checkpoints
            + self.segment
            + self.adjoints
            + self.scores
            + self.activations
            + self.graphs
        )


def _note_unwarmed_adam(settings: ReplaySettings) -> None:
    """Log once per process when an Adam run's first step has a nonzero rate.

    That step is ``lr · g / (|g| + ε)``, the sign of the gradient: its exact
    derivative spikes (height ``lr / ε``) wherever a gradient entry is near 0,
    and those spikes are in the metagradients although finite removals,
    which flip signs, do not follow them. A warmup from 0 removes them; so
    does a small ``linearize_at=α``, which scales the gradients by α and so
    acts as ``ε / α`` (``_SMOOTH_ADAM_EPS`` or more), and is then not noted.
    """
    global _ADAM_NOTED
    first = settings.lr_at(0)
    if _ADAM_NOTED or settings.optimizer not in ("adam", "adamw") or first == 0.0:
        return
    at = settings.linearize_at
    # The margin lets eps=1e-8 at linearize_at=1e-4 (whose quotient rounds to
    # just under 1e-4) count as smoothed, as the warning itself advises.
    if isinstance(at, float) and settings.eps / at >= _SMOOTH_ADAM_EPS * (1 - 1e-9):
        return
    _ADAM_NOTED = True
    logger.warning(
        "replaying %s whose first step has lr=%g: that step is the sign of the gradient, "
        "and its exact derivative spikes where a gradient entry is near 0, so these "
        "metagradients predict removals of many examples poorly. To predict retrains "
        "(LDS, datamodels), train the run with a learning-rate warmup from 0 (e.g. "
        "transformers' get_linear_schedule_with_warmup), or, for a run already trained, "
        "linearize it at a small weight: linearize_at=%g makes Adam's ε act as %g; "
        "measured effect: docs/attribution.md, 'Adam runs: warm the rate up, or linearize low'.",
        settings.optimizer,
        first,
        settings.eps / _SMOOTH_ADAM_EPS,
        _SMOOTH_ADAM_EPS,
    )


#: The effective Adam ε (``eps / linearize_at``) from which an unwarmed run's
#: metagradients are smooth enough to predict removals (measured on the
#: standard-library GPT-2, from scratch and fine-tuned; docs/attribution.md).
_SMOOTH_ADAM_EPS = 1e-4


_ADAM_NOTED = False


class ReplayAttributor:
    """Train a replayable run, then score queries by exact metagradients (MAGIC).

    Scores are ``[n_train, m]``: entry ``(i, j)`` is ``∂f_j(θ_T) / ∂w_i`` at
    ``w = 1`` (or ``linearize_at``), the derivative of query ``j``'s output (the task's, e.g. the
    classification margin) with respect to training example ``i``'s weight in
    the loss. Positive: up-weighting ``i`` raises the output (a proponent);
    leaving ``i`` out changes the output by about ``-scores[i, j]``. To
    predict retrains on subsets keeping a fraction ``α`` of the rows, set
    ``linearize_at=α``: the run is trained and reversed at ``w = α·1``, where
    the expansion is centred on the subsets (removing half the data is far
    from ``w = 1``'s linear regime); ``linearize_at`` also takes one weight per
    row (see :class:`ReplaySettings`).

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
        **settings_kwargs: Any,
    ) -> None:
        if settings is not None and settings_kwargs:
            raise TypeError(
                f"pass either `settings` or settings keywords, not both (got "
                f"{sorted(settings_kwargs)} with settings)."
            )
        if not isinstance(model, nn.Module):
            raise TypeError(f"`model` must be a torch.nn.Module, got {type(model).__name__}.")
        self.model = model
        self.task = resolve_task(task)
        self._loss_module = _Loss(model, _resolve_loss(self.task, loss_fn))
        self.data = _materialize(train_data, self.task)
        self.n_train = int(self.data[0].shape[0])
        if order is not None:
            batches = [torch.as_tensor(b, dtype=torch.long).reshape(-1) for b in order]
            if not batches or any(b.numel() == 0 for b in batches):
                raise ValueError("`order` must be a non-empty list of non-empty index batches.")
            flat = torch.cat(batches)
            if int(flat.min()) < 0 or int(flat.max()) >= self.n_train:
                raise ValueError(
                    f"`order` holds indices in [{int(flat.min())}, {int(flat.max())}] but the "
                    f"training set has {self.n_train} rows; indices must lie in [0, n_train)."
                )
            settings_kwargs["num_steps"] = len(batches)
        if settings is None:
            settings = ReplaySettings(**settings_kwargs)
        elif order is not None and settings.num_steps != len(order):
            settings = dataclasses.replace(settings, num_steps=len(order))
        self.settings = settings
        self.order = (
            batches
            if order is not None
            else batch_order(
                self.n_train, settings.batch_size, settings.num_steps, seed=settings.seed
            )
        )
        if isinstance(settings.lr, list) and len(settings.lr) < settings.num_steps:
            raise ValueError(
                f"`lr` lists {len(settings.lr)} rates for {settings.num_steps} steps; give one "
                "per step."
            )
        # The run's own data weights, one per row (``linearize_at``).
        if isinstance(settings.linearize_at, list):
            if len(settings.linearize_at) != self.n_train:
                raise ValueError(
                    f"`linearize_at` gives {len(settings.linearize_at)} per-row weights but the "
                    f"training set has {self.n_train} rows; give one weight per training row."
                )
            self._base_weights = torch.tensor(settings.linearize_at, dtype=torch.float64)
        else:
            self._base_weights = torch.full(
                (self.n_train,), settings.linearize_at, dtype=torch.float64
            )
        _note_unwarmed_adam(settings)
        steps = settings.num_steps
        self.every = settings.checkpoint_every or max(1, math.ceil(math.sqrt(steps)))
        self.params0: Params = {n: p.detach().clone() for n, p in model.named_parameters()}
        if not self.params0:
            raise ValueError("`model` has no parameters; there is nothing to train or replay.")
        unknown = sorted(set(settings.no_decay) - set(self.params0))
        if unknown:
            raise ValueError(
                f"`no_decay` names {unknown[:3]}, which are not parameters of `model`; give "
                f"names from model.named_parameters() (e.g. {sorted(self.params0)[:3]})."
            )
        ref = next(iter(self.params0.values()))
        self._dtype, self._device = ref.dtype, ref.device
        # The replay trains where the model is: its rows go there once.
        self.data = to_device(self.data, self._device)
        self.buffers: Params = {n: b.detach() for n, b in model.named_buffers()}
        self.save_dir = None if save_dir is None else Path(save_dir)
        check_int("memory_budget", memory_budget, low=1, optional=True)
        self.memory_budget = memory_budget
        self.progress = progress
        self._layout = _Layout.of(self.params0, settings)
        self.checkpoints: dict[int, tuple[Tensor, dict[str, Tensor]]] = {}
        self.final: Params | None = None
        self.timings: dict[str, float] = {}
        self._scores: dict[str, Tensor] = {}
        self._tokens: dict[str, int] = {}
        self._activation_bytes: tuple[int, int] | None = None
        # Whether torch.func.vmap traces the model (None: not tried yet).
        self._vmap_ok: bool | None = None
        # Smallest query block pulled back by forward-over-reverse (see _pullback).
        self._jvp_min_block = JVP_MIN_BLOCK

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

    # -- forward -----------------------------------------------------------------------
    def _losses(
        self, params: Params, weights: Tensor, batch: tuple[Tensor, ...]
    ) -> tuple[Tensor, Tensor]:
        """The weighted batch loss ``Σ w_i ℓ_i / |B|`` and the ``[B]`` losses ``ℓ_i``."""
        swapped = {f"model.{n}": p for n, p in params.items()}
        swapped.update({f"model.{n}": b for n, b in self.buffers.items()})
        losses = torch.func.functional_call(self._loss_module, swapped, batch)
        return (weights.to(losses.dtype) * losses).sum() / batch[0].shape[0], losses

    def _batch_loss(self, params: Params, weights: Tensor, batch: tuple[Tensor, ...]) -> Tensor:
        return self._losses(params, weights, batch)[0]

    def _grad(self, params: Params, weights: Tensor, batch: tuple[Tensor, ...]) -> Params:
        """``∇_θ L`` by plain autograd (``torch.func.grad`` costs 1.5x on small models)."""
        names = list(params)
        with torch.enable_grad():
            leaves = {n: params[n].detach().requires_grad_(True) for n in names}
            loss = self._batch_loss(leaves, weights, batch)
            grads = torch.autograd.grad(loss, [leaves[n] for n in names], allow_unused=True)
        return {
            n: torch.zeros_like(params[n]) if g is None else g
            for n, g in zip(names, grads, strict=True)
        }

    def _grad_and_losses(
        self, params: Params, weights: Tensor, batch: tuple[Tensor, ...]
    ) -> tuple[Params, Tensor]:
        out: tuple[Params, Tensor] = torch.func.grad(self._losses, has_aux=True)(
            params, weights, batch
        )
        return out

    def _pullback(self, theta: Params, idx: Tensor, bar_g: Params) -> tuple[Params, Tensor]:
        """``(H d̄, ∂g/∂w ᵀ d̄)`` for a ``[m, ...]`` block ``d̄``, by forward-over-reverse.

        ``g = ∇L`` so ``(∂g/∂θ)ᵀ = H`` is symmetric and ``H d̄`` is a
        Jacobian-vector product of ``g``; ``∂g/∂w_i ᵀ d̄ = ∇ℓ_i · d̄ / |B|`` is
        the tangent of the losses ``ℓ_i`` along ``d̄``. One ``jvp`` gives both.

        Blocks smaller than :data:`JVP_MIN_BLOCK` take the reverse-over-reverse
        path instead: forward-mode AD under ``vmap`` carries a fixed overhead
        per operation that a few tangents do not amortize, and the segment's
        recomputation keeps each step's graph for the second backward (digits
        MLP, one thread, whole reverse pass: 2.8 against 6.8 training runs for
        one query, 11 against 13 for 8, a tie at 16, 36 against 30 for 32).
        Both are exact; they differ by rounding only.
        """
        m = next(iter(bar_g.values())).shape[0]
        if not self._keeps_graphs(m):
            try:
                result = self._pullback_jvp(theta, idx, bar_g)
            except RuntimeError as exc:
                if "vmap" not in str(exc):
                    raise
                self._vmap_ok = False
            else:
                self._vmap_ok = True
                return result
        return self._pullback_autograd(theta, idx, bar_g)

    def _keeps_graphs(self, m: int) -> bool:
        """Whether a block of ``m`` queries is pulled back by reverse-over-reverse."""
        return m < self._jvp_min_block or self._vmap_ok is False

    def _pullback_jvp(self, theta: Params, idx: Tensor, bar_g: Params) -> tuple[Params, Tensor]:
        _load_forward_ad_rules()
        rows = _rows(self.data, idx)
        weights = self._run_weights(idx)

        def tangents(d: Params) -> tuple[Params, Tensor]:
            fn = functools.partial(self._grad_and_losses, weights=weights, batch=rows)
            tangent_out = torch.func.jvp(fn, (theta,), (d,))[1]
            hess, dloss = tangent_out
            return hess, dloss / rows[0].shape[0]

        out: tuple[Params, Tensor] = torch.func.vmap(tangents)(bar_g)
        return out

    def _pullback_autograd(
        self, theta: Params, idx: Tensor, bar_g: Params
    ) -> tuple[Params, Tensor]:
        """The same pull-back by reverse-over-reverse, vmapping only the second backward.

        For small blocks and for models whose forward ``vmap`` cannot trace
        (data-dependent control flow, as transformers' attention-mask checks):
        the forward and first backward run once, plainly; ``is_grads_batched``
        vmaps the backward of the gradient over the block.
        """
        return self._second_backward(self._first_backward(theta, idx), bar_g)

    def _first_backward(self, theta: Params, idx: Tensor) -> _StepGraph:
        """One step's forward and gradient, with the graph the second backward needs."""
        names = list(theta)
        with torch.enable_grad():
            params = {n: theta[n].detach().requires_grad_(True) for n in names}
            w = self._run_weights(idx).requires_grad_(True)
            loss = self._batch_loss(params, w, _rows(self.data, idx))
            grads = torch.autograd.grad(loss, [params[n] for n in names], create_graph=True)
        return _StepGraph(params, w, grads)

    def _second_backward(self, graph: _StepGraph, bar_g: Params) -> tuple[Params, Tensor]:
        """``(H d̄, ∂g/∂w ᵀ d̄)`` from a kept step graph (which it frees)."""
        names = list(graph.params)
        grads, w = graph.grads, graph.weights
        live = [i for i, g in enumerate(grads) if g.requires_grad]
        single = next(iter(bar_g.values())).shape[0] == 1
        with torch.enable_grad():
            try:
                # One cotangent: a plain second backward (vmap's overhead buys nothing).
                pulled = torch.autograd.grad(
                    [grads[i] for i in live],
                    [*(graph.params[n] for n in names), w],
                    grad_outputs=[bar_g[names[i]][0] if single else bar_g[names[i]] for i in live],
                    is_grads_batched=not single,
                    allow_unused=True,
                )
                if single:
                    pulled = tuple(None if t is None else t.unsqueeze(0) for t in pulled)
            except RuntimeError as exc:
                if "not implemented" not in str(exc):
                    raise
                raise RuntimeError(
                    f"`model` ({type(self.model).__name__}) cannot be replayed: an operation in "
                    f"its forward has no second derivative in torch ({exc}), and the replay "
                    "differentiates each training step's gradient. For Hugging Face models "
                    "load them with eager attention (config._attn_implementation = 'eager' or "
                    "attn_implementation='eager' in from_pretrained); otherwise replace that "
                    "operation."
                ) from exc
        m = next(iter(bar_g.values())).shape[0]
        hess = {
            n: (torch.zeros_like(bar_g[n]) if h is None else h.detach())
            for n, h in zip(names, pulled[:-1], strict=True)
        }
        dw = pulled[-1]
        w_part = w.new_zeros(m, w.shape[0]) if dw is None else dw.detach()
        return hess, w_part

    def _run_weights(self, idx: Tensor, weights: Tensor | None = None) -> Tensor:
        """Data weights of rows ``idx``: ``weights``, or the run's own (``linearize_at``)."""
        base = self._base_weights if weights is None else weights
        return base[idx].to(dtype=self._dtype, device=self._device)

    def _init_state(self) -> dict[str, Tensor]:
        size, dtype, device = self._layout.size, self._dtype, self._device
        return {k: torch.zeros(size, dtype=dtype, device=device) for k in self.settings.state_names}

    def _theta0(self) -> Tensor:
        return self._layout.flat(self.params0)

    def _flat_grad(self, theta: Tensor, idx: Tensor, weights: Tensor | None = None) -> Tensor:
        """``∇_θ L`` of step batch ``idx`` at flat parameters ``theta``, flat."""
        grads = self._grad(
            self._layout.views(theta), self._run_weights(idx, weights), _rows(self.data, idx)
        )
        return self._layout.flat(grads)

    def _forward(
        self,
        start: int,
        stop: int,
        theta: Tensor,
        state: dict[str, Tensor],
        weights: Tensor | None,
        keep: Callable[[int, Tensor, dict[str, Tensor], Tensor], None] | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Steps ``start..stop-1`` from flat ``theta`` and ``state``.

        ``keep(t, θ, state, g)`` sees each step's inputs and flat gradient.
        """
        for t in range(start, stop):
            grad = self._flat_grad(theta, self.order[t], weights)
            if keep is not None:
                keep(t, theta, state, grad)
            if weights is None and self.settings.max_grad_norm is not None:
                self._check_unclipped(t, grad)
            theta, state = _opt_step(self.settings, self._layout, t, theta, state, grad)
        return theta, state

    def _check_unclipped(self, step: int, grad: Tensor) -> None:
        """Refuse a step whose gradient ``clip_grad_norm_`` would rescale (the replay cannot)."""
        limit = self.settings.max_grad_norm
        assert limit is not None
        norms = [torch.linalg.vector_norm(g) for g in self._layout.views(grad).values()]
        total = float(torch.linalg.vector_norm(torch.stack(norms)))
        # torch's clip_grad_norm_: coefficient max_norm / (total + 1e-6), clamped to 1.
        if limit / (total + 1e-6) < 1.0:
            raise ValueError(
                f"step {step} of the run clips its gradient (global norm {total:.4g} > "
                f"`max_grad_norm`={limit}), which the replay cannot reverse. Train without "
                "clipping (max_grad_norm=0 in TrainingArguments), or with a threshold no step "
                "reaches."
            )

    def train(self) -> None:
        """Train the run, keeping a checkpoint every ``checkpoint_every`` steps."""
        t0 = time.perf_counter()
        self.checkpoints.clear()

        def keep(t: int, theta: Tensor, state: dict[str, Tensor], grad: Tensor) -> None:
            if t % self.every == 0:
                self.checkpoints[t] = (theta, state)

        with torch.no_grad():
            final, _ = self._forward(
                0, self.settings.num_steps, self._theta0(), self._init_state(), None, keep
            )
        self.final = self._layout.views(final)
        self.timings["train"] = time.perf_counter() - t0

    def retrain(self, weights: Tensor | None = None) -> Params:
        """Final parameters of the same run with per-example ``weights`` ``[n_train]``.

        With ``weights`` zero on left-out rows (and 1 on kept ones) this is
        MAGIC's leave-out model: same initialization, same batch order, only
        those rows' losses removed. The weights are taken as given, whatever
        ``linearize_at`` is; ``None`` means the run's own weights,
        ``linearize_at`` (the trained run itself).
        """
        if weights is not None:
            weights = torch.as_tensor(weights, dtype=torch.float64).reshape(-1)
            if weights.numel() != self.n_train:
                raise ValueError(
                    f"`weights` has {weights.numel()} entries but the training set has "
                    f"{self.n_train} rows; give one weight per training row."
                )
        with torch.no_grad():
            theta, _ = self._forward(
                0, self.settings.num_steps, self._theta0(), self._init_state(), weights
            )
        return self._layout.views(theta)

    def load_final(self) -> nn.Module:
        """Copy the trained parameters into ``model`` (and return it).

        They are the run at weights ``linearize_at``: with any weight under 1
        not the ordinary run's model.
        """
        final = self._require_trained()
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                p.copy_(final[n])
        return self.model

    def outputs(self, queries: Any, params: Params | None = None) -> Tensor:
        """``[m]`` query outputs ``f_j`` under ``params`` (default: the trained run's)."""
        theta = self._require_trained() if params is None else params
        batch = to_device(_materialize(queries, self.task), self._device)

        def one(*example: Tensor) -> Tensor:
            return self.task.get_output(self.model, theta, self.buffers, *example)

        with torch.no_grad():
            out: Tensor = self._each_example(one, batch)
            return out

    def _each_example(self, fn: Callable[..., Any], batch: tuple[Tensor, ...]) -> Any:
        """``fn`` of each example of ``batch``, stacked: ``vmap``, or a loop where it fails.

        Models ``vmap`` cannot trace (transformers' mask checks branch on
        values) are remembered (``_vmap_ok``), so that the pull-backs skip
        forward-mode AD under ``vmap`` for them too.
        """
        if self._vmap_ok is not False:
            try:
                return torch.func.vmap(fn)(*batch)
            except RuntimeError as exc:
                if "vmap" not in str(exc):
                    raise
                self._vmap_ok = False
        rows = [fn(*(t[j] for t in batch)) for j in range(len(batch[0]))]
        if isinstance(rows[0], dict):
            return {n: torch.stack([r[n] for r in rows]) for n in rows[0]}
        return torch.stack(rows)

    def _require_trained(self) -> Params:
        if self.final is None:
            raise RuntimeError("the run is not trained yet; call `train()` before scoring.")
        return self.final

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
            measured = []
            idx = self.order[0]
            for create_graph in (False, True):
                total = 0

                def pack(t: Tensor) -> Tensor:
                    nonlocal total
                    total += t.numel() * t.element_size()
                    return t

                params = {n: p.detach().requires_grad_(True) for n, p in self.params0.items()}
                with (
                    torch.enable_grad(),
                    torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
                ):
                    weights = self._run_weights(idx).requires_grad_(create_graph)
                    loss = self._batch_loss(params, weights, _rows(self.data, idx))
                    grads = torch.autograd.grad(
                        loss, list(params.values()), create_graph=create_graph
                    )
                # A kept graph also holds its gradients.
                total += sum(g.numel() * g.element_size() for g in grads) if create_graph else 0
                measured.append(total)
            self._activation_bytes = (measured[0], measured[1])
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
                if self._keeps_graphs(num_queries)
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

    # -- reverse ----------------------------------------------------------------------
    def _query_grads(self, batch: tuple[Tensor, ...], theta: Params) -> Params:
        def out(params: Params, *example: Tensor) -> Tensor:
            return self.task.get_output(self.model, params, self.buffers, *example)

        grads: Params = self._each_example(functools.partial(torch.func.grad(out), theta), batch)
        return grads

    def metagradients(self, queries: Any, *, query_block: int | None = None) -> Tensor:
        """``[n_train, m]`` exact metagradients ``∂f_j(θ_T) / ∂w_i``, on the model's device.

        Those are ``settings.linearize_at`` (default 1 on every row, the
        ordinary run).

        Args:
            queries: the query examples, in any form ``train_data`` takes.
            query_block: queries carried through one reverse pass (default:
                all, or as many as fit ``memory_budget``).
        """
        self._require_trained()
        batch = to_device(_materialize(queries, self.task), self._device)
        m = int(batch[0].shape[0])
        size = self._block_size(m, query_block)
        blocks = [self._reverse(tuple(t[j : j + size] for t in batch)) for j in range(0, m, size)]
        return torch.cat(blocks, dim=1)

    def _segment(self, start: int, stop: int, graphs: bool = False) -> list[_Saved]:
        """The pre-step states of steps ``start..stop-1``, recomputed from the checkpoint.

        Each entry holds the flat parameters and state before the step and,
        for Adam and AdamW, whose reverse rules recompute the moments, the
        step's flat gradient (computed here anyway, so the reverse pass does
        not run the step's forward and backward again). With ``graphs`` each
        step's forward and first backward are kept with their graph, so that
        reverse-over-reverse pulls back without running them again (memory:
        the segment's graphs, ``k`` steps' activations).
        """
        saved: list[_Saved] = []
        theta, state = self.checkpoints[start]
        keep_grad = self.settings.optimizer != "sgd"
        if not graphs:

            def keep(t: int, p: Tensor, o: dict[str, Tensor], g: Tensor) -> None:
                saved.append(_Saved(p, o, g if keep_grad else None, None))

            with torch.no_grad():
                self._forward(start, stop, theta, state, None, keep)
            return saved
        for t in range(start, stop):
            graph = self._first_backward(self._layout.views(theta), self.order[t])
            grad = self._layout.flat(
                {n: g.detach() for n, g in zip(graph.params, graph.grads, strict=True)}
            )
            saved.append(_Saved(theta, state, grad if keep_grad else None, graph))
            with torch.no_grad():
                theta, state = _opt_step(self.settings, self._layout, t, theta, state, grad)
        return saved

    def _reverse(self, batch: tuple[Tensor, ...]) -> Tensor:
        s = self.settings
        layout = self._layout
        final = self._require_trained()
        m = int(batch[0].shape[0])
        # Owned flat buffers: the reverse steps update the adjoints in place.
        bar_theta = layout.flat(self._query_grads(batch, final), batch=m)
        bar_state = {k: torch.zeros_like(bar_theta) for k in s.state_names}
        bar_w = bar_theta.new_zeros(m, self.n_train)
        starts = sorted(self.checkpoints, reverse=True)
        bar = tqdm(total=s.num_steps, desc="replay (reverse)", disable=not self.progress)
        for start in starts:
            stop = min(start + self.every, s.num_steps)
            saved = self._segment(start, stop, graphs=self._keeps_graphs(m))
            for t in range(stop - 1, start - 1, -1):
                step = saved.pop()
                idx = self.order[t]
                bar_g, bar_theta, bar_state = _reverse_step(
                    s, layout, t, step.theta, step.state, step.grad, bar_theta, bar_state
                )
                if step.graph is None:
                    hess, w_part = self._pullback(
                        layout.views(step.theta), idx, layout.views(bar_g)
                    )
                else:
                    hess, w_part = self._second_backward(step.graph, layout.views(bar_g))
                del step
                bar_theta.add_(layout.flat(hess, batch=m))
                bar_w.index_add_(1, idx.to(bar_w.device), w_part)
                bar.update(1)
        bar.close()
        return bar_w.T.contiguous()

    # -- scores in a store ------------------------------------------------------------
    def _record(self, batch: tuple[Tensor, ...], tokens: int = 0) -> dict[str, Any]:
        """Everything that fixes the scores: settings, data, order, initialization, queries."""
        return {
            **self.settings.record(),
            "method": "replay",
            "task": type(self.task).__name__,
            "n_train": self.n_train,
            "checkpoint_every": self.every,
            "train_data": _fingerprint(self.data),
            "order": _fingerprint(self.order),
            "init": _fingerprint(self.params0.values()),
            "queries": _fingerprint(batch),
            "num_queries": int(batch[0].shape[0]),
            "per_token": tokens,
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
        batch = _materialize(queries, self.task)
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
