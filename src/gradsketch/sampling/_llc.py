"""Local learning coefficient (LLC) estimation with SGMCMC chains.

``LLC = nbeta * (E_w[L(w)] - L(w*))`` (Lau, Furman, Wang, Murfet & Wei 2023),
where the expectation runs over draws of a localized SGMCMC chain started at
the trained weights ``w*`` (burn-in excluded), ``L(w*)`` is averaged over
several batches, and ``nbeta`` defaults to ``n / log n`` for batch size ``n``.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import math
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ParamSpec

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from gradsketch._checks import nonnegative_int, positive_int
from gradsketch._device import to_device
from gradsketch._processes import check_cores, run_jobs
from gradsketch.sampling._chain import DrawSchedule, run_chain
from gradsketch.sampling._divergence import warn_if_diverged
from gradsketch.sampling._metrics import DOT_FIELDS, NORM_FIELDS
from gradsketch.sampling._recording import LLCRecordSettings, open_draw_store
from gradsketch.sampling._sgmcmc import SGMCMC

logger = logging.getLogger(__name__)

_P = ParamSpec("_P")

__all__ = [
    "default_nbeta",
    "estimate_learning_coeff",
    "estimate_learning_coeff_with_summary",
    "evaluate_ce",
]

#: Batches averaged for the initial loss L(w*) when ``init_loss`` is not given.
INIT_LOSS_BATCHES = 8

Evaluate = Callable[[torch.nn.Module, Any], Any]


def default_nbeta(loader_or_batch_size: DataLoader[Any] | int, grad_accum_steps: int = 1) -> float:
    """``nbeta = m / log m`` for the effective batch size ``m = batch_size * grad_accum_steps``.

    Watanabe's WBIC temperature ``beta* = 1 / log n`` applied to the batch
    (Watanabe, JMLR 2013). Falls back to 1 when ``m <= 1``.

    Args:
        loader_or_batch_size: A DataLoader with a ``batch_size``, or the batch size.
        grad_accum_steps: Micro-batches per step.

    Returns:
        nbeta.

    Example:
        >>> round(default_nbeta(100), 4)
        21.7147
    """
    if isinstance(loader_or_batch_size, DataLoader):
        size = loader_or_batch_size.batch_size
        if size is None:
            raise ValueError(
                "`loader_or_batch_size` is a DataLoader without a batch_size (custom batch "
                "sampler); pass the batch size as an int instead."
            )
    elif isinstance(loader_or_batch_size, int) and not isinstance(loader_or_batch_size, bool):
        size = loader_or_batch_size
    else:
        raise ValueError(
            "`loader_or_batch_size` must be a torch DataLoader or a positive int, got "
            f"{type(loader_or_batch_size).__name__}."
        )
    positive_int("grad_accum_steps", grad_accum_steps)
    m = size * grad_accum_steps
    if m <= 1:
        logger.warning("default nbeta is undefined for an effective batch size of %d; using 1.", m)
        return 1.0
    return m / math.log(m)


def evaluate_ce(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """Default ``evaluate``: mean cross-entropy of ``model(x)`` against ``y`` for ``(x, y)``.

    Example:
        >>> model = torch.nn.Linear(2, 3)
        >>> evaluate_ce(model, (torch.zeros(4, 2), torch.zeros(4, dtype=torch.long))).shape
        torch.Size([])
    """
    x, y = batch[0], batch[1]
    return F.cross_entropy(model(x), y)


def _loss_of(output: Any) -> torch.Tensor:
    loss = output[0] if isinstance(output, (tuple, list)) else output
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(
            "`evaluate` must return a scalar loss tensor or a tuple whose first element is "
            f"one, got {type(loss).__name__}"
            + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
            + "; reduce the loss with .mean()."
        )
    return loss.reshape(())


def _forever(loader: Iterable[Any]) -> Iterator[Any]:
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise ValueError("`loader` yielded no batches; give it at least one batch.")


def _chain_seed(seed: int, chain: int) -> int:
    # SeedSequence mixes (seed, chain) so neighbouring chains get unrelated streams.
    return int(np.random.SeedSequence([seed, chain]).generate_state(1, dtype=np.uint64)[0] >> 1)


def _resolve_method(sampling_method: object) -> Callable[..., torch.optim.Optimizer]:
    if isinstance(sampling_method, str):
        return SGMCMC.get_method(sampling_method)
    if callable(sampling_method):
        return sampling_method  # type: ignore[return-value]
    raise ValueError(
        f"`sampling_method` must be a sampler factory (e.g. SGMCMC.sgld), a class, or one of "
        f"{list(SGMCMC.METHODS)}, got {sampling_method!r}."
    )


def _method_name(sampling_method: object) -> str:
    if isinstance(sampling_method, str):
        return sampling_method
    return str(getattr(sampling_method, "__qualname__", repr(sampling_method)))


@torch.no_grad()
def _initial_loss(
    model: torch.nn.Module,
    loader: Iterable[Any],
    evaluate: Evaluate,
    device: torch.device,
    seed: int,
) -> float:
    total, count = 0.0, 0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for batch in loader:
            total += float(_loss_of(evaluate(model, to_device(batch, device))))
            count += 1
            if count >= INIT_LOSS_BATCHES:
                break
    if count == 0:
        raise ValueError("`loader` yielded no batches; give it at least one batch.")
    return total / count


@dataclass
class _ChainJob:
    chain: int
    seed: int
    model: torch.nn.Module
    loader: Iterable[Any]
    evaluate: Evaluate
    sampling_method: Callable[..., torch.optim.Optimizer]
    optimizer_kwargs: dict[str, Any]
    num_steps: int
    num_burnin_steps: int
    num_steps_bw_draws: int
    num_draws: int
    grad_accum_steps: int
    device: str
    store_path: str | None
    store_settings: dict[str, Any] | None
    sketch_dim: int | None
    verbose: bool
    callbacks: Sequence[Callable[..., Any]] = ()


def _run_chain(shared: None, job: _ChainJob) -> tuple[int, np.ndarray]:
    """One chain: copy the model, sample, return ``(chain, losses[draws])`` (and record)."""
    device = torch.device(job.device)
    model = copy.deepcopy(job.model).to(device)
    losses = np.full(job.num_draws, np.nan)
    sketches: list[np.ndarray] = []
    metrics: list[np.ndarray] = []
    with torch.random.fork_rng(devices=[]):
        # Seeds the loader's shuffling; the sampler's noise has its own stream.
        torch.manual_seed(job.seed)
        noise = torch.Generator(device=device).manual_seed(job.seed ^ 0x5DEECE66D)
        optimizer = job.sampling_method(model.parameters(), **job.optimizer_kwargs)
        batches = _forever(job.loader)
        model.train()

        def step_loss(step: int) -> float:
            loss_value = 0.0
            for _ in range(job.grad_accum_steps):
                batch = to_device(next(batches), device)
                loss = _loss_of(job.evaluate(model, batch))
                (loss / job.grad_accum_steps).backward()
                loss_value += float(loss.detach()) / job.grad_accum_steps
            return loss_value

        def nonfinite(step: int, loss_value: float) -> RuntimeError:
            return RuntimeError(
                f"chain {job.chain} hit a non-finite loss ({loss_value}) at step {step}; "
                "lower `lr`, raise `localization`, or set `bounding_box_size`."
            )

        def on_draw(draw: int, step: int, loss_value: float) -> None:
            losses[draw] = loss_value
            if job.store_path is not None:
                if job.sketch_dim is not None:
                    buf = optimizer.get_sketches()  # type: ignore[attr-defined]
                    sketches.append(torch.stack(list(buf.as_dict().values())).numpy())
                if getattr(optimizer, "save_metrics", False):
                    m = optimizer.get_metrics()  # type: ignore[attr-defined]
                    metrics.append(
                        np.array([float(getattr(m, f)) for f in (*NORM_FIELDS, *DOT_FIELDS)])
                    )
            for callback in job.callbacks:
                callback(
                    chain=job.chain, draw=draw, loss=loss_value, model=model, optimizer=optimizer
                )

        bar = tqdm(
            total=job.num_steps, desc=f"chain {job.chain}", disable=not job.verbose, leave=False
        )
        run_chain(
            optimizer,
            step_loss,
            DrawSchedule(job.num_draws, job.num_burnin_steps, job.num_steps_bw_draws),
            noise_generator=noise,
            nonfinite_error=nonfinite,
            on_draw=on_draw,
            tick=bar.update if job.verbose else None,
        )
        bar.close()
    if job.store_path is not None:
        assert job.store_settings is not None
        store = open_draw_store(
            job.store_path,
            LLCRecordSettings.from_dict(job.store_settings),
            sketch_dim=job.sketch_dim,
        )
        store.write_chain(
            job.chain,
            losses,
            np.stack(sketches) if sketches else None,
            np.stack(metrics) if metrics else None,
        )
    return job.chain, losses


def _diagnostics(trace: np.ndarray) -> tuple[float, float]:
    if trace.shape[1] < 4:
        return math.nan, math.nan
    with warnings.catch_warnings():
        # ArviZ announces its refactor with a FutureWarning on import.
        warnings.simplefilter("ignore")
        import arviz as az

        ess = float(az.ess(trace))
        rhat = float(az.rhat(trace)) if trace.shape[0] >= 2 else math.nan
    return ess, rhat


def _resolve_run(
    loader: Iterable[Any],
    evaluate: Evaluate | None,
    sampling_method: object,
    optimizer_kwargs: dict[str, Any] | None,
    *,
    num_draws: int,
    num_chains: int,
    num_burnin_steps: int,
    num_steps_bw_draws: int,
    grad_accum_steps: int,
) -> tuple[Evaluate, Callable[..., torch.optim.Optimizer], dict[str, Any], float]:
    """Check the counts; return ``(evaluate, method, optimizer_kwargs, nbeta)``.

    ``nbeta`` defaults to :func:`default_nbeta` of a DataLoader. Shared by the
    one-process and the distributed estimators, so both read arguments alike.
    """
    positive_int("num_draws", num_draws)
    positive_int("num_chains", num_chains)
    positive_int("num_steps_bw_draws", num_steps_bw_draws)
    positive_int("grad_accum_steps", grad_accum_steps)
    nonnegative_int("num_burnin_steps", num_burnin_steps)
    kwargs = dict(optimizer_kwargs or {})
    if "nbeta" not in kwargs:
        if not isinstance(loader, DataLoader):
            raise ValueError(
                "`optimizer_kwargs` has no `nbeta` and `loader` is not a DataLoader to derive "
                "it from; pass optimizer_kwargs={'nbeta': default_nbeta(batch_size)}."
            )
        kwargs["nbeta"] = default_nbeta(loader, grad_accum_steps)
    resolved_evaluate = evaluate if evaluate is not None else evaluate_ce
    return resolved_evaluate, _resolve_method(sampling_method), kwargs, float(kwargs["nbeta"])


def _chain_jobs(
    model: torch.nn.Module,
    loader: Iterable[Any],
    evaluate: Evaluate,
    method: Callable[..., torch.optim.Optimizer],
    sampling_method: object,
    kwargs: dict[str, Any],
    *,
    chains: Iterable[int],
    seed: int,
    nbeta: float,
    num_chains: int,
    num_draws: int,
    num_burnin_steps: int,
    num_steps_bw_draws: int,
    grad_accum_steps: int,
    device: torch.device,
    store: str | os.PathLike[str] | None,
    verbose: bool,
    callbacks: Sequence[Callable[..., Any]],
    opening: Callable[[], AbstractContextManager[Any]] = nullcontext,
) -> tuple[list[_ChainJob], dict[int, np.ndarray]]:
    """The jobs of ``chains`` that ``store`` has not finished, and the loss traces of the rest.

    The store records the run's settings (with the sketch's fingerprint when sketching).

    ``opening()`` is the context the store is opened in (under ``torchrun``: rank 0 first,
    so that one process creates its arrays).
    """
    store_settings = None
    sketch_dim = kwargs.get("sketch_dim")
    store_obj = None
    if store is not None:
        fingerprint = None
        if sketch_dim is not None:
            probe = method(copy.deepcopy(model).parameters(), **kwargs)
            fingerprint = probe.sketch_fingerprint.to_json()  # type: ignore[attr-defined]
        settings = LLCRecordSettings(
            num_chains=num_chains,
            num_draws=num_draws,
            seed=seed,
            nbeta=nbeta,
            sampling_method=_method_name(sampling_method),
            optimizer_kwargs=kwargs,
            num_burnin_steps=num_burnin_steps,
            num_steps_bw_draws=num_steps_bw_draws,
            sketch_fingerprint=fingerprint,
            record_metrics=bool(kwargs.get("save_metrics", False)),
        )
        with opening():
            store_obj = open_draw_store(store, settings, sketch_dim=sketch_dim)
            # A finished chain whose draws are damaged is sampled again, never read as NaN.
            store_obj.repair()
        store_settings = settings.to_dict()

    jobs = []
    done: dict[int, np.ndarray] = {}
    for chain in chains:
        if store_obj is not None and store_obj.chain_done(chain):
            done[chain] = store_obj.chain_losses(chain)
            continue
        jobs.append(
            _ChainJob(
                chain=chain,
                seed=_chain_seed(seed, chain),
                model=model,
                loader=loader,
                evaluate=evaluate,
                sampling_method=method,
                optimizer_kwargs=kwargs,
                num_steps=num_burnin_steps + num_draws * num_steps_bw_draws,
                num_burnin_steps=num_burnin_steps,
                num_steps_bw_draws=num_steps_bw_draws,
                num_draws=num_draws,
                grad_accum_steps=grad_accum_steps,
                device=str(device),
                store_path=None if store is None else str(store),
                store_settings=store_settings,
                sketch_dim=sketch_dim,
                verbose=verbose,
                callbacks=callbacks,
            )
        )
    return jobs, done


def _summary(
    loss_trace: np.ndarray, init_loss: float, nbeta: float, online: bool
) -> dict[str, Any]:
    """The summary dict of the LLC estimators from a ``[chains, draws]`` loss trace."""
    num_chains, num_draws = loss_trace.shape
    llc_trace = nbeta * (loss_trace - init_loss)
    llc_per_chain = llc_trace.mean(axis=1)
    ess, rhat = _diagnostics(llc_trace)
    results: dict[str, Any] = {
        "llc/mean": float(llc_per_chain.mean()),
        "llc/std": float(llc_per_chain.std(ddof=1)) if num_chains > 1 else 0.0,
        **{f"llc-chain/{i}": float(v) for i, v in enumerate(llc_per_chain)},
        "loss/trace": loss_trace,
        "llc/ess": ess,
        "llc/rhat": rhat,
        "init_loss": float(init_loss),
        "nbeta": nbeta,
    }
    if online:
        running = np.cumsum(loss_trace, axis=1) / np.arange(1, num_draws + 1)
        online_trace = nbeta * (running - init_loss)
        results["llc/trace"] = online_trace
        results["llc/means"] = online_trace.mean(axis=0)
        results["llc/stds"] = (
            online_trace.std(axis=0, ddof=1) if num_chains > 1 else np.zeros(num_draws)
        )
    return results


def _finish(
    results: dict[str, Any],
    callbacks: Sequence[Callable[..., Any]],
    store: str | os.PathLike[str] | None,
) -> dict[str, Any]:
    """Merge the callbacks' ``get_results()`` and the store path into ``results``."""
    for callback in callbacks:
        get_results = getattr(callback, "get_results", None)
        if callable(get_results):
            results.update(get_results())
    if store is not None:
        results["store"] = str(Path(store))
    return results


def estimate_learning_coeff_with_summary(
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
    cores: int = 1,
    seed: int | None = None,
    device: str | torch.device = "cpu",
    callbacks: Sequence[Callable[..., Any]] = (),
    online: bool = False,
    verbose: bool = True,
    *,
    store: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """Estimate the local learning coefficient at ``model``'s weights, with a summary.

    Runs ``num_chains`` chains of ``num_burnin_steps + num_draws *
    num_steps_bw_draws`` sampler steps from copies of ``model``; draw ``t`` of
    chain ``c`` records the minibatch loss ``L_ct`` at the step's start.
    Then ``llc-chain/c = nbeta * (mean_t L_ct - L(w*))``.

    Args:
        model: The trained network (not modified; chains sample copies).
        loader: Iterable of batches; re-iterated as needed.
        evaluate: ``evaluate(model, batch)`` returning the loss or a tuple whose
            first element is the loss; default :func:`evaluate_ce` on ``(x, y)``.
        sampling_method: Sampler factory (``SGMCMC.sgld`` ...), class or name.
        optimizer_kwargs: Sampler keywords; ``nbeta`` defaults to
            :func:`default_nbeta` of ``loader``.
        num_draws: Draws per chain.
        num_chains: Chains.
        num_burnin_steps: Steps discarded before the first draw.
        num_steps_bw_draws: Steps between draws.
        init_loss: ``L(w*)``; default: mean over the first 8 batches.
        grad_accum_steps: Micro-batches per step.
        cores: Processes running chains in parallel (spawned; ``model``,
            ``loader``, ``evaluate`` and ``sampling_method`` must pickle),
            each on ``max(1, torch.get_num_threads() // cores)`` threads.
            Results equal ``cores=1`` for the same ``seed`` (bit for bit
            when ``cores=1`` runs on that many threads).
        seed: Chain ``c`` seeds its loader order and its own noise generator
            from ``(seed, c)``; chains never share a noise stream.
        device: Where chains run.
        callbacks: ``callback(chain=, draw=, loss=, model=, optimizer=)`` on each
            draw's step, after its update (``model`` holds the updated weights
            and the step's gradients; ``loss`` is the step's, from before the
            update); ``cores=1`` only; ``get_results()`` dicts are merged in.
        online: Also return per-draw running estimates.
        verbose: Show tqdm progress bars.
        store: Directory of a zarr store recording per-draw losses (and sketches
            / metrics when the sampler records them); a rerun with the same
            settings skips finished chains, other settings are refused.

    Returns:
        ``llc/mean``, ``llc/std``, ``llc-chain/{i}``, ``loss/trace``
        ``[chains, draws]``, ``llc/ess``, ``llc/rhat`` (ArviZ, on the per-draw
        LLC trace), ``init_loss``, ``nbeta``; when ``online``: ``llc/trace``
        ``[chains, draws]`` (running estimates), ``llc/means``, ``llc/stds``.

    Example:
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> data = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
        >>> out = estimate_learning_coeff_with_summary(
        ...     torch.nn.Linear(4, 2), DataLoader(data, batch_size=16), num_draws=5,
        ...     num_chains=2, seed=0, verbose=False,
        ...     optimizer_kwargs=dict(lr=1e-4, localization=100.0))
        >>> out["loss/trace"].shape
        (2, 5)
    """
    cores = check_cores(cores)
    if cores > 1 and callbacks:
        raise ValueError(
            f"`callbacks` run in the calling process and need `cores=1`, got cores={cores} with "
            f"{len(callbacks)} callbacks; drop them or use cores=1 (record with `store=` instead)."
        )
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
        seed = int(torch.randint(0, 2**31 - 1, ()).item())
    torch_device = torch.device(device)

    if init_loss is None:
        init_loss = _initial_loss(
            copy.deepcopy(model).to(torch_device).eval(), loader, evaluate, torch_device, seed
        )

    jobs, traces = _chain_jobs(
        model,
        loader,
        evaluate,
        method,
        sampling_method,
        kwargs,
        chains=range(num_chains),
        seed=seed,
        nbeta=nbeta,
        num_chains=num_chains,
        num_draws=num_draws,
        num_burnin_steps=num_burnin_steps,
        num_steps_bw_draws=num_steps_bw_draws,
        grad_accum_steps=grad_accum_steps,
        device=torch_device,
        store=store,
        verbose=verbose and cores == 1,
        callbacks=callbacks,
    )
    progress = tqdm(total=len(jobs), desc="LLC chains", disable=not verbose)
    # cores > 1: spawned workers on torch.get_num_threads() // cores threads each.
    for chain, losses in run_jobs(_run_chain, jobs, cores=cores, shared=None):
        traces[chain] = losses
        progress.update()
    progress.close()

    results = _summary(np.stack([traces[c] for c in range(num_chains)]), init_loss, nbeta, online)
    # A diverged chain (loss blown up, LLC far outside [0, d/2]) warns with the step to try.
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    lr = kwargs.get("lr")
    lr = float(lr) if isinstance(lr, (int, float)) else None
    warn_if_diverged(
        results["loss/trace"], init_loss, nbeta=nbeta, numel=numel, lr=lr,
        lr_name="optimizer_kwargs['lr']", stacklevel=2,
    )  # fmt: skip
    return _finish(results, callbacks, store)


def _llc_mean(summary: Callable[_P, dict[str, Any]]) -> Callable[_P, float]:
    """``summary``'s ``llc/mean`` as a float, taking ``summary``'s own parameters."""

    @functools.wraps(summary)
    def mean(*args: _P.args, **kwargs: _P.kwargs) -> float:
        return float(summary(*args, **kwargs)["llc/mean"])

    mean.__signature__ = inspect.signature(summary).replace(  # type: ignore[attr-defined]
        return_annotation="float"
    )
    return mean


estimate_learning_coeff = _llc_mean(estimate_learning_coeff_with_summary)
estimate_learning_coeff.__name__ = estimate_learning_coeff.__qualname__ = "estimate_learning_coeff"
estimate_learning_coeff.__doc__ = """``llc/mean`` of :func:`estimate_learning_coeff_with_summary`.

Takes the same arguments (devinterp's ``estimate_learning_coeff``, plus
``online`` and ``store``, which change what is recorded, not the mean).

Example:
    >>> import torch
    >>> from torch.utils.data import DataLoader, TensorDataset
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <...>
    >>> model = torch.nn.Linear(3, 1)
    >>> data = TensorDataset(torch.randn(32, 3), torch.randn(32, 1))
    >>> llc = estimate_learning_coeff(
    ...     model, DataLoader(data, batch_size=8),
    ...     evaluate=lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
    ...     optimizer_kwargs={"lr": 1e-4, "nbeta": 4.0, "localization": 100.0},
    ...     num_draws=5, num_chains=1, verbose=False)
    >>> isinstance(llc, float)
    True
"""
