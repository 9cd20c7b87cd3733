"""One call of :func:`~gradsketch.slt.sample`: initial loss, chains, in order into the store.

Every chain runs on a working copy of the model (:mod:`gradsketch.slt._fast`):
the same train-mode function with dropout masks from the chain's own
generator and faster CPU kernels. Differences from devinterp that change no
estimate: batches are index lookups into one token tensor (the same batches
as devinterp's DataLoader for the same seed); every observable of a draw is
evaluated in one forward pass (in chunks bounded by the logits' size); the
initial loss, which depends only on the weights and the batches, is computed
once when every chain sees the same batches (and once for the calls sharing
a :class:`~gradsketch.slt.SamplingCache`); and each finished chain is
written by a background thread while the next one samples
(:class:`~gradsketch.slt._writing.ChainWriter`).

With ``cores=k > 1`` ``k`` chains sample at once (:mod:`gradsketch._processes`):
in threads of this process when nothing a chain runs draws from torch's
global generator (checked on one forward pass), else in worker processes;
each finished chain comes back to this thread, which alone writes the store,
in the same order (data, then flag).
"""

from __future__ import annotations

import json
import pickle
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr
from torch import nn
from tqdm.auto import tqdm

from gradsketch._hash import text_digest
from gradsketch._processes import run_jobs, start_workers, threads_for
from gradsketch.masked import ParamMask
from gradsketch.sampling import DrawSchedule, Metrics, run_chain
from gradsketch.slt._cache import SamplingCache
from gradsketch.slt._config import SamplerSettings, sampler_factory
from gradsketch.slt._data import LossFn, NonFiniteLossError, Observable, nonfinite_cause
from gradsketch.slt._fast import (
    dropout_stream,
    engaged,
    fast_kernels,
    skip_seeds,
    stream_draws,
    train_copy,
    uses_global_generator,
)
from gradsketch.slt._schema import FAST_PATH_ATTR, SKETCH_COMPONENTS, array, create_layout
from gradsketch.slt._writing import ChainWriter, logger

__all__ = ["SampleRun", "hidden", "noise_seed"]

#: Bytes of one forward pass's logits, at most, when evaluating observables and
#: ``init_loss`` (with at least one row per pass).
EVAL_LOGIT_BYTES = {"cuda": 256 << 20, "cpu": 4 << 20}
#: Token positions of one such forward pass on CPU, at most: the activations of
#: a few thousand positions stay in cache from one operation to the next, which
#: makes smaller passes faster per row (benchmarks/RESULTS.md).
EVAL_TOKENS_CPU = 3200


def noise_seed(init_seed: int, chain: int) -> int:
    """The seed of a chain's sampler noise, unrelated to ``init_seed + chain``.

    torch's global generator, which draws dropout masks, is seeded with
    ``init_seed + chain`` (as devinterp); a noise generator with the same seed
    would replay that stream, correlating the noise with the dropout masks.
    """
    state = np.random.SeedSequence([init_seed, chain, 0x5EED]).generate_state(1, np.uint64)
    return int(state[0] >> 1)


def _loader_order(n: int, *, seed: int, shuffle: bool) -> torch.Tensor:
    """The row order of devinterp's DataLoader for one seeded generator (first epoch).

    A DataLoader iterator draws one int64 from the generator for its workers'
    base seed before the RandomSampler's ``randperm``; the same draw is made here
    so that both give the same batches.
    """
    if not shuffle:
        return torch.arange(n)
    gen = torch.Generator().manual_seed(seed)
    torch.empty((), dtype=torch.int64).random_(generator=gen)
    return torch.randperm(n, generator=gen)


def _chunks(rows: int, limit: int) -> list[slice]:
    """``rows`` split into the fewest passes of at most ``limit`` rows, of even sizes."""
    passes = -(-rows // limit)
    size = -(-rows // passes) if rows else limit
    return [slice(i, min(i + size, rows)) for i in range(0, rows, size)]


def _eval_rows(model: nn.Module, seq: int, device: torch.device) -> int:
    """Rows per forward pass: logits within EVAL_LOGIT_BYTES; on CPU, EVAL_TOKENS_CPU tokens."""
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", None) or 50_000)
    budget = EVAL_LOGIT_BYTES["cuda" if device.type == "cuda" else "cpu"]
    rows = budget // max(1, seq * vocab * 4)
    if device.type != "cuda":
        rows = min(rows, EVAL_TOKENS_CPU // max(1, seq))
    return max(1, rows)


@dataclass(eq=False, repr=False, kw_only=True)
class SampleRun:
    """One call of :func:`sample`: store layout, initial loss, chains, writes."""

    model: nn.Module
    data: torch.Tensor
    observables: list[Observable]
    settings: SamplerSettings
    mask: ParamMask
    loss_fn: LossFn
    device: torch.device
    path: Path
    record: dict[str, Any]
    sketch_dim: int | None
    # L(w*) of the calls sharing it (read and written by run(), in this process only).
    cache: SamplingCache
    fast_path: str
    evaluate_observables: bool
    progress: bool | None
    cores: int

    def __post_init__(self) -> None:
        self.ctx = self.data.shape[1] - 1
        self.n_batches = self.data.shape[0] // self.settings.batch_size
        # With evaluate_observables=False: the dropout-stream seeds the observables'
        # forward pass draws, drawn without it at each draw (run() decides; None: it
        # runs, as the chains could not be kept the same without it).
        self.skipped_seeds: int | None = None
        # Chains in threads of this process (run() decides): no global seeding then.
        self.threaded = False
        # Per process (dropped when pickled to a worker): the working copies, the step counter.
        self._local = threading.local()
        self._tick: Callable[[], Any] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_local"]
        state["_tick"] = None
        state["threaded"] = False
        state["cache"] = None  # workers sample chains; L(w*) is this process's
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._local = threading.local()

    def observed(self) -> list[Observable]:
        """The observables evaluated at each draw: none when :attr:`skipped_seeds` is set."""
        return [] if self.skipped_seeds is not None else self.observables

    def _observable_ids(self) -> torch.Tensor:
        """Every observable's fixed sequences, in order, on the device: one forward pass's rows."""
        return torch.cat([o.input_ids for o in self.observables]).to(self.device)

    def _decide_observables(self) -> None:
        """Set :attr:`skipped_seeds` for ``evaluate_observables=False``, where the chains allow.

        The observables' train-mode forward pass draws its dropout seeds from
        the chain's stream; skipped, the same number is drawn at each draw, so
        the chains and their sampling losses are those of the run that
        evaluates them. Where that count cannot be found (the pass draws from
        torch's global generator, or other than whole seeds), they are
        evaluated as usual.
        """
        self.skipped_seeds = None
        if self.evaluate_observables:
            return
        work = self.work()
        obs_ids = self._observable_ids()
        with fast_kernels(self.fast_path != "off"):
            count = stream_draws(
                lambda: self._forward_rows(work.train(), obs_ids, check=False), self.device
            )
        if count is None:
            logger.info(
                "sample(evaluate_observables=False): the observables' forward pass draws "
                "from torch's global generator (or other than whole dropout seeds); they are "
                "evaluated, so that the chains stay those of a run that evaluates them"
            )
        self.skipped_seeds = count

    def work(self) -> nn.Module:
        """The working copy of the model in this thread (each chain resets its weights).

        A :func:`~gradsketch.slt._fast.train_copy`: the same
        train-mode function with faster dropout, attention and GELU kernels.
        """
        work = getattr(self._local, "work", None)
        if work is None:
            work = train_copy(
                self.model,
                self.device,
                loss_fn=self.loss_fn,
                probe=self.data[:1],
                fast_path=self.fast_path,
            )
            self._local.work = work
        return work

    def _generator(self, chain: int) -> torch.Generator:
        """Chain ``chain``'s generator of dropout masks and initial noise (init_seed + chain).

        Outside threads torch's global generator gets the same seed, for
        models that draw from it (devinterp seeds only that one).
        """
        seed = self.settings.init_seed + chain
        if not self.threaded:
            torch.manual_seed(seed)
        return torch.Generator(device=self.device).manual_seed(seed)

    # --------------------------------------------------------------- helpers
    def _order(self, chain: int) -> torch.Tensor:
        s = self.settings
        seed = s.init_seed if s.match_sampling_input_ids_across_chains else s.init_seed + chain
        return _loader_order(self.data.shape[0], seed=seed, shuffle=s.shuffle)

    def _batch_rows(self, order: torch.Tensor, first: int, count: int) -> torch.Tensor:
        """Row indices of ``count`` consecutive batches from batch ``first`` (cycling)."""
        bs = self.settings.batch_size
        idx = (torch.arange(first, first + count) % self.n_batches).repeat_interleave(bs)
        return order[idx * bs + torch.arange(bs).repeat(count)]

    def _forward_rows(self, model: nn.Module, ids: torch.Tensor, *, check: bool) -> torch.Tensor:
        """Per-token loss of every row of ``ids``, in forward passes of bounded size."""
        limit = _eval_rows(model, ids.shape[1], self.device)
        out = torch.empty(ids.shape[0], self.ctx, dtype=torch.float32)
        for sl in _chunks(ids.shape[0], limit):
            loss = self.loss_fn(model, ids[sl].to(self.device))
            if check:
                self._check_shape(loss, sl.stop - sl.start)
            out[sl] = loss.detach().float().cpu()
        return out

    def _check_shape(self, loss: torch.Tensor, rows: int) -> None:
        if tuple(loss.shape) != (rows, self.ctx):
            raise ValueError(
                f"`loss_fn` must return the per-token loss of shape {(rows, self.ctx)} for "
                f"input_ids of shape {(rows, self.ctx + 1)}, got {tuple(loss.shape)}."
            )

    def _reset(self, work: nn.Module) -> None:
        with torch.no_grad():
            for p, ref in zip(work.parameters(), self.model.parameters()):
                p.copy_(ref)

    # ------------------------------------------------------------ init loss
    def _init_key(self, threads: int) -> tuple[Any, ...]:
        """What decides :meth:`_init_loss`'s bits (:class:`SamplingCache`), less the chain."""
        s = self.settings
        # The modules' settings (dropout rates, activations) too, beside the weights' digest.
        modules = text_digest(repr(self.model))
        return (
            self.record["model"],
            modules,
            self.record["dataset"],
            self.loss_fn,
            s.batch_size,
            s.gradient_accumulation_steps,
            s.num_init_loss_batches,
            s.init_seed,
            s.init_noise,
            s.shuffle,
            s.match_sampling_input_ids_across_chains,
            str(self.device),
            threads,
            self.threaded,
            # What the working copy engages (its modules, native or torch kernels).
            json.dumps(_fast_path_record(self.fast_path, self.work()), sort_keys=True),
        )

    def _record_fast_path(self, root: zarr.Group) -> None:
        """Add what this run's working copy engages to the store's :data:`FAST_PATH_ATTR`.

        A list with one entry per distinct record: a store resumed with another
        ``fast_path`` (or on a machine without the kernels) lists both.
        """
        entry = _fast_path_record(self.fast_path, self.work())
        stored = root.attrs.get(FAST_PATH_ATTR)
        runs = list(stored) if isinstance(stored, list) else []
        if entry not in runs:
            root.update_attributes({FAST_PATH_ATTR: [*runs, entry]})

    def _shared_init(self) -> bool:
        """Whether every chain takes one L(w*): same weights (no init noise), same batches."""
        return self.settings.match_sampling_input_ids_across_chains and not self.settings.init_noise

    @torch.inference_mode()
    def _init_loss(self, work: nn.Module, chain: int, cache: dict[int, np.ndarray]) -> np.ndarray:
        """L(w*) per position for ``chain`` (``[token_pos]``), refused when not finite.

        With :meth:`_shared_init` it is chain 0's (its dropout stream), whichever
        chain asks: a resumed run gives the uninterrupted run's bits.
        """
        s = self.settings
        if self._shared_init():
            if cache:
                # Same weights, same batches: the same L(w*) (up to dropout's draws).
                return next(iter(cache.values()))
            chain = 0
        gen = self._generator(chain)
        self._reset(work)
        if s.init_noise:
            # devinterp: noise on every weight (ignoring the restriction) for L(w*).
            for p in work.parameters():
                p.add_(_randn(p, gen) * s.init_noise)
        count = s.gradient_accumulation_steps * s.num_init_loss_batches
        rows = self._batch_rows(self._order(chain), 0, count)
        work.train()
        with dropout_stream(gen), fast_kernels(self.fast_path != "off"):
            losses = self._forward_rows(work, self.data[rows], check=True)
        bad = ~torch.isfinite(losses).all(dim=1)
        if bool(bad.any()):
            where = sorted(set(rows[bad].tolist()))
            raise NonFiniteLossError(
                f"the initial loss L(w*) is NaN or infinite on {len(where)} sequences of "
                f"`dataset` (rows {where[:10]}{' ...' if len(where) > 10 else ''}) before any "
                "sampling step: the model's weights or `loss_fn` give a non-finite loss there; "
                "check the weights and loss_fn on these rows, or drop them from the data."
            )
        value = losses.double().mean(dim=0).float().numpy()
        cache[chain] = value
        return value

    # ---------------------------------------------------------------- chain
    def sample_chain(self, chain: int) -> tuple[int, dict[str, np.ndarray], str | None]:
        """Chain ``chain``: ``(chain, {array: the chain's rows}, failure message or None)``."""
        s = self.settings
        work = self.work()
        failure: str | None = None
        bs, gas, ctx = s.batch_size, s.gradient_accumulation_steps, self.ctx
        gen = self._generator(chain)
        self._reset(work)
        masks = [self.mask[n] for n, _ in work.named_parameters()]
        chosen: list[torch.Tensor] = []
        per_param: list[torch.Tensor | None] = []
        for (_, p), m in zip(work.named_parameters(), masks):
            selected = bool(m.any())
            p.requires_grad_(selected)
            p.grad = None
            if selected:
                chosen.append(p)
                per_param.append(None if bool(m.all()) else m.to(p.device))
        restricted = any(sel is not None for sel in per_param)
        factory, kwargs = sampler_factory(s, per_param if restricted else None, self.sketch_dim)
        optimizer = factory(chosen, **kwargs)
        if s.init_noise:
            with torch.no_grad():
                for param, sel in zip(chosen, per_param):
                    noise = _randn(param, gen) * s.init_noise
                    param.add_(noise if sel is None else noise * sel)
        noise_gen = torch.Generator(device=self.device).manual_seed(noise_seed(s.init_seed, chain))
        order = self._order(chain)
        steps, draws = s.num_steps, s.num_draws
        micro_loss = np.full((steps, gas * bs, ctx), np.nan, dtype=np.float32)
        micro_rows = np.zeros((steps, gas * bs), dtype=np.int64)
        draw_loss = np.full((draws, bs, ctx), np.nan, dtype=np.float32)
        obs_loss = [
            np.full((draws, o.n_samples, ctx), np.nan, dtype=np.float32) for o in self.observed()
        ]
        obs_ids = self._observable_ids()
        obs_split = np.cumsum([o.n_samples for o in self.observables])[:-1]
        fields = (*Metrics.NORM_FIELDS, *Metrics.DOT_FIELDS)
        metrics = np.full((steps, len(fields)), np.nan, dtype=np.float32)
        sketches = (
            np.full((steps, 5, self.sketch_dim), np.nan, dtype=np.float32)
            if self.sketch_dim is not None
            else None
        )
        work.train()

        def step_loss(step: int) -> torch.Tensor:
            """Forward and backward over the step's micro-batches: ``[batch, token_pos]`` loss."""
            rows = self._batch_rows(order, step * gas, gas)
            micro_rows[step] = rows.numpy()
            acc: torch.Tensor | None = None
            for j in range(gas):
                ids = self.data[rows[j * bs : (j + 1) * bs]].to(self.device)
                loss = self.loss_fn(work, ids)
                if step == 0 and j == 0:
                    self._check_shape(loss, bs)
                loss = loss.float()
                (loss.mean() / gas).backward()
                part = loss.detach() / gas
                acc = part if acc is None else acc + part
                micro_loss[step, j * bs : (j + 1) * bs] = loss.detach().cpu().numpy()
            assert acc is not None
            return acc

        def nonfinite(step: int, acc: torch.Tensor) -> NonFiniteLossError:
            bad = ~np.isfinite(micro_loss[step]).all(axis=1)
            where = sorted(set(micro_rows[step][bad].tolist()))
            cause = nonfinite_cause(step, s.lr) + (" on these rows" if step == 0 else "")
            return NonFiniteLossError(
                f"chain {chain}: the loss is NaN or infinite at step {step} on rows "
                f"{where[:10]} of `dataset`, {cause}"
            )

        def on_step(step: int, acc: torch.Tensor) -> None:
            if s.save_metrics:
                record = optimizer.get_metrics()
                metrics[step] = [float(getattr(record, f)) for f in fields]
            if sketches is not None:
                buf = optimizer.get_sketches()
                sketches[step] = torch.stack(list(buf.as_dict().values())).numpy()

        def on_draw(draw: int, step: int, acc: torch.Tensor) -> None:
            draw_loss[draw] = acc.cpu().numpy()
            if self.skipped_seeds is not None:
                # Not evaluated: its dropout seeds are drawn, so that the chain goes on as with it.
                skip_seeds(gen, self.skipped_seeds)
                return
            with torch.inference_mode():
                values = self._forward_rows(work, obs_ids, check=False).numpy()
            for buf_, part_ in zip(obs_loss, np.split(values, obs_split)):
                buf_[draw] = part_

        schedule = DrawSchedule(draws, s.num_burnin_steps, s.num_steps_bw_draws)
        try:
            with dropout_stream(gen), fast_kernels(self.fast_path != "off"):
                run_chain(
                    optimizer,
                    step_loss,
                    schedule,
                    noise_generator=noise_gen,
                    nonfinite_error=nonfinite,
                    on_step=on_step if s.save_metrics or sketches is not None else None,
                    on_draw=on_draw,
                    tick=self._tick,
                )
        except NonFiniteLossError as exc:
            # As devinterp: a failed chain warns (in the caller's process) and keeps NaN.
            failure = f"Chain failed: {exc}; its remaining draws are NaN."
        out: dict[str, np.ndarray] = {
            "sampling_loss": draw_loss[None],
            "sampling_loss_micro": micro_loss[None],
            "sampling_input_ids_micro": self.data.numpy()[micro_rows][None],
        }
        for o, buf_ in zip(self.observed(), obs_loss):
            out[f"loss_{o.obs_id}"] = buf_[None]
        if s.save_metrics:
            for i, f in enumerate(fields):
                out[f"metrics_{f}"] = metrics[None, :, i]
        if sketches is not None:
            for i, q in enumerate(SKETCH_COMPONENTS):
                out[f"sketch_{q}"] = sketches[None, :, i]
        return chain, {k: v[0] for k, v in out.items()}, failure

    # ------------------------------------------------------------------ run
    def run(self) -> None:
        s = self.settings
        root = zarr.open_group(str(self.path), mode="a")
        # With cores > 1 this process also runs on the workers' thread count, so
        # that init_loss too is the bits of cores=1 on that many threads.
        with threads_for(self.cores) as threads:
            self._decide_observables()
            create_layout(
                root,
                self.path,
                settings=s,
                ctx=self.ctx,
                observed=self.observed(),
                record=self.record,
                numel=self.mask.numel,
                sketch_dim=self.sketch_dim,
            )
            writer = ChainWriter(root)
            done = np.asarray(array(root, "progress/chain_done")[:], dtype=bool)
            todo = [c for c in range(s.num_chains) if not done[c]]
            parallel = self.cores > 1 and len(todo) > 1
            # Chains share this process when nothing they run draws from torch's
            # global generator (each has its own dropout stream); else processes.
            self.threaded = (
                parallel
                and self.device.type == "cpu"
                and not uses_global_generator(self.work(), self.loss_fn, self.data[:1])
            )
            self._record_fast_path(root)
            if parallel and not self.threaded:
                _check_picklable(self.loss_fn, self.cores)
                start_workers(self.cores, threads=threads)  # their imports overlap init_loss
            bar = tqdm(
                total=len(todo) * s.num_steps,
                desc="L(w*)",
                unit="step",
                disable=hidden(self.progress),
            )
            try:
                init_done = np.asarray(array(root, "progress/init_done")[:], dtype=bool)
                cache: dict[int, np.ndarray] = {}
                known = self._init_key(threads)
                shared = self._shared_init()
                if shared and init_done.any():
                    # Resuming: the stored L(w*), never one of another chain's dropout stream.
                    first = int(np.flatnonzero(init_done)[0])
                    stored = np.asarray(array(root, "init_loss")[first], dtype=np.float32)
                    if np.isfinite(stored).all():
                        cache[first] = stored
                for chain in range(s.num_chains):
                    if not init_done[chain]:
                        key = (*known, 0 if shared else chain)
                        value = self.cache.init_losses.get(key)
                        if value is None:
                            value = self._init_loss(self.work(), chain, cache)
                            self.cache.init_losses[key] = value.copy()
                        writer.write(chain, {"init_loss": value}, "progress/init_done")
                bar.set_description("sampling")
                in_process = not parallel or self.threaded
                self._tick = _locked(bar.update) if in_process else None
                # Chains are written as they finish (in any order), each one's
                # data before its done flag, all from this thread.
                for chain, values, failure in run_jobs(
                    _sample_chain,
                    todo,
                    cores=self.cores,
                    shared=self,
                    threads=threads,
                    backend="threads" if self.threaded else "processes",
                ):
                    if failure is not None:
                        warnings.warn(failure, stacklevel=3)
                    writer.write(chain, values, "progress/chain_done")
                    if not in_process:
                        bar.update(s.num_steps)
            finally:
                bar.close()
                self._tick = None
                self.threaded = False
                writer.close()
        root.update_attributes({"completed": 1})


def _fast_path_record(fast_path: str, work: nn.Module) -> dict[str, Any]:
    """The store's ``gradsketch_fast_path`` entry: what was asked for, what engaged."""
    with fast_kernels(fast_path != "off"):
        return {"fast_path": fast_path, **engaged(work)}


def hidden(progress: bool | None) -> bool | None:
    """The ``disable`` of tqdm for ``progress``: None leaves it to tqdm (off a terminal: hidden)."""
    return None if progress is None else not progress


def _check_picklable(loss_fn: LossFn, cores: int) -> None:
    """Refuse a ``loss_fn`` that worker processes cannot receive."""
    try:
        pickle.dumps(loss_fn)
    except Exception as exc:
        raise ValueError(
            f"`loss_fn`={loss_fn!r} cannot be sent to worker processes (cores={cores}; "
            f"its forward pass draws from torch's global generator, so chains cannot share "
            f"this process): {exc}; define it as a module-level function or pass cores=1."
        ) from exc


def _randn(param: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Standard normal noise shaped like ``param`` from ``gen`` (``randn_like`` takes none)."""
    return torch.randn(param.shape, generator=gen, dtype=param.dtype, device=param.device)


def _locked(fn: Callable[[int], Any]) -> Callable[[], None]:
    """``fn(1)`` under a lock (progress ticks from chains running in threads)."""
    lock = threading.Lock()

    def tick() -> None:
        with lock:
            fn(1)

    return tick


def _sample_chain(run: SampleRun, chain: int) -> tuple[int, dict[str, np.ndarray], str | None]:
    """:meth:`SampleRun.sample_chain` as a module-level function (worker processes call it)."""
    return run.sample_chain(chain)
