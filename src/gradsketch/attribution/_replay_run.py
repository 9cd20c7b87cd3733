"""The replayable run: its settings, batch order, functional optimizer, and recorded states.

Training is a function of per-example data weights ``w``: step ``t`` takes the
gradient of ``L_t(θ, w) = Σ_{i ∈ B_t} w_i ℓ_i(θ) / W_t`` over its batch
``B_t``, and the optimizer maps it to the next parameters; ``W_t`` is
``Σ_{i ∈ B_t} w_i`` (``ReplaySettings.subset_loss="kept_mean"``, the default:
at a 0/1 mask, the run retrained on the kept rows) or ``|B_t|``
(``"full_batch"``). :class:`ReplayRun`
trains that function at the run's own weights (``ReplaySettings.linearize_at``)
with a functional optimizer on flat buffers (SGD with momentum and weight
decay, Adam, AdamW; a learning rate per step), keeps a checkpoint every
``k ≈ √T`` steps, and retrains it at other weights. The reverse pass
(``_replay_reverse``) recomputes segments from those checkpoints.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from gradsketch._checks import check_int, check_number, positive_int
from gradsketch._device import to_device
from gradsketch._hash import tensors_digest
from gradsketch.attribution._lm_data import as_loader, as_task_batch, is_hf_dataset
from gradsketch.attribution._modelout import AbstractModelOutput, resolve_task
from gradsketch.attribution._replay_losses import BatchLoss, LossModule, resolve_training_loss

#: Optimizers the replay can reverse, and how many state tensors each keeps per parameter.
REPLAY_OPTIMIZERS: dict[str, str] = {
    "sgd": "SGD with optional momentum (dampening 0) and L2 weight decay (torch.optim.SGD)",
    "adam": "Adam with bias correction and L2 weight decay (torch.optim.Adam)",
    "adamw": "Adam with decoupled weight decay (torch.optim.AdamW)",
}

#: How a step's loss is normalized at data weights ``w``: which retrains the replay predicts.
SUBSET_LOSSES: dict[str, str] = {
    "kept_mean": (
        "Σ w_i ℓ_i / Σ w_i over the batch: at a 0/1 mask, the loss averaged over the kept rows "
        "of each batch, as a torch loop that retrains on the kept rows computes it"
    ),
    "full_batch": (
        "Σ w_i ℓ_i / |B|: left-out rows' losses zeroed but the batch still divided by its full "
        "size (the replay's rule before subset_loss existed)"
    ),
}


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
            mask), or ``"auto"``: chosen among candidate settings by
            same-initialization LDS on validation retrains
            (:class:`~gradsketch.attribution.AutoLinearization`; the run is
            the ordinary one until :meth:`ReplayAttributor.train` chooses).
            The metagradients are ``∂f / ∂w_i`` there, and the trained
            model (:meth:`ReplayAttributor.load_final`) is the run at those
            weights. With ``subset_loss="kept_mean"`` a number ``a`` keeps the
            ordinary run for every optimizer, decay, ε and schedule (the loss
            is a weighted mean, unchanged by scaling every weight), so its
            metagradients are those at ``w = 1`` times ``1 / a``: the same
            ranking and LDS. With ``"full_batch"`` the loss is scaled by ``a``
            and the run is another one: SGD steps ``a`` times shorter, Adam's
            ε acts as ``ε / a`` and L2 decay (``sgd`` / ``adam``) weighs
            ``1 / a`` times more, as in the full-batch-normalized retrains on
            subsets keeping a fraction ``a`` that this mode predicts.
            What each choice scored: ``docs/attribution.md``.
        subset_loss: how each step's loss is normalized at weights ``w``, one
            of :data:`SUBSET_LOSSES`. ``"kept_mean"`` (default): ``Σ w_i ℓ_i /
            Σ w_i`` over the batch, so the run at a 0/1 mask (``linearize_at``
            or :meth:`ReplayAttributor.retrain`) is the run a user gets by
            retraining on the kept rows with the loss averaged over each
            batch's kept rows (same initialization and batch order; a batch
            with no kept row takes the optimizer step with a zero loss
            gradient), and metagradients predict those retrains.
            ``"full_batch"``: ``Σ w_i ℓ_i / |B|``, the replay's rule before
            this setting (it predicts retrains that zero the left-out rows'
            losses but divide by the full batch). At ``w = 1`` the two train
            the same run; their metagradients differ by each batch's mean.
    """

    optimizer: str = "sgd"
    lr: float | list[float] | Callable[[int], float] = 0.1
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
    subset_loss: str = "kept_mean"

    def __post_init__(self) -> None:
        if self.optimizer not in REPLAY_OPTIMIZERS:
            raise ValueError(
                f"`optimizer`={self.optimizer!r} cannot be replayed; choose one of "
                f"{sorted(REPLAY_OPTIMIZERS)}."
            )
        if self.subset_loss not in SUBSET_LOSSES:
            raise ValueError(
                f"`subset_loss`={self.subset_loss!r} is not a loss normalization; choose one of "
                f"{sorted(SUBSET_LOSSES)} (kept_mean: the retrains a torch loop makes on the "
                "kept rows)."
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
            "halves), 1.0 for the ordinary run, one weight in [0, 1] per training row, or "
            "'auto' (chosen from validation retrains)"
        )
        if isinstance(self.linearize_at, str) and self.linearize_at == "auto":
            return
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
        """The settings as a stored record (per-row ``linearize_at`` by its fingerprint).

        ``subset_loss="full_batch"`` is left out, so that stores written before the
        setting existed (all full-batch) keep matching it.
        """
        out = dataclasses.asdict(self)
        if self.subset_loss == "full_batch":
            del out["subset_loss"]
        if isinstance(self.linearize_at, list):
            weights = torch.tensor(self.linearize_at, dtype=torch.float64)
            out["linearize_at"] = f"{weights.numel()} rows, sha256 {fingerprint([weights])}"
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
        assert not callable(self.lr)  # __post_init__ expands a schedule into its list
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
def materialize(data: Any, task: AbstractModelOutput) -> tuple[Tensor, ...]:
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


def rows_of(data: tuple[Tensor, ...], idx: Tensor) -> tuple[Tensor, ...]:
    """Rows ``idx`` of every column of ``data``."""
    return tuple(t[idx] for t in data)


def fingerprint(tensors: Iterable[Tensor]) -> str:
    """A short sha256 of the tensors' bytes (stored records name data, order and weights by it)."""
    return tensors_digest(tensors)


# -- the functional optimizer --------------------------------------------------------------
Params = dict[str, Tensor]


@dataclass(frozen=True)
class Layout:
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
    def of(cls, params: Params, settings: ReplaySettings) -> Layout:
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


def joined(pieces: list[Tensor]) -> Tensor:
    """One ``[..., P]`` buffer of per-group pieces (no copy for a single group)."""
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)


def opt_step(
    s: ReplaySettings,
    layout: Layout,
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
    return joined(new_theta), {k: joined(v) for k, v in new_state.items()}


# -- the run ---------------------------------------------------------------------------------
#: ``keep(t, θ, state, g)``: sees each step's flat inputs and gradient as the run goes.
KeepStep = Callable[[int, Tensor, dict[str, Tensor], Tensor], None]


class ReplayRun:
    """One replayable run: the model, its rows, batch order and data weights, and its training.

    It trains at the run's own data weights (``linearize_at``), keeping a
    checkpoint every ``every`` steps and the final parameters, and retrains
    from the same initialization and order at any other weights.

    Args:
        model: the model; its current parameters are the initialization.
        task: a task name or :class:`AbstractModelOutput`.
        train_data: the training set, in any form :func:`materialize` takes.
        settings: a :class:`ReplaySettings`, or ``None`` to build one from
            ``settings_kwargs``.
        settings_kwargs: :class:`ReplaySettings` fields (only without ``settings``).
        order: explicit batches of training-row indices, one per step.
        loss_fn: per-example training losses (default: the task's).
    """

    def __init__(
        self,
        model: nn.Module,
        task: str | AbstractModelOutput,
        train_data: Any,
        settings: ReplaySettings | None,
        settings_kwargs: dict[str, Any],
        *,
        order: Sequence[Any] | None,
        loss_fn: BatchLoss | None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"`model` must be a torch.nn.Module, got {type(model).__name__}.")
        self.model = model
        self.task = resolve_task(task)
        self.loss_module = LossModule(model, resolve_training_loss(self.task, loss_fn))
        self.data = materialize(train_data, self.task)
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
            settings_kwargs = {**settings_kwargs, "num_steps": len(batches)}
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
        self.base_weights = self._base_weights(settings)
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
        self.dtype, self.device = ref.dtype, ref.device
        # The replay trains where the model is: its rows go there once.
        self.data = to_device(self.data, self.device)
        self.buffers: Params = {n: b.detach() for n, b in model.named_buffers()}
        self.layout = Layout.of(self.params0, settings)
        self.checkpoints: dict[int, tuple[Tensor, dict[str, Tensor]]] = {}
        self.final: Params | None = None
        self.timings: dict[str, float] = {}
        # Whether torch.func.vmap traces the model (None: not tried yet).
        self.vmap_ok: bool | None = None

    def _base_weights(self, settings: ReplaySettings) -> Tensor:
        """The run's own data weights, one per row (``linearize_at``; ``"auto"``: 1)."""
        at = settings.linearize_at
        if isinstance(at, list):
            if len(at) != self.n_train:
                raise ValueError(
                    f"`linearize_at` gives {len(at)} per-row weights but the "
                    f"training set has {self.n_train} rows; give one weight per training row."
                )
            return torch.tensor(at, dtype=torch.float64)
        value = 1.0 if isinstance(at, str) else float(at)
        return torch.full((self.n_train,), value, dtype=torch.float64)

    def relinearized(self, linearize_at: Any, subset_loss: str) -> ReplayRun:
        """The same run (model, rows, order, initialization) at other settings, untrained.

        Only ``linearize_at`` and ``subset_loss`` change; the rows, the order,
        the initialization and the layout are shared, not copied.
        """
        settings = dataclasses.replace(
            self.settings, linearize_at=linearize_at, subset_loss=subset_loss
        )
        other = copy.copy(self)
        other.settings = settings
        other.base_weights = self._base_weights(settings)
        other.checkpoints, other.final, other.timings = {}, None, {}
        return other

    # -- the loss and its gradient -------------------------------------------------------
    def losses(
        self, params: Params, weights: Tensor, batch: tuple[Tensor, ...]
    ) -> tuple[Tensor, Tensor]:
        """The weighted batch loss ``Σ w_i ℓ_i / W`` and the ``[B]`` losses ``ℓ_i``.

        ``W`` is :meth:`normalizer`: ``Σ w_i`` (``subset_loss="kept_mean"``) or ``|B|``.
        """
        swapped = {f"model.{n}": p for n, p in params.items()}
        swapped.update({f"model.{n}": b for n, b in self.buffers.items()})
        losses = torch.func.functional_call(self.loss_module, swapped, batch)
        w = weights.to(losses.dtype)
        return (w * losses).sum() / self.normalizer(w), losses

    def normalizer(self, weights: Tensor) -> Tensor | int:
        """What a batch's weighted loss divides by: ``Σ w_i`` for ``kept_mean``, else ``|B|``.

        A ``kept_mean`` batch whose weights sum to 0 divides by ``|B|``: its loss
        is 0 either way, and its metagradients are then those of ``full_batch``.
        """
        size = weights.shape[-1]
        if self.settings.subset_loss == "full_batch":
            return size
        kept = weights.sum(-1)
        return torch.where(kept > 0, kept, torch.full_like(kept, size))

    def weight_tangents(self, weights: Tensor, dloss: Tensor) -> Tensor:
        """``∂g/∂w ᵀ d̄`` of a batch from its losses' tangents ``∇ℓ_i · d̄`` ``[..., B]``.

        ``g = Σ w_j ∇ℓ_j / W``: for ``full_batch`` ``∂g/∂w_i = ∇ℓ_i / |B|``; for
        ``kept_mean`` (``W = Σ w_j``) ``∂g/∂w_i = (∇ℓ_i - g) / W``.
        """
        size = weights.shape[-1]
        if self.settings.subset_loss == "full_batch":
            return dloss / size
        w = weights.to(dloss.dtype)
        kept = w.sum()
        # torch.where, not a Python test on ``kept``: no device sync per step.
        centred = (dloss - (dloss * w).sum(-1, keepdim=True) / kept) / kept
        return torch.where(kept > 0, centred, dloss / size)

    def batch_loss(self, params: Params, weights: Tensor, batch: tuple[Tensor, ...]) -> Tensor:
        """The weighted batch loss ``Σ w_i ℓ_i / W`` (see :meth:`losses`)."""
        return self.losses(params, weights, batch)[0]

    def run_weights(self, idx: Tensor, weights: Tensor | None = None) -> Tensor:
        """Data weights of rows ``idx``: ``weights``, or the run's own (``linearize_at``)."""
        base = self.base_weights if weights is None else weights
        return base[idx].to(dtype=self.dtype, device=self.device)

    def _grad(self, params: Params, weights: Tensor, batch: tuple[Tensor, ...]) -> Params:
        """``∇_θ L`` by plain autograd (``torch.func.grad`` costs 1.5x on small models)."""
        names = list(params)
        with torch.enable_grad():
            leaves = {n: params[n].detach().requires_grad_(True) for n in names}
            loss = self.batch_loss(leaves, weights, batch)
            grads = torch.autograd.grad(loss, [leaves[n] for n in names], allow_unused=True)
        return {
            n: torch.zeros_like(params[n]) if g is None else g
            for n, g in zip(names, grads, strict=True)
        }

    def flat_grad(self, theta: Tensor, idx: Tensor, weights: Tensor | None = None) -> Tensor:
        """``∇_θ L`` of step batch ``idx`` at flat parameters ``theta``, flat."""
        grads = self._grad(
            self.layout.views(theta), self.run_weights(idx, weights), rows_of(self.data, idx)
        )
        return self.layout.flat(grads)

    # -- training ------------------------------------------------------------------------
    def init_state(self) -> dict[str, Tensor]:
        """The optimizer's zero state, flat."""
        size, dtype, device = self.layout.size, self.dtype, self.device
        return {k: torch.zeros(size, dtype=dtype, device=device) for k in self.settings.state_names}

    def theta0(self) -> Tensor:
        """The initial parameters, flat."""
        return self.layout.flat(self.params0)

    def forward(
        self,
        start: int,
        stop: int,
        theta: Tensor,
        state: dict[str, Tensor],
        weights: Tensor | None,
        keep: KeepStep | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Steps ``start..stop-1`` from flat ``theta`` and ``state``.

        ``keep(t, θ, state, g)`` sees each step's inputs and flat gradient.
        """
        for t in range(start, stop):
            grad = self.flat_grad(theta, self.order[t], weights)
            if keep is not None:
                keep(t, theta, state, grad)
            if weights is None and self.settings.max_grad_norm is not None:
                self._check_unclipped(t, grad)
            theta, state = opt_step(self.settings, self.layout, t, theta, state, grad)
        return theta, state

    def _check_unclipped(self, step: int, grad: Tensor) -> None:
        """Refuse a step whose gradient ``clip_grad_norm_`` would rescale (the replay cannot)."""
        limit = self.settings.max_grad_norm
        assert limit is not None
        norms = [torch.linalg.vector_norm(g) for g in self.layout.views(grad).values()]
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
        """Train the run, keeping a checkpoint every ``every`` steps."""
        t0 = time.perf_counter()
        self.checkpoints.clear()

        def keep(t: int, theta: Tensor, state: dict[str, Tensor], grad: Tensor) -> None:
            if t % self.every == 0:
                self.checkpoints[t] = (theta, state)

        with torch.no_grad():
            final, _ = self.forward(
                0, self.settings.num_steps, self.theta0(), self.init_state(), None, keep
            )
        self.final = self.layout.views(final)
        self.timings["train"] = time.perf_counter() - t0

    def retrain(self, weights: Tensor | None = None) -> Params:
        """Final parameters of the same run with per-example ``weights`` ``[n_train]``."""
        if weights is not None:
            weights = torch.as_tensor(weights, dtype=torch.float64).reshape(-1)
            if weights.numel() != self.n_train:
                raise ValueError(
                    f"`weights` has {weights.numel()} entries but the training set has "
                    f"{self.n_train} rows; give one weight per training row."
                )
        with torch.no_grad():
            theta, _ = self.forward(
                0, self.settings.num_steps, self.theta0(), self.init_state(), weights
            )
        return self.layout.views(theta)

    def retrain_many(self, weights: Tensor) -> Tensor:
        """Flat final parameters ``[K, P]`` of the run at each row of ``weights`` ``[K, n_train]``.

        The ``K`` runs share the initialization and batch order and go side by
        side: each step takes one ``torch.func.vmap`` of the weighted loss's
        gradient and of the optimizer step over the ``K`` parameter vectors,
        so a tiny model pays its per-step overhead once for all of them
        (datamodels need hundreds of such retrains). Row ``k`` is
        :meth:`retrain` at ``weights[k]`` up to the order of a few float sums.
        Memory: ``K`` times the parameters, state and one step's activations.
        """
        w = torch.as_tensor(weights, dtype=torch.float64)
        if w.ndim != 2 or w.shape[1] != self.n_train:
            raise ValueError(
                f"`weights` has shape {tuple(w.shape)}; give [K, n_train] = [K, {self.n_train}], "
                "one row of per-example weights per run."
            )
        w = w.to(dtype=self.dtype, device=self.device)
        count = int(w.shape[0])
        theta = self.theta0().expand(count, -1).clone()
        state = {n: s.expand(count, -1).clone() for n, s in self.init_state().items()}

        def loss(th: Tensor, wb: Tensor, batch: tuple[Tensor, ...]) -> Tensor:
            return self.batch_loss(self.layout.views(th), wb, batch)

        grads = torch.func.vmap(torch.func.grad(loss), in_dims=(0, 0, None))
        with torch.no_grad():
            for t, idx in enumerate(self.order):

                def one_step(
                    th: Tensor, st: dict[str, Tensor], g: Tensor, t: int = t
                ) -> tuple[Tensor, dict[str, Tensor]]:
                    return opt_step(self.settings, self.layout, t, th, st, g)

                with torch.enable_grad():
                    g = grads(theta, w[:, idx], rows_of(self.data, idx))
                theta, state = torch.func.vmap(one_step)(theta, state, g)
        return theta

    def require_trained(self) -> Params:
        """The trained parameters (refused before :meth:`train`)."""
        if self.final is None:
            raise RuntimeError("the run is not trained yet; call `train()` before scoring.")
        return self.final

    # -- query outputs -------------------------------------------------------------------
    def outputs(self, queries: Any, params: Params | None = None) -> Tensor:
        """``[m]`` query outputs ``f_j`` under ``params`` (default: the trained run's)."""
        theta = self.require_trained() if params is None else params
        batch = to_device(materialize(queries, self.task), self.device)

        def one(*example: Tensor) -> Tensor:
            return self.task.get_output(self.model, theta, self.buffers, *example)

        with torch.no_grad():
            out: Tensor = self.each_example(one, batch)
            return out

    def query_grads(self, batch: tuple[Tensor, ...], theta: Params) -> Params:
        """``[m, ...]`` gradients of each query's output at ``theta``."""

        def out(params: Params, *example: Tensor) -> Tensor:
            return self.task.get_output(self.model, params, self.buffers, *example)

        grads: Params = self.each_example(functools.partial(torch.func.grad(out), theta), batch)
        return grads

    def each_example(self, fn: Callable[..., Any], batch: tuple[Tensor, ...]) -> Any:
        """``fn`` of each example of ``batch``, stacked: ``vmap``, or a loop where it fails.

        Models ``vmap`` cannot trace (transformers' mask checks branch on
        values) are remembered (``vmap_ok``), so that the pull-backs skip
        forward-mode AD under ``vmap`` for them too.
        """
        if self.vmap_ok is not False:
            try:
                return torch.func.vmap(fn)(*batch)
            except RuntimeError as exc:
                if "vmap" not in str(exc):
                    raise
                self.vmap_ok = False
        rows = [fn(*(t[j] for t in batch)) for j in range(len(batch[0]))]
        if isinstance(rows[0], dict):
            return {n: torch.stack([r[n] for r in rows]) for n in rows[0]}
        return torch.stack(rows)
