"""Small models and data shared by the attribution tests."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gradsketch.attribution import ReplayAttributor

#: Rows, steps and batch size of the replay tests' run (two passes over the rows and more).
REPLAY_N, REPLAY_STEPS, REPLAY_BATCH = 12, 10, 4

#: (optimizer, keywords) of each replayed optimizer, with momentum, weight decay, schedules.
REPLAY_OPTIMIZERS = [
    pytest.param("sgd", {"lr": 0.3, "momentum": 0.9, "weight_decay": 0.01}, id="sgd-momentum-wd"),
    pytest.param(
        "sgd", {"lr": [0.3 * 0.9**t for t in range(REPLAY_STEPS)]}, id="sgd-schedule-no-momentum"
    ),
    pytest.param("adam", {"lr": 0.05, "weight_decay": 0.01, "eps": 1e-6}, id="adam-l2"),
    pytest.param("adamw", {"lr": lambda t: 0.05 / (1 + t), "weight_decay": 0.1}, id="adamw-sched"),
]


def replay_mlp() -> torch.nn.Module:
    """The float64 ``4 -> 5 -> 3`` tanh MLP of the replay tests (seeded: equal on every call)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)
    ).double()


def replay_data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` float64 rows of 4 features for :func:`replay_mlp`, labels ``0, 1, 2, 0, ...``."""
    gen = torch.Generator().manual_seed(1)
    return torch.randn(n, 4, generator=gen, dtype=torch.float64), torch.arange(n) % 3


def logreg_data(n=40, d=5, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    y = torch.randint(0, classes, (n,), generator=g)
    return x, y


def logreg_checkpoints(d=5, classes=3, count=2, seed=0):
    """Independent random logistic-regression weights (float64)."""
    out = []
    for c in range(count):
        torch.manual_seed(seed + c)
        model = torch.nn.Linear(d, classes).double()
        out.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return out


def margin_grad_reference(state, x, y):
    """d margin / d (W, b) per example, explicit float64 formula.

    margin = z_y - log Σ_{j≠y} exp(z_j); dmargin/dz = e_y - softmax_{j≠y}(z).
    """
    w, b = state["weight"], state["bias"]
    z = x @ w.T + b
    masked = z.clone()
    masked[torch.arange(len(y)), y] = float("-inf")
    s = torch.softmax(masked, dim=1)
    dz = -s
    dz[torch.arange(len(y)), y] += 1.0
    gw = dz[:, :, None] * x[:, None, :]
    return torch.cat([gw.reshape(len(y), -1), dz], dim=1)


def q_reference(state, x, y):
    z = x @ state["weight"].T + state["bias"]
    return 1 - torch.softmax(z, dim=1)[torch.arange(len(y)), y]


def trained_replay(
    optimizer: str, kw: dict[str, Any], *, device: str = "cpu", **extra: Any
) -> ReplayAttributor:
    """:func:`replay_mlp` on ``device``, :func:`replay_data` (CPU rows), trained by the replay."""
    x, y = replay_data(REPLAY_N)
    r = ReplayAttributor(
        replay_mlp().to(device),
        "image_classification",
        (x, y),
        optimizer=optimizer,
        num_steps=REPLAY_STEPS,
        batch_size=REPLAY_BATCH,
        progress=False,
        **kw,
        **extra,
    )
    r.train()
    return r


def replay_trainer(
    tmp_path: Any, model: torch.nn.Module, rows: list[dict[str, torch.Tensor]], **overrides: Any
) -> tuple[Any, Any]:
    """Five ``transformers.Trainer`` steps on CPU recorded by a ``ReplayCallback``.

    AdamW (the Trainer's default), weight decay with the Trainer's no-decay
    group, linear warmup then decay, two micro-batches of two per step
    (accumulation) and more steps than one epoch holds. ``overrides`` are
    ``TrainingArguments``; ``optimizer=`` (model -> a torch optimizer) gives
    the Trainer an optimizer of one's own. Returns ``(trainer, callback)``.
    """
    import warnings

    import transformers

    from gradsketch.attribution import ReplayCallback

    settings: dict[str, Any] = dict(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=5,
        learning_rate=1e-2,
        weight_decay=0.1,
        warmup_steps=2,
        lr_scheduler_type="linear",
        max_grad_norm=0.0,
        adam_epsilon=1e-3,
        seed=7,
    )
    make_optimizer = overrides.pop("optimizer", None)
    settings.update(overrides)
    optimizers = (None, None) if make_optimizer is None else (make_optimizer(model), None)
    callback = ReplayCallback()
    with warnings.catch_warnings():
        # transformers' own notices about CPU runs and unused features, nothing of ours.
        warnings.simplefilter("ignore")
        trainer = transformers.Trainer(
            model=model,
            args=transformers.TrainingArguments(**settings),
            train_dataset=rows,
            callbacks=[callback],
            optimizers=optimizers,
        )
        trainer.train()
    return trainer, callback
