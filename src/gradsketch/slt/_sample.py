"""``sample``: SGMCMC chains on a language model, per-token losses of observables in zarr.

The store has devinterp 2.0's layout (:mod:`gradsketch.slt._schema`: variable
names, dimensions and root ``metadata``), so code that reads
``devinterp.slt.sample``'s output reads this one's; devinterp 2.0's other
parts live beside it: the settings (:mod:`gradsketch.slt._config`), the
writer with its lock and resume (:mod:`gradsketch.slt._writing`) and the
run itself (:mod:`gradsketch.slt._run`).

The chains run on :class:`gradsketch.sampling.SGMCMC` (every preconditioner,
masks, metrics, sketches), each on a working copy of the model
(:mod:`gradsketch.slt._fast`); :mod:`gradsketch.slt._run` says what differs
from devinterp without changing an estimate, and how ``cores > 1`` runs
chains at once.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import zarr
from torch import nn
from tqdm.auto import tqdm

from gradsketch import _hash
from gradsketch._processes import check_cores
from gradsketch.errors import OutputPathMismatchError
from gradsketch.masked import ParamMask
from gradsketch.slt._cache import SamplingCache
from gradsketch.slt._config import SamplerSettings
from gradsketch.slt._data import (
    LossFn,
    Observable,
    as_token_tensor,
    check_causal_lm,
    check_finite_weights,
    check_token_range,
    per_token_loss,
    token_digest,
    vocab_size,
)
from gradsketch.slt._fast import FAST_PATHS, fast_kernels
from gradsketch.slt._restrictions import to_param_mask
from gradsketch.slt._run import SampleRun, hidden
from gradsketch.slt._schema import FORMAT, SETTINGS_ATTR, layout_names, open_tree
from gradsketch.slt._store_checks import check_samples
from gradsketch.slt._writing import check_existing, store_lock

__all__ = ["OutputPathMismatchError", "UnsavedSamplesWarning", "sample"]

logger = logging.getLogger(__name__)


class UnsavedSamplesWarning(UserWarning):
    """A large run writes to a temporary directory (pass ``output_path`` to keep it)."""


def _model_digest(model: nn.Module) -> str:
    """A digest of the parameters' and buffers' names, shapes and values."""
    return _hash.model_digest(model)


def sample(
    model: nn.Module,
    dataset: Any,
    observables: Mapping[str, Any],
    *,
    lr: float | str,
    n_beta: float,
    param_masks: ParamMask | Mapping[str, torch.Tensor | None] | None = None,
    num_chains: int = 4,
    num_draws: int = 200,
    batch_size: int = 32,
    num_burnin_steps: int = 0,
    num_steps_bw_draws: int = 1,
    num_init_loss_batches: int = 32,
    init_seed: int = 100,
    batches_per_draw: int = 3,
    obs_seed: int = 1337,
    gradient_accumulation_steps: int = 1,
    localization: float = 0.0,
    noise_level: float = 1.0,
    llc_weight_decay: float = 0.0,
    bounding_box_size: float | None = None,
    sampling_method: str = "sgmcmc_sgld",
    sampling_method_kwargs: dict[str, Any] | None = None,
    rmsprop_eps: float | None = None,
    rmsprop_alpha: float | None = None,
    shuffle: bool = True,
    match_sampling_input_ids_across_chains: bool = True,
    init_noise: float | None = None,
    device: str | torch.device | None = None,
    save_metrics: bool = False,
    output_path: str | Path | None = None,
    loss_fn: LossFn | None = None,
    sketch_dim: int | None = None,
    cores: int = 1,
    progress: bool | None = None,
    fast_path: str = "auto",
    cache: SamplingCache | None = None,
    evaluate_observables: bool = True,
) -> Any:
    """Run SGMCMC chains from ``model``'s weights; record per-token losses of every observable.

    Call-compatible with ``devinterp.slt.sampling.sample`` (2.0.1): same
    arguments, same store layout (see the module docstring). The model runs
    in train mode, as in devinterp; chain ``c`` draws its dropout masks and
    initial noise from a generator seeded ``init_seed + c`` (as devinterp
    seeds torch's global generator, which is seeded so too, for models that
    draw from it) and its SGLD noise from a second one; with
    ``match_sampling_input_ids_across_chains`` every chain sees the batches
    of devinterp's DataLoader seeded with ``init_seed``.

    A completed ``output_path`` made with the same settings (model, datasets,
    masks and sampler) is returned as it is, also one written by devinterp;
    one made with other settings is refused, showing both values of every
    difference; an interrupted one resumes at its first unfinished chain.

    Args:
        model: The trained language model (not modified).
        dataset: Sampling data: a ``datasets.Dataset`` with ``input_ids``, a
            ``[n, seq]`` token tensor, or rows ``{"input_ids": ...}``.
        observables: ``{name: data}`` or ``{name: (data, batches_per_draw)}``;
            ``batch_size * batches_per_draw`` fixed sequences each.
        lr: Step size ``eps``, or ``"auto"``: the step of
            :func:`gradsketch.sampling.calibrated_lr` (SGLD pilots from the
            model's weights aiming at a 2.5 % discretization bias of the
            LLC, on the full model, rounded to two significant digits; a
            store at ``output_path`` already made with ``"auto"`` keeps its
            step). The resolved number is what the store records.
        n_beta: Inverse temperature times sample size.
        param_masks: Which weights move: None (all), a ParamMask from
            :func:`~gradsketch.slt.create_param_masks`, or devinterp's dict
            ``{name: bool mask or None}`` (unlisted parameters are frozen).
        num_chains: Chains.
        num_draws: Draws per chain.
        batch_size: Sequences per (micro-)batch and per observable batch.
        num_burnin_steps: Steps before the first draw.
        num_steps_bw_draws: Steps between draws.
        num_init_loss_batches: Batches (times ``gradient_accumulation_steps``)
            averaged for ``init_loss``.
        init_seed: Seed of chains, batches and initial noise.
        batches_per_draw: Default batches of an observable given without one.
        obs_seed: Seed of the observables' fixed sequences.
        gradient_accumulation_steps: Micro-batches per step.
        localization: ``gamma``, the pull towards the initial weights.
        noise_level: Noise standard deviation (1 samples the posterior).
        llc_weight_decay: ``lambda``, a Gaussian prior centred at zero.
        bounding_box_size: Clamp to ``w0 +- b`` when set.
        sampling_method: A name in :data:`SAMPLING_METHODS`.
        sampling_method_kwargs: Extra keywords of the sampler factory.
        rmsprop_eps: Shorthand for ``sampling_method_kwargs["eps"]`` (rmsprop only).
        rmsprop_alpha: Shorthand for ``sampling_method_kwargs["alpha"]`` (rmsprop only).
        shuffle: Shuffle the sampling data.
        match_sampling_input_ids_across_chains: Every chain sees the same batches.
        init_noise: Gaussian noise of this std added to the restricted weights first.
        device: Where chains run; default CUDA when available.
        save_metrics: Record the sampler's per-step norms and dot products.
        output_path: Directory of the zarr store; default a temporary one.
        loss_fn: ``(model, input_ids) -> [batch, seq - 1]`` per-token loss;
            default next-token cross-entropy.
        sketch_dim: Also record count sketches of size ``k`` of every update
            component per step (gradsketch only).
        cores: Chains sampled at once, each running torch on ``max(1,
            torch.get_num_threads() // cores)`` threads (gradsketch only;
            devinterp 1.x's name). On CPU, when one train-mode forward pass
            of ``loss_fn`` draws nothing from torch's global generator (the
            working copy's dropout draws from each chain's own; a model
            calling ``torch.nn.functional.dropout`` itself does), the chains
            run in threads of this process: they start at once. Otherwise
            each runs in a worker process started with ``spawn``: the model,
            data and ``loss_fn`` are pickled to it (a ``loss_fn`` must then
            be a module-level function), it imports torch first (a few
            seconds), the workers are kept for the next call with the same
            ``cores`` and thread count (:func:`~gradsketch.slt.shutdown_workers`
            ends them), and scripts need the ``if __name__ == "__main__":``
            guard of ``spawn``. Either way the stores are bit for bit those
            of ``cores=1`` run on that many threads, and ``cores`` is not
            part of the settings: a store written with one value is reused
            or resumed with another.
        progress: tqdm bars on stderr for ``lr="auto"``'s pilots, ``L(w*)`` and
            the chains' steps: True shows them, False hides them, None (the
            default) shows them where stderr is a terminal (gradsketch only).
        fast_path: ``"auto"`` (the default) runs the chains on a working copy
            with faster train-mode pieces and native kernels where they
            engage (CPU only; :mod:`gradsketch.slt._fast`), ``"off"``
            on a plain copy with torch's operations (gradsketch only). Which
            ran is recorded in the store's ``gradsketch_fast_path`` attribute;
            it is not part of the settings.
        cache: A :class:`SamplingCache` shared with other calls, so that they
            compute L(w*) and ``lr="auto"``'s step once (gradsketch only;
            :func:`~gradsketch.slt.susceptibilities` shares one across its
            restrictions). None (the default): a fresh one for this call. The
            store's bits are the same either way: what ran earlier, in this
            process or with this cache, changes nothing.
        evaluate_observables: False skips the observables' forward pass at
            every draw (about half of a draw's time on a small language
            model): the store then holds no ``loss_<name>`` or
            ``input_ids_<name>`` variables, only the sampling losses and
            ``init_loss`` that :func:`~gradsketch.slt.compute_llc` reads, and
            its settings record the choice (a store made without them is not
            reused by a call that wants them; one made with them is reused,
            or resumed evaluating them, by a call that skips them). The
            chains are the same either way (gradsketch only;
            :func:`~gradsketch.slt.llc` passes False when no ``output_path``
            keeps the store).

    Returns:
        ``xarray.DataTree`` read lazily from the store.

    Example:
        >>> import tempfile
        >>> from transformers import GPT2Config, GPT2LMHeadModel
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16))
        >>> ids = torch.randint(0, 16, (16, 9))
        >>> tree = sample(model, ids, {"probe": ids}, lr=1e-4, n_beta=10.0, num_chains=2,
        ...               num_draws=3, batch_size=4, batches_per_draw=2,
        ...               output_path=tempfile.mkdtemp() + "/s.zarr")
        >>> tree.dataset["loss_probe"].dims, tree.dataset["loss_probe"].shape
        (('chain', 'draw', 'batch_probe', 'token_pos'), (2, 3, 8, 8))
    """
    if cache is None:
        cache = SamplingCache()
    elif not isinstance(cache, SamplingCache):
        raise TypeError(
            f"`cache` must be a gradsketch.slt.SamplingCache or None, got "
            f"{type(cache).__name__}; pass SamplingCache() to share one between calls."
        )
    if loss_fn is None:
        # The default loss reads next-token logits: refuse other models by
        # their class and config now, not with a shape error mid-chain.
        check_causal_lm(model)
    if fast_path not in FAST_PATHS:
        raise ValueError(
            f"`fast_path` must be one of {list(FAST_PATHS)}, got {fast_path!r}; 'off' runs "
            "the model's own modules with torch's operations."
        )
    if not isinstance(evaluate_observables, bool):
        raise TypeError(
            f"`evaluate_observables` must be True or False, got {evaluate_observables!r}."
        )
    lr_auto = isinstance(lr, str)
    if lr_auto and lr != "auto":
        raise ValueError(f"`lr` must be a positive float or 'auto', got {lr!r}.")
    kwargs = dict(sampling_method_kwargs or {})
    for short, value in (("eps", rmsprop_eps), ("alpha", rmsprop_alpha)):
        if value is None:
            continue
        if sampling_method != "rmsprop_sgld":
            # devinterp's phrase first: its users' tests match it.
            raise ValueError(
                f"rmsprop_{short} can only be set with sampling_method='rmsprop_sgld': "
                f"`rmsprop_{short}` is only valid with sampling_method='rmsprop_sgld', got "
                f"sampling_method={sampling_method!r}."
            )
        if short in kwargs:
            raise ValueError(
                f"specify only one of rmsprop_{short} and sampling_method_kwargs[{short!r}]: "
                f"`rmsprop_{short}` is given and so is sampling_method_kwargs[{short!r}]; give one."
            )
        kwargs[short] = value
    settings = SamplerSettings(
        lr=1.0 if isinstance(lr, str) else lr,  # "auto": calibrated below, once all is checked
        n_beta=n_beta,
        batch_size=batch_size,
        num_chains=num_chains,
        num_draws=num_draws,
        num_burnin_steps=num_burnin_steps,
        num_steps_bw_draws=num_steps_bw_draws,
        gradient_accumulation_steps=gradient_accumulation_steps,
        num_init_loss_batches=num_init_loss_batches,
        init_seed=init_seed,
        localization=localization,
        noise_level=noise_level,
        llc_weight_decay=llc_weight_decay,
        bounding_box_size=bounding_box_size,
        sampling_method=sampling_method,
        sampling_method_kwargs=kwargs,
        init_noise=init_noise,
        save_metrics=save_metrics,
        shuffle=shuffle,
        match_sampling_input_ids_across_chains=match_sampling_input_ids_across_chains,
    )
    if sketch_dim is not None and (
        isinstance(sketch_dim, bool) or not isinstance(sketch_dim, int) or sketch_dim < 1
    ):
        raise ValueError(f"`sketch_dim` must be None or a positive int, got {sketch_dim!r}.")
    if not isinstance(observables, Mapping) or not observables:
        raise ValueError(
            "`observables` must be a non-empty dict {name: dataset or (dataset, "
            f"batches_per_draw)}}, got {type(observables).__name__}."
        )
    data = as_token_tensor(dataset)
    if data.shape[0] < batch_size:
        raise ValueError(
            f"`dataset` has {data.shape[0]} sequences, fewer than `batch_size`={batch_size}; "
            "lower batch_size or give more data (batches drop the last partial one)."
        )
    context_length = data.shape[1] - 1
    # Token ids the embedding cannot take fail here, named, not as torch's IndexError.
    vocab = vocab_size(model)
    if vocab is not None:
        check_token_range(data, vocab, name="dataset")
    obs_list: list[Observable] = []
    for name, spec in observables.items():
        obs_data, bpd = spec if isinstance(spec, tuple) else (spec, batches_per_draw)
        ids = as_token_tensor(obs_data, name=f"observables[{name!r}]")
        if vocab is not None:
            check_token_range(ids, vocab, name=f"observables[{name!r}]")
        if ids.shape[1] != data.shape[1]:
            raise ValueError(
                f"observable {name!r} has sequences of {ids.shape[1]} tokens but `dataset` has "
                f"{data.shape[1]}; all sequences must have one length."
            )
        obs_list.append(
            Observable(name, ids, batches_per_draw=bpd, batch_size=batch_size, seed=obs_seed)
        )
    ids_seen = [o.obs_id for o in obs_list]
    if len(set(ids_seen)) != len(ids_seen):
        raise ValueError(
            f"`observables` names map to repeated identifiers {ids_seen}; rename them."
        )
    check_finite_weights(model)
    cores = check_cores(cores)
    mask = to_param_mask(model, param_masks)
    if mask.numel == 0:
        raise ValueError("`param_masks` selects no weight; select at least one entry.")
    loss = loss_fn if loss_fn is not None else per_token_loss
    model_digest, data_digest = _model_digest(model), token_digest(data)
    loss_name = getattr(loss, "__qualname__", repr(loss))
    if lr_auto:
        # Last, so that no argument error comes after the pilots' cost.
        settings = dataclasses.replace(
            settings,
            lr=_auto_lr(
                model,
                data,
                loss,
                key=(model_digest, data_digest, loss_name),
                settings=settings,
                output_path=output_path,
                device=device,
                cache=cache,
                progress=progress,
                fast_path=fast_path,
            ),
        )
    record = {
        "format": FORMAT,
        _hash.DIGEST_KEY: _hash.DIGEST_SCHEME,
        **settings.metadata(),
        "context_length": context_length,
        "dataset": data_digest,
        "observables": [
            {"obs_id": o.obs_id, "batches_per_draw": o.batches_per_draw, "data": o.digest}
            for o in obs_list
        ],
        "obs_seed": obs_seed,
        "model": model_digest,
        "param_masks": mask.fingerprint,
        "loss_fn": loss_name,
        "sketch_dim": sketch_dim,
        **({"lr_auto": True} if lr_auto else {}),
        # Only when skipped, so that the records of stores with observables are unchanged.
        **({} if evaluate_observables else {"evaluate_observables": False}),
    }
    if output_path is None:
        total = num_chains * settings.num_steps * batch_size
        if total > 1000:
            warnings.warn(
                f"sample() writes {total} sampled sequences to a temporary directory that is "
                "not kept; pass output_path='samples.zarr' to keep them.",
                UnsavedSamplesWarning,
                stacklevel=2,
            )
        path = Path(tempfile.mkdtemp()) / "samples.zarr"
    else:
        path = Path(output_path)
    with store_lock(path):
        state = check_existing(path, record, settings.metadata())
        if state != "new":
            # No sample is read, or kept, before its chunks are checked.
            ours = state == "resume" or SETTINGS_ATTR in zarr.open_group(str(path), mode="r").attrs
            evaluated = (
                [o.obs_id for o in obs_list] if record.get("evaluate_observables", True) else []
            )
            state = check_samples(
                path,
                state,
                num_chains=settings.num_chains,
                ours=ours,
                rewrites_ids=True,
                expected=layout_names(settings, evaluated, sketch_dim),
            )
        if state == "done":
            logger.info("sample(): reusing the completed samples at %s", path)
            return open_tree(path)
        torch_device = torch.device(
            device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
        )
        try:
            SampleRun(
                model=model,
                data=data,
                observables=obs_list,
                settings=settings,
                mask=mask,
                loss_fn=loss,
                device=torch_device,
                path=path,
                record=record,
                sketch_dim=sketch_dim,
                cores=cores,
                progress=progress,
                fast_path=fast_path,
                cache=cache,
                # False unless check_existing took a store made with them.
                evaluate_observables=record.get("evaluate_observables", True),
            ).run()
        except OSError as exc:
            # A full disk, a quota, a lost mount: say which store, and that a rerun resumes it.
            raise OSError(
                exc.errno,
                f"writing the sample store {path} failed ({exc.strerror or exc}); free space "
                "(or fix the cause) and rerun with the same arguments: finished chains are "
                "kept and the run resumes",
            ) from exc
    return open_tree(path)


def _auto_lr(
    model: nn.Module,
    data: torch.Tensor,
    loss: LossFn,
    *,
    key: tuple[str, str, str],
    settings: SamplerSettings,
    output_path: str | Path | None,
    device: str | torch.device | None,
    cache: SamplingCache,
    progress: bool | None = None,
    fast_path: str = "auto",
) -> float:
    """The step of ``lr="auto"`` (see :func:`sample`) for the validated ``settings``.

    ``key``: the digests of the model and data and the loss's name, as in the record;
    ``cache``: steps already calibrated by the calls sharing it.
    """
    if output_path is not None:
        path = Path(output_path)
        if path.is_dir() and any(path.iterdir()):
            try:
                stored = dict(zarr.open_group(str(path), mode="r").attrs).get(SETTINGS_ATTR)
            except Exception:  # not a store: sample() refuses it with the full message
                stored = None
            step = stored.get("lr") if isinstance(stored, Mapping) else None
            if isinstance(stored, Mapping) and stored.get("lr_auto") and isinstance(step, float):
                logger.info("sample(lr='auto'): keeping the stored step %g", step)
                return step
    from torch.utils.data import DataLoader, TensorDataset

    from gradsketch.sampling import calibrated_lr

    cache_key = (
        *key,
        settings.n_beta,
        settings.localization,
        settings.batch_size,
        settings.init_seed,
        # What a fresh process would compute it on, so that no earlier call decides it.
        str(device),
        torch.get_num_threads(),
        fast_path,
    )
    if cache_key in cache.auto_lrs:  # e.g. susceptibilities' restrictions: one calibration
        return cache.auto_lrs[cache_key]
    pilot_model = copy.deepcopy(model).train()
    loader = DataLoader(
        TensorDataset(data),
        batch_size=settings.batch_size,
        shuffle=True,
        drop_last=True,
        generator=torch.Generator().manual_seed(settings.init_seed),
    )
    with (
        tqdm(desc="lr='auto' pilots", unit="step", disable=hidden(progress)) as bar,
        fast_kernels(fast_path != "off"),
    ):

        def evaluate(m: nn.Module, batch: Any) -> torch.Tensor:
            bar.update()
            return loss(m, batch[0]).mean()

        step = calibrated_lr(
            pilot_model,
            loader,
            evaluate,
            nbeta=settings.n_beta,
            localization=settings.localization,
            seed=settings.init_seed,
            device=device
            if device is not None
            else ("cuda" if torch.cuda.is_available() else "cpu"),
        )
    step = float(f"{step:.2g}")
    logger.info("sample(lr='auto'): calibrated step %g", step)
    cache.auto_lrs[cache_key] = step
    return step
