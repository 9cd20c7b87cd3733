"""The reference packages' side of the influence protocols: Kronfluence tasks and runs.

Kronfluence 1.0.1 (``pip install --no-deps kronfluence==1.0.1``, the
``bench`` extra) scores the same checkpoints and queries as gradsketch:
:func:`kronfluence_classifier_task` and :func:`kronfluence_lm_task` state the
protocols' losses and measurements its way, :func:`kronfluence_ensemble`
fits and scores every checkpoint per damping, and :func:`conv1d_to_linear`
hands it GPT-2 with ``nn.Linear`` layers (it does not hook ``Conv1D``).
Nothing here imports a reference package before it is called.
"""

from __future__ import annotations

import copy
import logging
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from gradsketch.demos.protocols._influence import margin_of

#: Kronfluence 1.0.1's own default damping (``ScoreArguments().damping_factor``);
#: ``None`` selects its heuristic, 0.1 x each module's mean eigenvalue.
KRONFLUENCE_DEFAULT_DAMPING = 1e-8


def kronfluence_classifier_task(forward: Any) -> Any:
    """A Kronfluence ``Task`` for a classifier: ``forward(model, batch) -> (logits, labels)``.

    Training loss: the batch's summed cross-entropy, under labels drawn from
    the model's own predictions when Kronfluence asks for a sample (its true
    Fisher); measurement: the summed margin (:func:`margin_of`).
    """
    from kronfluence.task import Task

    class ClassifierTask(Task):
        def compute_train_loss(self, batch, model, sample=False):
            logits, labels = forward(model, batch)
            if sample:
                with torch.no_grad():
                    probs = torch.softmax(logits.detach(), -1)
                    labels = torch.multinomial(probs, 1).flatten()
            return F.cross_entropy(logits, labels, reduction="sum")

        def compute_measurement(self, batch, model):
            return margin_of(*forward(model, batch)).sum()

    return ClassifierTask()


def _digits_forward(model: nn.Module, batch) -> tuple[torch.Tensor, torch.Tensor]:
    return model(batch[0]), batch[1]


def kronfluence_pairwise(
    model: nn.Module,
    task: Any,
    train_ds: Any,
    query_ds: Any,
    workdir: str,
    *,
    strategy: str,
    dampings: tuple[float | None, ...] = (KRONFLUENCE_DEFAULT_DAMPING,),
    train_batch: int = 250,
    query_batch: int | None = None,
    seed: int = 0,
) -> dict[float | None, np.ndarray]:
    """Kronfluence's ``[n_train, n_query]`` pairwise scores of one model, per damping factor.

    The factors of ``strategy`` are fitted once (torch's generator seeded
    with ``seed`` for the sampled labels of its true Fisher), then scored at
    each ``damping_factor`` in ``dampings`` (``None``: its heuristic). Scores
    are Kronfluence's own sign, ``∇f_qᵀ H⁻¹ ∇L_i``; ``model`` is prepared
    (wrapped) in place.
    """
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments, ScoreArguments
    from kronfluence.utils.dataset import DataLoaderKwargs

    model = prepare_model(model.eval(), task)
    analyzer = Analyzer(
        "bench",
        model,
        task,
        cpu=True,
        disable_tqdm=True,
        output_dir=workdir,
        log_level=logging.ERROR,
    )
    analyzer.set_dataloader_kwargs(DataLoaderKwargs(num_workers=0))
    torch.manual_seed(seed)
    analyzer.fit_all_factors(
        "factors",
        train_ds,
        per_device_batch_size=train_batch,
        factor_args=FactorArguments(strategy=strategy),
        overwrite_output_dir=True,
    )
    out: dict[float | None, np.ndarray] = {}
    for i, damping in enumerate(dampings):
        analyzer.compute_pairwise_scores(
            f"scores{i}",
            "factors",
            query_ds,
            train_ds,
            per_device_query_batch_size=query_batch or len(query_ds),
            per_device_train_batch_size=train_batch,
            score_args=ScoreArguments(damping_factor=damping),
            overwrite_output_dir=True,
        )
        scores = analyzer.load_pairwise_scores(f"scores{i}")["all_modules"]  # [queries, train]
        out[damping] = scores.T.double().numpy()
    return out


def kronfluence_ensemble(
    models: list[nn.Module],
    task: Any,
    train_ds: Any,
    query_ds: Any,
    tmp: str,
    *,
    strategy: str,
    dampings: tuple[float | None, ...],
    sign: float = 1.0,
    prepare: Any = copy.deepcopy,
    **kwargs: Any,
) -> dict[float | None, np.ndarray]:
    """``sign`` x the mean over ``models`` of :func:`kronfluence_pairwise`, per damping.

    ``prepare(model)`` gives the copy Kronfluence wraps (the models stay as they are).
    """
    total = {d: np.zeros((len(train_ds), len(query_ds))) for d in dampings}
    for i, model in enumerate(models):
        workdir = str(Path(tempfile.mkdtemp(dir=tmp)) / f"kf{i}")
        scores = kronfluence_pairwise(
            prepare(model),
            task,
            train_ds,
            query_ds,
            workdir,
            strategy=strategy,
            dampings=dampings,
            **kwargs,
        )
        for d in dampings:
            total[d] += sign * scores[d] / len(models)
    return total


def digits_kronfluence(
    models, x, y, xt, yt, tmp: str, strategy: str, dampings: tuple[float | None, ...]
) -> dict[float | None, np.ndarray]:
    """Kronfluence's ``strategy`` on a digits protocol (any architecture), per damping.

    Its scores are the effect of *removing* a training row on the query's
    margin, so they are negated ("positive = helps").
    """
    from torch.utils.data import TensorDataset

    return kronfluence_ensemble(
        models,
        kronfluence_classifier_task(_digits_forward),
        TensorDataset(x, y),
        TensorDataset(xt, yt),
        tmp,
        strategy=strategy,
        dampings=dampings,
        sign=-1.0,
    )


def lm_kronfluence(
    models, train_ids, query_ids, tmp: str, strategy: str, dampings: tuple[float | None, ...]
) -> dict[float | None, np.ndarray]:
    """Kronfluence's ``strategy`` on the LM (Conv1D made Linear), per damping.

    The measurement is the query's summed loss and the training loss the
    summed loss (sampled labels for its true Fisher, :func:`kronfluence_lm_task`),
    so a positive score raises the query's log-likelihood: no sign change.
    """
    return kronfluence_ensemble(
        models,
        kronfluence_lm_task(),
        TokenRows(train_ids),
        TokenRows(query_ids),
        tmp,
        strategy=strategy,
        dampings=dampings,
        prepare=lambda model: conv1d_to_linear(copy.deepcopy(model)),
        train_batch=32,
    )


def conv1d_to_linear(model: nn.Module) -> nn.Module:
    """Replace every Hugging Face ``Conv1D`` (``y = x W + b``, ``W`` [in, out]) by ``nn.Linear``."""
    from transformers.pytorch_utils import Conv1D

    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, Conv1D):
                w = child.weight
                linear = nn.Linear(
                    w.shape[0],
                    w.shape[1],
                    bias=child.bias is not None,
                    dtype=w.dtype,
                    device=w.device,
                )
                with torch.no_grad():
                    linear.weight.copy_(w.t())
                    if child.bias is not None:
                        linear.bias.copy_(child.bias)
                setattr(module, child_name, linear)
        del name
    return model


def token_loss(logits: Tensor, ids: Tensor) -> Tensor:
    """``[B]`` summed next-token cross-entropy of each sequence."""
    z = logits[:, :-1]
    logp = torch.log_softmax(z.float() if z.dtype in (torch.float16, torch.bfloat16) else z, -1)
    return -logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1).sum(-1)


def kronfluence_lm_task() -> Any:
    from kronfluence.task import Task

    class SummedTokenLoss(Task):
        """Train loss and measurement: the chunk's summed token loss."""

        def compute_train_loss(self, batch: Any, model: nn.Module, sample: bool = False) -> Tensor:
            ids = batch[0] if isinstance(batch, list | tuple) else batch
            logits = model(input_ids=ids).logits
            if not sample:
                return token_loss(logits, ids).sum()
            # The true Fisher: labels drawn from the model's own predictions.
            with torch.no_grad():
                probs = torch.softmax(logits[:, :-1].detach().float(), dim=-1)
                drawn = torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1)
            drawn = drawn.reshape(ids.shape[0], -1)
            return token_loss(logits, torch.cat([ids[:, :1], drawn], dim=1)).sum()

        def compute_measurement(self, batch: Any, model: nn.Module) -> Tensor:
            ids = batch[0] if isinstance(batch, list | tuple) else batch
            return token_loss(model(input_ids=ids).logits, ids).sum()

    return SummedTokenLoss()


class TokenRows(torch.utils.data.Dataset):
    def __init__(self, ids: Tensor) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def __getitem__(self, i: int) -> Tensor:
        return self.ids[i]
