"""Estimates from sample stores: LLC, Bayesian influence functions, susceptibilities.

Each ``compute_*`` reads a DataTree written by :func:`~gradsketch.slt.sample`
(or by devinterp 2.0's ``sample``) and returns devinterp's output format;
``llc``, ``bif`` and ``susceptibilities`` sample first.

* LLC (Lau et al. 2023): ``nbeta * (mean over steps and tokens of
  sampling_loss_micro - mean init_loss)``, per chain and pooled.
* BIF (Kreer et al. 2025, "Bayesian Influence Functions"): the posterior
  correlation (or covariance) across draws between the losses of two
  sequences (``"sequence"``) or of every pair of their tokens (``"token"``),
  draws of all chains stacked, or chains averaged first.
* Susceptibilities (Baker et al. 2025, https://arxiv.org/abs/2504.18274,
  appendix C.4): ``chi = E[phi L_wr] - E[phi L_probe] - E[phi] (E_full[L_wr] -
  E_full[L_probe])`` with ``phi`` the per-draw sampling loss minus
  ``init_loss``, for every weight restriction but ``"full"``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from gradsketch.errors import StoreIntegrityError
from gradsketch.sampling import warn_if_diverged
from gradsketch.slt._cache import SamplingCache
from gradsketch.slt._data import LossFn, check_causal_lm, obs_id
from gradsketch.slt._sample import sample
from gradsketch.slt._schema import NUMEL_ATTR

__all__ = [
    "FewChainsWarning",
    "MIN_CHAINS_FOR_SEM",
    "bif",
    "compute_bif",
    "compute_llc",
    "compute_susceptibilities",
    "llc",
    "susceptibilities",
]

#: Bytes of one block of token-level products on CPU (it stays in cache while copied out).
BIF_BLOCK_BYTES = 1 << 24

CorrelationMethod = Literal["token", "sequence"]
ChainReduction = Literal["stack", "mean"]


def _xr() -> Any:
    try:
        import xarray as xr
    except ImportError as exc:  # pragma: no cover - xarray is in the hf extra
        raise ImportError(
            "gradsketch.slt needs xarray; install the hf extra: pip install 'gradsketch[hf]'."
        ) from exc
    return xr


def _dataset(samples: Any) -> Any:
    ds = getattr(samples, "dataset", samples)
    if "init_loss" not in ds.data_vars:
        raise ValueError(
            "`samples` is not a sample store (no `init_loss` variable); pass the DataTree "
            "returned by gradsketch.slt.sample (or devinterp's sample)."
        )
    return ds


def _read(ds: Any, name: str) -> Any:
    """``ds[name].values``, or an error naming the variable where a chunk fails to decode."""
    try:
        return ds[name].values
    except (ValueError, RuntimeError, OSError) as exc:
        raise StoreIntegrityError(
            f"`{name}` of the sample store cannot be read ({exc}): a chunk file is damaged "
            "(bit-flipped or truncated), so no estimate is computed from it. Fix: rerun "
            "`sample` (or `llc`) with the same arguments and output_path: it names the array, "
            "chunk and file, and samples the chain again."
        ) from exc


#: Chains below which :func:`compute_llc` warns :class:`FewChainsWarning`.
MIN_CHAINS_FOR_SEM = 4


class FewChainsWarning(UserWarning):
    """An LLC's standard error across chains rests on fewer than 4 chains.

    The standard error of a mean over ``c`` chains is itself estimated from
    ``c - 1`` degrees of freedom: with 2 chains a z-score between two runs of
    the same process lands beyond 4 between 1 time in 18 and 1 time in 6
    (Student's t with 1 to 2 degrees of freedom; the normal's 1 in 16,000 does
    not apply), so differences cannot be told from chain noise.
    """


def compute_llc(samples: Any) -> Any:
    """The local learning coefficient of a sample store, per chain and pooled.

    ``llc_per_chain[c] = n_beta * (mean_{step, batch, token} sampling_loss_micro[c]
    - mean init_loss)`` over every step (burn-in included, as devinterp).

    Args:
        samples: The DataTree from :func:`~gradsketch.slt.sample`.

    Returns:
        ``xarray.Dataset`` with devinterp's variables and dtypes: ``llc_mean``,
        ``llc_std`` (ddof 0, as devinterp), ``llc_per_chain`` ``[chain]``
        (float32), ``llc_scalar`` (float64), ``loss_trace`` ``[chain, step]``
        (the store's float32), ``init_loss`` (float64); and ``llc_sem``
        (float32), the standard error of ``llc_mean`` across chains
        (``std(ddof=1) / sqrt(chains)``, NaN for one chain). Every value is
        computed in float64 and rounded once to its dtype (devinterp sums the
        float32 losses in float32).

    A chain whose loss grows by orders of magnitude, or an LLC far outside
    ``[0, d/2]`` (``d`` the sampled weights), warns
    :class:`~gradsketch.sampling._divergence.ChainDivergenceWarning` with the
    step size to try; fewer than 4 chains warn :class:`FewChainsWarning`
    (``llc_sem`` is then too uncertain to compare estimates with).

    Example:
        >>> import xarray as xr
        >>> ds = xr.Dataset({
        ...     "init_loss": (("chain", "token_pos"), np.ones((4, 3), np.float32)),
        ...     "sampling_loss_micro": (("chain", "step", "batch_sampling", "token_pos"),
        ...                             np.full((4, 4, 1, 3), 1.5, np.float32))},
        ...     attrs={"metadata": {"config": {"sampler": {"n_beta": 10.0}}}})
        >>> float(compute_llc(ds).llc_mean)
        5.0
    """
    xr = _xr()
    ds = _dataset(samples)
    n_beta = float(ds.attrs["metadata"]["config"]["sampler"]["n_beta"])
    init = np.asarray(_read(ds, "init_loss"), dtype=np.float64)
    if not np.isfinite(init).all():
        # L(w*) is refused when not finite before it is stored: a NaN is a missing chunk.
        chains = sorted(set(np.flatnonzero(~np.isfinite(init).all(axis=-1)).tolist()))
        raise StoreIntegrityError(
            f"`init_loss` of the sample store is missing for chains {chains} (a deleted chunk "
            "reads as NaN), so no LLC is computed from it. Fix: rerun `sample` (or `llc`) with "
            "the same arguments and output_path: it names the chunk and samples those chains "
            "again."
        )
    init_mean = float(init.mean())
    micro = np.asarray(_read(ds, "sampling_loss_micro"))
    trace = micro.astype(np.float64).mean(axis=(2, 3))  # [chain, step]
    per_chain = n_beta * (trace.mean(axis=1) - init_mean)
    # A diverged chain (or an LLC far outside [0, d/2]) warns with the step size to try.
    numel = ds.attrs.get(NUMEL_ATTR, ds.attrs.get("metrics_numel"))
    lr = ds.attrs["metadata"]["config"]["sampler"].get("lr")
    warn_if_diverged(
        trace,
        init_mean,
        nbeta=n_beta,
        numel=int(numel) if isinstance(numel, (int, float)) else None,
        lr=float(lr) if isinstance(lr, (int, float)) else None,
        stacklevel=2,
    )
    chains = per_chain.shape[0]
    sem = float(per_chain.std(ddof=1) / np.sqrt(chains)) if chains > 1 else float("nan")
    if chains < MIN_CHAINS_FOR_SEM:
        warnings.warn(
            f"llc_sem rests on {chains} chain{'s' if chains > 1 else ''} (num_chains={chains}): "
            f"with fewer than {MIN_CHAINS_FOR_SEM} chains the standard error of llc_mean is "
            "itself too uncertain to compare estimates with (two chains of one process have "
            "given z = -4.5); sample with num_chains >= 4, and 8 or more to compare runs or "
            "libraries.",
            FewChainsWarning,
            stacklevel=2,
        )
    trace_da = xr.DataArray(trace.astype(micro.dtype), dims=("chain", "step"))
    return xr.Dataset(
        {
            "llc_mean": np.float32(per_chain.mean()),
            "llc_std": np.float32(per_chain.std()),
            "llc_per_chain": xr.DataArray(per_chain.astype(np.float32), dims=("chain",)),
            "llc_scalar": n_beta * (float(micro.astype(np.float64).mean()) - init_mean),
            "llc_sem": np.float32(sem),
            "loss_trace": trace_da,
            "init_loss": init_mean,
        }
    )


def _observable_ids(ds: Any) -> list[str]:
    return sorted(
        str(v)[len("loss_") :]
        for v in ds.data_vars
        if str(v).startswith("loss_") and str(v) != "sampling_loss"
    )


def _resolve_keys(ds: Any, loss_keys: Literal["all"] | Sequence[str]) -> list[str]:
    found = _observable_ids(ds)
    if loss_keys == "all":
        return found
    keys = list(loss_keys)
    missing = [k for k in keys if k not in found]
    if missing:
        raise KeyError(f"`loss_keys` {missing} are not in the samples; they hold {found}.")
    return keys


def _stacked_losses(ds: Any, keys: list[str]) -> np.ndarray:
    """``[chain, draw, batch, token_pos]`` of the observables, concatenated along batch."""
    return np.concatenate([np.asarray(ds[f"loss_{k}"].values) for k in keys], axis=2)


def _stacked_ids(ds: Any, keys: list[str]) -> np.ndarray:
    parts = []
    for k in keys:
        ids = np.asarray(ds[f"input_ids_{k}"].values)
        while ids.ndim > 2:
            ids = ids[0]
        parts.append(ids)
    return np.concatenate(parts, axis=0)


def _standardize(x: torch.Tensor, covariance: bool) -> torch.Tensor:
    """Centre series along the last axis; scale them to unit norm for correlations.

    Then ``a @ b.T`` is the covariance (``ddof=1``) or the correlation.
    """
    centred = x - x.mean(dim=-1, keepdim=True)
    if covariance:
        return centred / math.sqrt(x.shape[-1] - 1)
    return centred / centred.norm(dim=-1, keepdim=True)


def compute_bif(
    samples: Any,
    *,
    correlation_method: CorrelationMethod = "token",
    reduce_chain_dimension_method: ChainReduction = "stack",
    loss_keys: Literal["all"] | Sequence[str] = "all",
    batch_index_range_1: Literal["all"] | Sequence[int] = "all",
    batch_index_range_2: Literal["all"] | Sequence[int] = "all",
    average_tokenwise_bif: bool = False,
    compute_covariance: bool = False,
    batch_size: int = 32,
    device: str | torch.device | None = None,
) -> Any:
    """Bayesian influence: posterior correlations between sequences' (or tokens') losses.

    Observations are the draws, with chains stacked (``[chain * draw]``) or
    averaged first (``[draw]``). ``"sequence"``: each sequence's loss is its
    tokens' mean; ``influences[i, j] = corr(L_i, L_j)``. ``"token"``:
    ``influences[i, j, t, s] = corr(L_i,t, L_j,s)`` (``t``, ``s`` from 1, as
    devinterp). All pairs come from one matrix product of series
    standardized in float64, blockwise over at most ``batch_size`` sequences
    of the first operand. Token-level products run in float32 (the result's
    type): a dot product of ``n`` terms rounded to float32 is within
    ``(n + 2) * 2^-24 * |z_i| |z_j|`` of the exact one (``|z|`` is 1 for correlations, the
    series' standard deviation for covariances): 1.2e-5 for a correlation of
    ``n = 200`` draws, whose sampling error is about ``1 / sqrt(n)``.

    Args:
        samples: The DataTree from :func:`~gradsketch.slt.sample`.
        correlation_method: ``"token"`` or ``"sequence"``.
        reduce_chain_dimension_method: ``"stack"`` or ``"mean"``.
        loss_keys: Observables to use (``"all"``: every ``loss_*``).
        batch_index_range_1: Sequences (of the concatenated observables) of
            the first operand.
        batch_index_range_2: Sequences of the second operand.
        average_tokenwise_bif: Average the token pairs into ``[n1, n2]``.
        compute_covariance: Covariance (``ddof=1``) instead of correlation.
        batch_size: Sequences of the first operand per block.
        device: Torch device of the products (default CUDA when available).

    Returns:
        ``xarray.Dataset`` with ``influences`` (``[batch_1, batch_2]`` or
        ``[batch_1, batch_2, target_position, target_position_T]``, float32)
        and ``input_ids`` ``[batch, position]``.
    """
    xr = _xr()
    if correlation_method not in ("token", "sequence"):
        raise ValueError(
            f"`correlation_method` must be 'token' or 'sequence', got {correlation_method!r}."
        )
    if reduce_chain_dimension_method not in ("stack", "mean"):
        raise ValueError(
            "`reduce_chain_dimension_method` must be 'stack' or 'mean', got "
            f"{reduce_chain_dimension_method!r}."
        )
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"`batch_size` must be a positive int, got {batch_size!r}.")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    ds = _dataset(samples)
    keys = _resolve_keys(ds, loss_keys)
    if not keys:
        raise ValueError(
            "`samples` hold no observable (no loss_* variable) to correlate; sample with "
            "observables evaluated (evaluate_observables=True, the default)."
        )
    losses = _stacked_losses(ds, keys).astype(np.float64)  # [chain, draw, batch, tok]
    if correlation_method == "sequence":
        losses = losses.mean(axis=3, keepdims=True)
    if reduce_chain_dimension_method == "stack":
        obs = losses.reshape(-1, *losses.shape[2:])  # [chain*draw, batch, tok]
    else:
        obs = losses.mean(axis=0)
    series = torch.as_tensor(np.moveaxis(obs, 0, -1), device=device)  # [batch, tok, n_obs]
    n_batch, n_tok = series.shape[:2]
    rows_1 = np.arange(n_batch) if batch_index_range_1 == "all" else np.asarray(batch_index_range_1)
    rows_2 = np.arange(n_batch) if batch_index_range_2 == "all" else np.asarray(batch_index_range_2)
    z = _standardize(series, compute_covariance)
    z2 = z[torch.as_tensor(rows_2, device=z.device)].reshape(-1, z.shape[-1])
    if correlation_method == "sequence":
        block = z[torch.as_tensor(rows_1, device=z.device)].reshape(-1, z.shape[-1]) @ z2.T
        influences = block.float().cpu().numpy()
        dims: list[str] = ["batch_1", "batch_2"]
        coords: dict[str, np.ndarray] = {"batch_1": rows_1, "batch_2": rows_2}
    else:
        shape: tuple[int, ...] = (
            (len(rows_1), len(rows_2))
            if average_tokenwise_bif
            else (len(rows_1), len(rows_2), n_tok, n_tok)
        )
        influences = np.empty(shape, dtype=np.float32)
        target = torch.from_numpy(influences)
        z = z.float()
        z2 = z2.float()
        step = batch_size
        if z.device.type == "cpu":  # products of cache size, not batch_size's
            step = min(step, max(1, BIF_BLOCK_BYTES // (4 * n_tok * z2.shape[0])))
        for start in range(0, len(rows_1), step):
            part = torch.as_tensor(rows_1[start : start + step], device=z.device)
            z1 = z[part].reshape(-1, z.shape[-1])
            prod = (z1 @ z2.T).view(len(part), n_tok, len(rows_2), n_tok).permute(0, 2, 1, 3)
            if average_tokenwise_bif:
                prod = prod.mean(dim=(-1, -2))
            # One pass on torch's threads: to float32, permuted, to host (numpy's
            # strided copy of the same was most of this function's time).
            target[start : start + len(part)].copy_(prod)
        dims = ["batch_1", "batch_2"]
        coords = {"batch_1": rows_1, "batch_2": rows_2}
        if not average_tokenwise_bif:
            dims += ["target_position", "target_position_T"]
            coords["target_position"] = np.arange(1, n_tok + 1)
            coords["target_position_T"] = np.arange(1, n_tok + 1)
    out = xr.DataArray(influences, name="influences", dims=dims, coords=coords).to_dataset()
    out["input_ids"] = xr.DataArray(_stacked_ids(ds, keys), dims=("batch", "position"))
    return out


def compute_susceptibilities(
    wr_map: Mapping[str, Any],
    sampling_task: str,
    observable_names: list[str] | None = None,
    include_sampling_task: bool = False,
) -> Any:
    """Per-token susceptibilities of every probe observable to every weight restriction.

    For restriction ``wr`` (all but ``"full"``), probe ``o``, sequence ``b``
    and position ``t``, with ``pt[c, d]`` the mean sampling-task loss of draw
    ``d`` of chain ``c`` and ``phi = pt - mean(init_loss of full)``::

        chi[b, t] = E[phi pt] - E[phi L_o[b, t]] - E[phi] (E_full[pt] - E_full[L_o[b, t]])

    Args:
        wr_map: ``{restriction name: DataTree}``, with a ``"full"`` entry.
        sampling_task: The observable holding the sampling data.
        observable_names: Probes (default: every observable except the
            sampling task unless ``include_sampling_task``).
        include_sampling_task: Also a probe when ``observable_names`` is None.

    Returns:
        ``xarray.DataTree`` in devinterp's format: ``/susceptibilities`` with
        ``sus`` ``[sus_flat, wr]`` (float32, as devinterp's; computed in
        float64 and rounded once) and ``/context`` with ``input_ids``
        ``[ctx_flat]``, each with ``dataset_id``/``batch``/position coordinates.
    """
    xr = _xr()
    if "full" not in wr_map:
        raise ValueError(
            f"`wr_map` must have a 'full' entry (the unrestricted samples); it has {list(wr_map)}."
        )
    full = _dataset(wr_map["full"])
    task = obs_id(sampling_task)
    found = _observable_ids(full)
    if task not in found:
        raise ValueError(
            f"`sampling_task`={sampling_task!r} is not an observable of the samples; they hold "
            f"{found}."
        )
    if observable_names is None:
        probes = found if include_sampling_task else [o for o in found if o != task]
    else:
        probes = [obs_id(n) for n in observable_names]
        missing = [p for p in probes if p not in found]
        if missing:
            raise ValueError(f"`observable_names` {missing} are not in the samples ({found}).")
    if not probes:
        raise ValueError(
            f"no probe observable: the samples hold {found} and the sampling task is {task!r}; "
            "add an observable besides the sampling task or pass include_sampling_task=True."
        )
    full_task_mean = float(np.asarray(full[f"loss_{task}"].values, dtype=np.float64).mean())
    init_mean = float(np.asarray(full["init_loss"].values, dtype=np.float64).mean())
    full_delta = {
        p: full_task_mean - np.asarray(full[f"loss_{p}"].values, dtype=np.float64).mean(axis=(0, 1))
        for p in probes
    }
    names = [w for w in wr_map if w != "full"]
    if not names:
        raise ValueError("`wr_map` has only 'full'; add at least one weight restriction.")
    sus: dict[str, dict[str, np.ndarray]] = {w: {} for w in names}
    ids: dict[str, np.ndarray] = {}
    for w in names:
        ds = _dataset(wr_map[w])
        pt = np.asarray(ds[f"loss_{task}"].values, dtype=np.float64).mean(axis=(2, 3))
        phi = pt - init_mean
        e_phi = float(phi.mean())
        e_phi_pt = float((phi * pt).mean())
        for p in probes:
            probe = np.asarray(ds[f"loss_{p}"].values, dtype=np.float64)
            e_phi_probe = np.einsum("cd,cdbt->bt", phi, probe) / (phi.size)
            sus[w][p] = e_phi_pt - e_phi_probe - e_phi * full_delta[p]
            probe_ids = np.asarray(ds[f"input_ids_{p}"].values)
            while probe_ids.ndim > 2:
                probe_ids = probe_ids[0]
            if p in ids and not np.array_equal(ids[p], probe_ids):
                raise ValueError(
                    f"the samples of {names[0]!r} and {w!r} hold different sequences for "
                    f"observable {p!r}; sample every restriction with the same observables and "
                    "obs_seed."
                )
            ids[p] = probe_ids
    order = sorted(probes)

    def flat_coords(arrays: dict[str, np.ndarray], dims: tuple[str, str], first: int) -> Any:
        cols: dict[str, list[np.ndarray]] = {"dataset_id": [], dims[0]: [], dims[1]: []}
        for i, p in enumerate(order):
            a = arrays[p]
            grid_b, grid_t = np.meshgrid(
                np.arange(a.shape[0]), np.arange(first, first + a.shape[1]), indexing="ij"
            )
            cols["dataset_id"].append(np.full(a.size, i))
            cols[dims[0]].append(grid_b.ravel())
            cols[dims[1]].append(grid_t.ravel())
        return {k: np.concatenate(v) for k, v in cols.items()}

    sus_flat = np.concatenate(
        [np.stack([sus[w][p].ravel() for w in names], axis=-1) for p in order], axis=0
    ).astype(np.float32)
    sus_coords = flat_coords({p: sus[names[0]][p] for p in order}, ("batch", "target_position"), 1)
    ids_coords = flat_coords(ids, ("batch", "position"), 0)
    ids_flat = np.concatenate([ids[p].ravel() for p in order])
    sus_ds = xr.Dataset(
        {"sus": xr.DataArray(sus_flat, dims=("sus_flat", "wr"))},
        coords=xr.Coordinates(
            {k: ("sus_flat", v) for k, v in sus_coords.items()}, indexes={}
        ).merge(xr.Coordinates({"wr": names})),
        attrs={"dataset_id_to_name": order},
    )
    ctx_ds = xr.Dataset(
        {"input_ids": xr.DataArray(ids_flat, dims=("ctx_flat",))},
        coords=xr.Coordinates({k: ("ctx_flat", v) for k, v in ids_coords.items()}, indexes={}),
        attrs={"dataset_id_to_name": order},
    )
    return xr.DataTree.from_dict({"/susceptibilities": sus_ds, "/context": ctx_ds})


def _needs_observables(name: str, kwargs: Mapping[str, Any]) -> None:
    """Refuse ``evaluate_observables=False`` for an estimate read from the observables."""
    if kwargs.get("evaluate_observables", True) is not True:
        raise ValueError(
            f"`{name}` is computed from the observables' losses, so they must be evaluated; "
            f"got evaluate_observables={kwargs['evaluate_observables']!r}: drop the argument."
        )


def _given(
    lr: float | str, n_beta: float, param_masks: Any, loss_fn: LossFn | None, cores: int
) -> dict[str, Any]:
    """The keywords of :func:`sample` that :func:`llc`, :func:`bif` and susceptibilities name."""
    return {
        "lr": lr,
        "n_beta": n_beta,
        "param_masks": param_masks,
        "loss_fn": loss_fn,
        "cores": cores,
    }


def llc(
    model: nn.Module,
    dataset: Any,
    observables: Mapping[str, Any],
    *,
    lr: float | str,
    n_beta: float,
    param_masks: Any = None,
    loss_fn: LossFn | None = None,
    cores: int = 1,
    **kwargs: Any,
) -> Any:
    """Sample (:func:`~gradsketch.slt.sample`, same keywords) and return :func:`compute_llc`.

    ``cores > 1`` samples that many chains at once
    (:func:`~gradsketch.slt.sample`'s ``cores``). The estimate reads only
    the sampling losses, so without an ``output_path`` that keeps the store
    the observables are not evaluated (``sample``'s
    ``evaluate_observables=False``): the chains, and so the estimate, are
    the same, in about half the time on a small language model. Pass
    ``evaluate_observables=True`` to evaluate them all the same.
    """
    kwargs.setdefault("evaluate_observables", kwargs.get("output_path") is not None)
    given = _given(lr, n_beta, param_masks, loss_fn, cores)
    samples = sample(model, dataset, observables, **given, **kwargs)
    return compute_llc(samples)


def bif(
    model: nn.Module,
    dataset: Any,
    observables: Mapping[str, Any],
    *,
    lr: float | str,
    n_beta: float,
    param_masks: Any = None,
    correlation_method: CorrelationMethod = "token",
    reduce_chain_dimension_method: ChainReduction = "stack",
    average_tokenwise_bif: bool = False,
    compute_covariance: bool = False,
    bif_batch_size: int = 32,
    bif_device: str | torch.device | None = None,
    loss_fn: LossFn | None = None,
    cores: int = 1,
    **kwargs: Any,
) -> Any:
    """Sample (:func:`~gradsketch.slt.sample`, same keywords) and return :func:`compute_bif`.

    ``cores > 1`` samples that many chains at once
    (:func:`~gradsketch.slt.sample`'s ``cores``).
    """
    _needs_observables("bif", kwargs)
    given = _given(lr, n_beta, param_masks, loss_fn, cores)
    samples = sample(model, dataset, observables, **given, **kwargs)
    return compute_bif(
        samples,
        correlation_method=correlation_method,
        reduce_chain_dimension_method=reduce_chain_dimension_method,
        average_tokenwise_bif=average_tokenwise_bif,
        compute_covariance=compute_covariance,
        batch_size=bif_batch_size,
        device=bif_device,
    )


def susceptibilities(
    model: nn.Module,
    dataset: Any,
    observables: Mapping[str, Any],
    weight_restrictions: Mapping[str, Any],
    *,
    sampling_task: str,
    lr: float | str,
    n_beta: float,
    loss_fn: LossFn | None = None,
    include_sampling_task: bool = False,
    cores: int = 1,
    **kwargs: Any,
) -> Any:
    """Sample every weight restriction and return :func:`compute_susceptibilities`.

    ``weight_restrictions`` maps names to masks (None: every weight) and
    must include ``"full"``. With ``output_path="x/s.zarr"`` restriction
    ``w`` is stored at ``x/s_w.zarr``. ``cores > 1`` samples that many
    chains of each restriction at once (:func:`~gradsketch.slt.sample`'s
    ``cores``). ``progress`` (see :func:`~gradsketch.slt.sample`) also shows
    a bar over the restrictions. Every restriction's run shares one
    :class:`~gradsketch.slt.SamplingCache` (``cache=``, default a fresh
    one): L(w*) and ``lr="auto"``'s step, which ignore the restriction, are
    computed once.
    """
    if loss_fn is None:
        check_causal_lm(model)  # before any restriction is built or sampled
    if "full" not in weight_restrictions:
        raise ValueError(
            "`weight_restrictions` must include 'full' (None: the unrestricted model), got "
            f"{list(weight_restrictions)}."
        )
    if sampling_task not in observables:
        raise ValueError(
            f"`sampling_task`={sampling_task!r} is not in `observables` ({list(observables)})."
        )
    if not include_sampling_task and len(observables) < 2:
        raise ValueError(
            "`observables` needs a probe besides the sampling task (or pass "
            "include_sampling_task=True)."
        )
    _needs_observables("susceptibilities", kwargs)
    base = kwargs.pop("output_path", None)
    progress = kwargs.get("progress")
    # One for this call's restrictions, never left over from an earlier call.
    if kwargs.get("cache") is None:
        kwargs["cache"] = SamplingCache()
    wr_map: dict[str, Any] = {}
    for name, masks in tqdm(
        weight_restrictions.items(),
        desc="restrictions",
        total=len(weight_restrictions),
        unit="restriction",
        disable=None if progress is None else not progress,
    ):
        extra = dict(kwargs)
        if base is not None:
            b = Path(str(base))
            extra["output_path"] = b.parent / f"{b.stem}_{name}{b.suffix}"
        given = _given(lr, n_beta, masks, loss_fn, cores)
        wr_map[name] = sample(model, dataset, observables, **given, **extra)
    return compute_susceptibilities(
        wr_map, sampling_task, include_sampling_task=include_sampling_task
    )
