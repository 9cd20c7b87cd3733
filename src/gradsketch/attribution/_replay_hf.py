"""A Hugging Face ``Trainer`` callback that records what a replay of its run needs.

:class:`ReplayCallback` watches one ``Trainer.train()``: the initial weights,
the optimizer (SGD, Adam, AdamW) and its hyper-parameters per parameter
group (the Trainer's no-weight-decay group included), the learning rate each
optimizer step actually used (so any schedule, warmup / linear / cosine /
constant, is replayed exactly), gradient accumulation, and the training rows
of every step (the indices its sampler drew, cut into micro-batches and
accumulation groups as the Trainer cuts them). :meth:`ReplayCallback.attributor`
(or ``ReplayAttributor.from_trainer``) builds the :class:`ReplayAttributor`
that replays the run.

What the replay cannot reproduce is refused when training begins, before the
run is spent: other optimizers or their options (AMSGrad, Nesterov,
dampening, ``maximize``), fp16 / bf16 mixed precision (loss scaling and
autocast rounding), dropout (its masks are drawn from the Trainer's RNG and
the replay does not redraw them), several processes, and parameters the
optimizer does not train. Gradient clipping is allowed only where it never
engages, which the replay checks step by step (``max_grad_norm=0`` turns it
off).

The Trainer averages the loss over the tokens of a whole step, the replay
over examples; the two agree, up to the Trainer's label-count factor which
the replay applies, when every example has the same number of predicted
tokens, which :meth:`ReplayCallback.attributor` checks (pass ``loss_fn`` to
replay another loss). For other tasks (sequence classifiers) the factor
depends on whether the model divides by the Trainer's label count or takes
its own micro-batch mean, which the Trainer then does not divide by the
accumulation steps; one forward with two counts tells which. A Trainer's
``compute_loss_func`` or label smoothing needs ``loss_fn``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from gradsketch.attribution._lm import IGNORE_INDEX, LanguageModelingModelOutput
from gradsketch.attribution._lm_data import as_task_batch
from gradsketch.attribution._modelout import resolve_task
from gradsketch.attribution._replay import ReplayAttributor
from gradsketch.attribution._replay_losses import (
    BatchLoss,
    language_modeling_loss,
    resolve_training_loss,
)
from gradsketch.attribution._replay_run import ReplaySettings

#: torch optimizer class name -> the replay's optimizer.
_OPTIMIZERS = {"SGD": "sgd", "Adam": "adam", "AdamW": "adamw"}


class _RecordingSampler:
    """Wraps a sampler: every pass over it is kept as one epoch's list of indices."""

    def __init__(self, inner: Any, epochs: list[list[int]]) -> None:
        self._inner = inner
        self._epochs = epochs

    def __iter__(self) -> Iterator[Any]:
        drawn: list[int] = []
        self._epochs.append(drawn)
        for index in self._inner:
            drawn.append(int(index))
            yield index

    def __len__(self) -> int:
        return len(self._inner)

    def __getattr__(self, name: str) -> Any:
        # set_epoch, generator, ...: the wrapped sampler's.
        return getattr(self._inner, name)


def _index_sampler(loader: Any) -> Any:
    """The batch sampler whose ``sampler`` draws the training rows (through accelerate's wraps)."""
    batch_sampler: Any = getattr(loader, "batch_sampler", None)
    while hasattr(batch_sampler, "batch_sampler"):
        batch_sampler = batch_sampler.batch_sampler
    if batch_sampler is None or not hasattr(batch_sampler, "sampler"):
        raise ValueError(
            "ReplayCallback cannot record the data order: the Trainer's train dataloader has no "
            "batch sampler with a `sampler` (an IterableDataset, or a custom loader). Give the "
            "Trainer a map-style dataset (with __len__ and __getitem__)."
        )
    return batch_sampler


def _trainer_lm_scale(trainer: Any, labels: Tensor) -> float:
    """The factor between the Trainer's causal-LM loss and the replay's example means.

    The Trainer divides a step's summed token losses by ``num_items_in_batch``,
    its count of labels; the replay averages each example's predicted tokens,
    then the examples. With ``n`` labels counted and ``k`` predicted per
    example the Trainer's loss is ``k / n`` times the replay's (transformers
    counts position 0 too when it does not know that the loss shifts labels,
    as for GPT-2 whose config names no ``loss_type``).
    """
    predicted = (labels[:, 1:] != IGNORE_INDEX).sum(1)
    if int(predicted.min()) != int(predicted.max()):
        raise ValueError(
            f"training examples predict between {int(predicted.min())} and "
            f"{int(predicted.max())} tokens: the Trainer averages the loss over a step's tokens, "
            "the replay over its examples, and these agree only when every example predicts as "
            "many tokens. Pack or truncate to one length, or pass `loss_fn` with the "
            "per-example losses your run used."
        )
    if not getattr(trainer, "model_accepts_loss_kwargs", False):
        return 1.0  # each micro-batch's mean, divided by the accumulation steps
    # Transformers that do not record the rule (5.0 among them) count every label.
    shifts = getattr(trainer, "_loss_shifts_labels", False)
    counted = predicted if shifts else (labels != IGNORE_INDEX).sum(1)
    if int(counted.min()) != int(counted.max()):
        raise ValueError(
            "training examples have different numbers of labels; the Trainer's per-token "
            "normalization then weights them unequally. Pack or truncate to one length, or pass "
            "`loss_fn`."
        )
    return int(predicted[0]) / max(1, int(counted[0]))


def _trainer_example_scale(
    trainer: Any, model: nn.Module, micro_batch: Any, accumulation: int
) -> float:
    """The factor between the Trainer's loss of a step and the replay's example mean.

    Per micro-batch the model returns either its own mean (``CrossEntropyLoss``,
    as BERT's classifier) or, given ``num_items_in_batch``, the step's sum
    over that count (transformers' ``loss_function``, as GPT-2's); the Trainer
    then divides by the accumulation steps unless it takes the loss as
    already scaled for them (a model that accepts loss keywords, or its
    ``loss_is_scaled_for_ga``). Whether the model uses the count is measured:
    one forward of the first micro-batch at the initial weights with two
    counts. With equal micro-batches of ``B / a`` examples the step's loss is
    ``(1 if the count is used else a) · (1 if scaled else 1 / a)`` times the
    replay's ``Σ_i ℓ_i / B``.
    """
    accepts = bool(getattr(trainer, "model_accepts_loss_kwargs", False))
    scaled = getattr(trainer, "loss_is_scaled_for_ga", None)
    if scaled is None:
        scaled = accepts
    uses_count = False
    if accepts and accumulation > 1:
        inputs = dict(micro_batch)
        with torch.no_grad():
            one, two = (model(**inputs, num_items_in_batch=torch.tensor(k)).loss for k in (1, 2))
        uses_count = not torch.allclose(one, two)
    return (1.0 if uses_count else float(accumulation)) * (1.0 if scaled else 1.0 / accumulation)


def _scaled_loss(loss: BatchLoss, scale: float, model: nn.Module, *batch: Tensor) -> Tensor:
    """``[B]`` per-example losses times the Trainer's normalization factor."""
    return loss(model, *batch) * scale


def _scaled_lm_loss(
    task: LanguageModelingModelOutput, scale: float, model: nn.Module, *batch: Tensor
) -> Tensor:
    """``[B]`` example-mean token losses times the Trainer's normalization factor."""
    losses = language_modeling_loss(task, model, *batch)
    return losses if scale == 1.0 else losses * scale


class ReplayCallback:
    """Records one ``Trainer.train()`` so that :class:`ReplayAttributor` can replay it.

    Pass it in ``Trainer(..., callbacks=[callback])``, train, then build the
    replay with :meth:`attributor` (``ReplayAttributor.from_trainer(trainer,
    callback)`` is the same). Events it does not use are no-ops.

    Attributes:
        initial_state: the parameters when training began (cloned).
        final_state: the parameters when it ended (cloned).
        lrs: the learning rate each optimizer step used.
        order: the training rows of each optimizer step.
        settings: the :class:`ReplaySettings` of the run (after training).
    """

    def __init__(self) -> None:
        self.initial_state: dict[str, Tensor] | None = None
        self.final_state: dict[str, Tensor] | None = None
        self.lrs: list[float] = []
        self.order: list[list[int]] = []
        self.settings: ReplaySettings | None = None
        self._epochs: list[list[int]] = []
        self._optimizer: Any = None
        self._hyper: dict[str, Any] = {}
        self._loader: tuple[int, bool] = (0, False)
        self._accumulation = 1

    def __getattr__(self, name: str) -> Callable[..., None]:
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)

    # -- events -------------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Check the run can be replayed; keep its weights, optimizer and data order."""
        model, optimizer = kwargs.get("model"), kwargs.get("optimizer")
        if not isinstance(model, nn.Module) or optimizer is None:
            raise ValueError(
                "ReplayCallback needs the Trainer's model and optimizer at on_train_begin; use "
                "it with transformers.Trainer (callbacks=[ReplayCallback()])."
            )
        for flag in ("fp16", "bf16"):
            if getattr(args, flag, False):
                raise ValueError(
                    f"`{flag}`=True in TrainingArguments: mixed precision (autocast rounding"
                    f"{', loss scaling' if flag == 'fp16' else ''}) cannot be replayed. Train in "
                    f"the model's own dtype ({flag}=False)."
                )
        if int(getattr(args, "world_size", 1)) > 1:
            raise ValueError(
                f"the Trainer runs on {args.world_size} processes; the replay reproduces a "
                "one-process run. Train on one process."
            )
        dropout = [
            f"{n or type(m).__name__} (p={m.p})"
            for n, m in model.named_modules()
            if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0
        ]
        if dropout:
            raise ValueError(
                f"the model has dropout ({', '.join(dropout[:3])}"
                f"{', ...' if len(dropout) > 3 else ''}): its masks come from the Trainer's "
                "random stream and the replay does not redraw them. Set the dropout "
                "probabilities to 0 (for transformers configs: "
                "resid_pdrop / embd_pdrop / attn_pdrop, or hidden_dropout_prob / "
                "attention_probs_dropout_prob) before training."
            )
        self._optimizer = getattr(optimizer, "optimizer", optimizer)
        self._hyper = self._read_optimizer(model, self._optimizer)
        self._accumulation = int(args.gradient_accumulation_steps)
        loader = kwargs.get("train_dataloader")
        batch_sampler = _index_sampler(loader)
        self._loader = (int(batch_sampler.batch_size), bool(batch_sampler.drop_last))
        if not isinstance(batch_sampler.sampler, _RecordingSampler):
            batch_sampler.sampler = _RecordingSampler(batch_sampler.sampler, self._epochs)
        self.initial_state = {n: p.detach().clone() for n, p in model.named_parameters()}
        self._max_grad_norm = float(args.max_grad_norm or 0.0)
        self.lrs, self.order, self.final_state, self.settings = [], [], None, None
        self._epochs.clear()

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Keep the learning rate the step just used (before the scheduler moves it)."""
        rates = {float(g["lr"]) for g in self._optimizer.param_groups}
        if len(rates) > 1:
            raise ValueError(
                f"the optimizer's parameter groups use different learning rates {sorted(rates)}; "
                "the replay uses one rate per step. Give every group the same rate."
            )
        self.lrs.append(rates.pop())

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Keep the final weights; cut the drawn rows into the steps the Trainer took."""
        model = kwargs.get("model")
        if isinstance(model, nn.Module):
            self.final_state = {n: p.detach().clone() for n, p in model.named_parameters()}
        steps = int(state.global_step)
        self.order = self._steps()[:steps]
        if len(self.order) != steps or len(self.lrs) != steps:
            raise ValueError(
                f"the Trainer took {steps} optimizer steps but ReplayCallback saw "
                f"{len(self.order)} batches of rows and {len(self.lrs)} learning rates; was "
                "training resumed from a checkpoint? Record one uninterrupted train() call."
            )
        self.settings = ReplaySettings(
            lr=list(self.lrs),
            num_steps=steps,
            batch_size=self._loader[0] * self._accumulation,
            max_grad_norm=self._max_grad_norm or None,
            **self._hyper,
        )

    # -- helpers ------------------------------------------------------------------
    def _read_optimizer(self, model: nn.Module, optimizer: Any) -> dict[str, Any]:
        kind = _OPTIMIZERS.get(type(optimizer).__name__)
        if kind is None:
            raise ValueError(
                f"the Trainer's optimizer is {type(optimizer).__name__}, which the replay cannot "
                f"reverse; use one of {sorted(_OPTIMIZERS)} (TrainingArguments(optim="
                "'adamw_torch' or 'sgd'))."
            )
        groups = optimizer.param_groups
        first = groups[0]
        flags = {"amsgrad": False, "maximize": False, "nesterov": False, "dampening": 0}
        for key, allowed in flags.items():
            for g in groups:
                if key in g and g[key] != allowed:
                    raise ValueError(
                        f"the optimizer has `{key}`={g[key]!r}, which the replay cannot reverse; "
                        f"use {key}={allowed!r}."
                    )
        if kind == "adam" and first.get("decoupled_weight_decay"):
            kind = "adamw"
        keys = {"sgd": ("momentum",), "adam": ("betas", "eps"), "adamw": ("betas", "eps")}[kind]
        for key in keys:
            values = {repr(g[key]) for g in groups}
            if len(values) > 1:
                raise ValueError(
                    f"the optimizer's parameter groups use different `{key}` ({sorted(values)}); "
                    "the replay uses one value for all parameters."
                )
        decays = sorted({float(g["weight_decay"]) for g in groups})
        if len(decays) > 2 or (len(decays) == 2 and decays[0] != 0.0):
            raise ValueError(
                f"the optimizer's parameter groups use weight decays {decays}; the replay takes "
                "one decay and a set of parameters without it (the Trainer's own grouping)."
            )
        names = {id(p): n for n, p in model.named_parameters()}
        trained = {id(p) for g in groups for p in g["params"]}
        frozen = [n for i, n in names.items() if i not in trained]
        if frozen:
            raise ValueError(
                f"parameters {frozen[:3]}{' ...' if len(frozen) > 3 else ''} are not trained by "
                "the optimizer, but the replay trains every parameter of the model; train them "
                "all (or replay a model without the frozen ones)."
            )
        no_decay = [
            names[id(p)] for g in groups if float(g["weight_decay"]) == 0.0 for p in g["params"]
        ]
        hyper: dict[str, Any] = {"optimizer": kind, "weight_decay": decays[-1]}
        if len(decays) == 2:
            hyper["no_decay"] = no_decay
        if kind == "sgd":
            hyper["momentum"] = float(first["momentum"])
        else:
            hyper["betas"] = tuple(float(b) for b in first["betas"])
            hyper["eps"] = float(first["eps"])
        return hyper

    def _steps(self) -> list[list[int]]:
        """The drawn rows as optimizer steps: micro-batches, grouped by accumulation."""
        size, drop_last = self._loader
        steps: list[list[int]] = []
        for epoch in self._epochs:
            micro = [epoch[j : j + size] for j in range(0, len(epoch), size)]
            if drop_last and micro and len(micro[-1]) < size:
                micro.pop()
            for j in range(0, len(micro), self._accumulation):
                group = micro[j : j + self._accumulation]
                if len({len(b) for b in group}) > 1:
                    raise ValueError(
                        f"an accumulation step mixes micro-batches of sizes "
                        f"{[len(b) for b in group]}; the Trainer then weights their examples "
                        "unequally and the replay cannot. Use dataloader_drop_last=True, or a "
                        "training set whose size the batch size divides."
                    )
                steps.append([i for b in group for i in b])
        return steps

    # -- the replay ---------------------------------------------------------------
    def attributor(
        self,
        trainer: Any,
        task: Any = "language_modeling",
        **kwargs: Any,
    ) -> ReplayAttributor:
        """A :class:`ReplayAttributor` of the recorded run (not yet trained).

        The replay runs on a copy of ``trainer.model`` set back to the
        initial weights (``trainer.model`` keeps the trained ones); the
        training rows are the Trainer's ``train_dataset`` collated by its
        ``data_collator`` as one batch.

        Args:
            trainer: the ``transformers.Trainer`` that trained with this callback.
            task: the query output (``"language_modeling"`` for causal LMs,
                ``"text_classification"`` for sequence classifiers).
            **kwargs: passed to :class:`ReplayAttributor` (``loss_fn``,
                ``save_dir``, ``memory_budget``, ``progress``); ``checkpoint_every``
                goes to the settings.
        """
        if self.settings is None or self.initial_state is None:
            raise ValueError(
                "ReplayCallback has recorded no finished run; pass it to the Trainer "
                "(callbacks=[callback]) and call trainer.train() first."
            )
        settings = self.settings
        if "checkpoint_every" in kwargs:
            settings = dataclasses.replace(
                settings, checkpoint_every=kwargs.pop("checkpoint_every")
            )
        dataset = trainer.train_dataset
        rows = [dataset[i] for i in range(len(dataset))]
        batch = trainer.data_collator(rows)
        resolved = resolve_task(task)
        data = as_task_batch(resolved, dict(batch) if isinstance(batch, dict) else batch)
        model = copy.deepcopy(trainer.model)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(self.initial_state[name])
        if "loss_fn" not in kwargs:
            if getattr(trainer, "compute_loss_func", None) is not None:
                raise ValueError(
                    "the Trainer trained with its own `compute_loss_func`, which the replay "
                    "cannot read; pass `loss_fn(model, *batch) -> [B]` with the per-example "
                    "losses of that function."
                )
            if float(getattr(trainer.args, "label_smoothing_factor", 0.0) or 0.0) > 0:
                raise ValueError(
                    f"`label_smoothing_factor`={trainer.args.label_smoothing_factor} in "
                    "TrainingArguments: the replay's default loss has no smoothing. Train "
                    "without it, or pass `loss_fn` with the smoothed per-example losses."
                )
            if isinstance(resolved, LanguageModelingModelOutput):
                kwargs["loss_fn"] = functools.partial(
                    _scaled_lm_loss, resolved, _trainer_lm_scale(trainer, data[2])
                )
            else:
                micro = self.order[0][: self._loader[0]]
                scale = _trainer_example_scale(
                    trainer,
                    model,
                    trainer.data_collator([dataset[i] for i in micro]),
                    self._accumulation,
                )
                if scale != 1.0:
                    kwargs["loss_fn"] = functools.partial(
                        _scaled_loss, resolve_training_loss(resolved, None), scale
                    )
        kwargs.setdefault("progress", not getattr(trainer.args, "disable_tqdm", False))
        return ReplayAttributor(
            model, resolved, data, settings, order=[list(b) for b in self.order], **kwargs
        )
