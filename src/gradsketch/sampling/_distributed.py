"""LLC chains spread over ``torch.distributed`` ranks (launched with ``torchrun``).

Chain ``c`` runs on rank ``c % world_size`` with exactly the seed, model copy
and loader order it gets in one process, so the estimate equals
``estimate_learning_coeff_with_summary(..., cores=1)`` for the same ``seed``.
The per-chain loss traces are exchanged with ``all_gather_object`` (a few
floats per draw); every rank returns the same summary.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from gradsketch import _distributed as _common
from gradsketch._hash import state_digest
from gradsketch.errors import DistributedMismatchError
from gradsketch.sampling._llc import (
    Evaluate,
    _chain_jobs,
    _finish,
    _initial_loss,
    _method_name,
    _resolve_run,
    _run_chain,
    _summary,
)
from gradsketch.sampling._sgmcmc import SGMCMC

logger = logging.getLogger(__name__)

__all__ = ["DistributedMismatchError", "estimate_learning_coeff_distributed"]


def _model_fingerprint(model: torch.nn.Module) -> str:
    """Hash of the weights and buffers: ranks must start every chain from the same w*."""
    return state_digest(model.state_dict())


def check_distributed_callbacks(callbacks: Sequence[Callable[..., Any]], world_size: int) -> None:
    """Refuse callbacks with ``get_results`` across several ranks.

    Each rank's callbacks only see that rank's chains, so results they
    aggregate would differ between ranks and from one process.
    """
    aggregating = [
        type(cb).__name__ for cb in callbacks if callable(getattr(cb, "get_results", None))
    ]
    if world_size > 1 and aggregating:
        raise ValueError(
            f"`callbacks` {aggregating} have get_results(), but with world_size={world_size} "
            "each rank's callbacks see only the chains of that rank (chain c runs on rank "
            "c % world_size), so their results cannot be merged. Record per-draw data with "
            "`store=` instead, or run with one process."
        )


def _device_for_rank(device: str | torch.device) -> torch.device:
    """``"cuda"`` without an index means this rank's GPU (``LOCAL_RANK``)."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", _common.local_rank())
    return dev


def estimate_learning_coeff_distributed(
    model: torch.nn.Module,
    loader: Iterable[Any],
    evaluate: Evaluate | None = None,
    sampling_method: object = SGMCMC.sgld,
    optimizer_kwargs: dict[str, Any] | None = None,
    num_draws: int = 100,
    num_chains: int = 10,
    num_burnin_steps: int = 0,
    num_steps_bw_draws: int = 1,
    init_loss: float | None = None,
    grad_accum_steps: int = 1,
    seed: int | None = None,
    device: str | torch.device = "cpu",
    callbacks: Sequence[Callable[..., Any]] = (),
    online: bool = False,
    verbose: bool = True,
    *,
    store: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """:func:`estimate_learning_coeff_with_summary` with its chains spread over ranks.

    ``LLC = nbeta * (E_w[L(w)] - L(w*))`` (Lau, Furman, Wang, Murfet & Wei
    2023). Run under ``torchrun``, after ``torch.distributed.init_process_group``
    (gloo on CPU, NCCL on GPU); every rank calls it with the same arguments.
    Chain ``c`` runs on rank ``c % world_size``; ``L(w*)`` and (when ``seed``
    is None) the seed are computed on rank 0 and broadcast; the
    ``[num_draws]`` loss traces are gathered with ``all_gather_object``. The
    result equals the one-process ``cores=1`` result for the same ``seed``
    (bit for bit on the same hardware and thread count) and is returned on
    every rank. Without a process group it runs every chain in this process.

    Args:
        model: The trained network, identical on every rank (checked).
        loader: Iterable of batches; each rank iterates its own copy.
        evaluate: ``evaluate(model, batch)`` returning the loss (default
            cross-entropy on ``(x, y)``).
        sampling_method: Sampler factory (``SGMCMC.sgld`` ...), class or name.
        optimizer_kwargs: Sampler keywords; ``nbeta`` defaults to
            ``default_nbeta(loader)``.
        num_draws: Draws per chain.
        num_chains: Chains (more chains than ranks: ranks run several in turn).
        num_burnin_steps: Steps discarded before the first draw.
        num_steps_bw_draws: Steps between draws.
        init_loss: ``L(w*)``; default: mean over the first 8 batches (rank 0).
        grad_accum_steps: Micro-batches per step.
        seed: Chain ``c``'s seed comes from ``(seed, c)``, as in one process.
        device: Where chains run; ``"cuda"`` without an index is
            ``cuda:LOCAL_RANK`` (with NCCL also call
            ``torch.cuda.set_device(local_rank)``: its object collectives use
            the current device).
        callbacks: ``callback(chain=, draw=, loss=, model=, optimizer=)`` on the
            rank running the chain; callbacks with ``get_results()`` need a
            world of one rank.
        online: Also return per-draw running estimates.
        verbose: Progress bars (rank 0 only).
        store: Directory of the zarr draw store shared by all ranks (each chain
            writes its own chunks); finished chains are skipped on reruns.

    Returns:
        The dict of :func:`estimate_learning_coeff_with_summary`:
        ``llc/mean``, ``llc/std``, ``llc-chain/{i}``, ``loss/trace``
        ``[chains, draws]``, ``llc/ess``, ``llc/rhat``, ``init_loss``,
        ``nbeta`` (+ online traces, ``store``).

    Raises:
        DistributedMismatchError: ranks passed different weights or settings.

    Example:
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> g = torch.Generator().manual_seed(0)
        >>> data = TensorDataset(torch.randn(64, 4, generator=g), torch.randint(0, 2, (64,)))
        >>> out = estimate_learning_coeff_distributed(  # no process group: one rank
        ...     torch.nn.Linear(4, 2), DataLoader(data, batch_size=16), num_draws=5,
        ...     num_chains=2, seed=0, verbose=False,
        ...     optimizer_kwargs=dict(lr=1e-4, localization=100.0))
        >>> out["loss/trace"].shape
        (2, 5)
    """
    rank, world = _common.rank_and_world()
    check_distributed_callbacks(callbacks, world)
    evaluate, method, kwargs, nbeta = _resolve_run(
        loader,
        evaluate,
        sampling_method,
        optimizer_kwargs,
        num_draws=num_draws,
        num_chains=num_chains,
        num_burnin_steps=num_burnin_steps,
        num_steps_bw_draws=num_steps_bw_draws,
        grad_accum_steps=grad_accum_steps,
    )
    if seed is None:
        # The same draw from the global generator as one process, made once.
        seed = _common.broadcast_object(
            int(torch.randint(0, 2**31 - 1, ()).item()) if rank == 0 else None
        )
    assert seed is not None
    torch_device = _device_for_rank(device)

    _common.require_same_across_ranks(
        "LLC settings",
        {
            "model fingerprint": _model_fingerprint(model),
            "seed": seed,
            "num_chains": num_chains,
            "num_draws": num_draws,
            "num_burnin_steps": num_burnin_steps,
            "num_steps_bw_draws": num_steps_bw_draws,
            "grad_accum_steps": grad_accum_steps,
            "nbeta": nbeta,
            "sampling_method": _method_name(sampling_method),
        },
        fix="Every rank must pass the same model weights and arguments.",
    )

    if init_loss is None and rank == 0:
        init_loss = _initial_loss(
            copy.deepcopy(model).to(torch_device).eval(), loader, evaluate, torch_device, seed
        )
    init_loss = float(_common.broadcast_object(init_loss))

    # Chain c runs on rank c % world; rank 0 creates the store's arrays, the others open
    # them once they exist.
    jobs, local = _chain_jobs(
        model,
        loader,
        evaluate,
        method,
        sampling_method,
        kwargs,
        chains=range(rank, num_chains, world),
        seed=seed,
        nbeta=nbeta,
        num_chains=num_chains,
        num_draws=num_draws,
        num_burnin_steps=num_burnin_steps,
        num_steps_bw_draws=num_steps_bw_draws,
        grad_accum_steps=grad_accum_steps,
        device=torch_device,
        store=store,
        verbose=verbose and rank == 0,
        callbacks=callbacks,
        opening=_common.rank_zero_first,
    )
    progress = tqdm(total=len(jobs), desc="LLC chains", disable=not verbose or rank != 0)
    for job in jobs:
        _, local[job.chain] = _run_chain(None, job)
        progress.update()
    progress.close()

    traces: dict[int, np.ndarray] = {}
    for part in _common.all_gather_object(local):
        traces.update(part)
    results = _summary(np.stack([traces[c] for c in range(num_chains)]), init_loss, nbeta, online)
    return _finish(results, callbacks, store)
