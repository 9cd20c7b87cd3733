"""The replay benchmark's measurements on a :class:`~gradsketch.demos.protocols.Protocol`.

Each ``run_*`` function measures one part of ``benchmarks/bench_replay.py``
and prints one JSON line per figure (:func:`~gradsketch.demos.protocols.emit`):
:func:`run_lds` (every method's LDS in both settings, with bootstrap
intervals and each replay row's paired difference to the best other method),
:func:`run_removal`, :func:`run_ceiling` (a ridge datamodel fitted to many
retrains, and the seed noise of fresh-seed retrains), :func:`run_cost` and
:func:`run_ops` (the reverse pass's time and operations), and
:func:`run_bergson` (bergson's MAGIC on the same run). :func:`format_table`
writes the closing table of a run's summary.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch import Tensor, nn

from gradsketch.attribution import ReplayAttributor, linear_datamodeling_interval
from gradsketch.demos.protocols._records import emit
from gradsketch.demos.protocols._replay import (
    OTHER_METHODS,
    Protocol,
    lds,
    same_run_truth,
    subset_mask,
    timed,
)


def run_lds(
    p: Protocol,
    linearize_at: tuple[float, ...],
    *,
    mean_of: tuple[float, ...] = (),
    bases: int = 0,
    seed_bases: int = 0,
    others: bool,
    progress: bool,
) -> dict[str, Any]:
    """LDS of the replay at each linearization point, its averages and the others.

    Averages: over ``sizes.seeds`` seeds at the first point; over the points
    ``mean_of`` (the same run's metagradients at each, averaged); over
    ``bases`` random halves' 0/1 masks as per-row ``linearize_at`` (drawn
    independently of the evaluation's halves); over ``seed_bases`` runs that
    each take a fresh seed and their own random half's mask.
    """
    sizes = p.sizes
    summary: dict[str, Any] = {}
    methods: dict[str, np.ndarray] = {}
    # CPU seconds of each method's scores: a replay's training and reverse pass (all
    # of its runs for an average), another method's featurizing and scoring.
    cpu: dict[str, float] = {}
    summary["cpu_s"] = cpu
    at_point: dict[float, tuple[np.ndarray, float]] = {}
    first: ReplayAttributor | None = None

    def metagradients(seed: int, at: Any, label: Any) -> tuple[np.ndarray, float]:
        """One replayed run's metagradients and its CPU seconds (training and reverse)."""
        nonlocal first
        r = p.run(seed, at, progress=progress)
        t_train, c_train, _ = timed(r.train)
        t_rev, c_rev, g = timed(lambda: r.metagradients(p.targets).cpu().numpy())
        first = r if first is None else first
        emit(
            {
                "bench": "replay",
                "protocol": p.name,
                "part": "run",
                "seed": seed,
                "linearize_at": label,
                "steps": r.settings.num_steps,
                "checkpoint_every": r.every,
                "train_s": t_train,
                "train_cpu_s": c_train,
                "reverse_s": t_rev,
                "reverse_cpu_s": c_rev,
                "queries": sizes.num_targets,
                "memory_bytes": r.memory_estimate(sizes.num_targets).total,
            }
        )
        return g, c_train + c_rev

    def add(name: str, runs: list[tuple[np.ndarray, float]]) -> None:
        """Method ``name``: the mean of ``runs``' metagradients, at the sum of their cost."""
        methods[name] = np.mean([g for g, _ in runs], axis=0)
        cpu[name] = sum(c for _, c in runs)

    for a in dict.fromkeys((*linearize_at, *mean_of)):
        runs = [
            metagradients(p.base_seed + k, a, a)
            for k in range(sizes.seeds if a == linearize_at[0] else 1)
        ]
        at_point[a] = runs[0]
        if a in linearize_at:
            add(f"replay@{a:g}", runs[:1])
        if len(runs) > 1:
            add(f"replay@{a:g}-mean{len(runs)}", runs)
    if mean_of:
        label = ",".join(f"{a:g}" for a in mean_of)
        add(f"replay@mean({label})", [at_point[a] for a in mean_of])

    def at_halves(count: int, draws: int, fresh_seeds: bool) -> list[tuple[np.ndarray, float]]:
        """``count`` runs, each at its own random half's 0/1 mask (drawn from ``draws``).

        Each starts from the base seed or, with ``fresh_seeds``, from a fresh seed.
        """
        rng = np.random.default_rng(draws)
        runs = []
        for k in range(count):
            mask = subset_mask(rng, p.n_train).astype(np.float64)
            seed = p.base_seed + 1 + k if fresh_seeds else p.base_seed
            label = f"seed {k}, half {k}" if fresh_seeds else f"half {k}"
            runs.append(metagradients(seed, mask, label))
        return runs

    if bases:
        add(f"replay@halves-mean{bases}", at_halves(bases, 20_000, fresh_seeds=False))
    if seed_bases:
        add(
            f"replay@seeds-halves-mean{seed_bases}", at_halves(seed_bases, 30_000, fresh_seeds=True)
        )
    assert first is not None
    ordinary = first.retrain(torch.ones(first.n_train))
    reference = p.torch_train(p.base_seed)
    summary["replay_vs_torch_loop_max_abs"] = max(
        float((ordinary[n] - v).abs().max()) for n, v in reference.items()
    )
    emit(
        {
            "bench": "replay",
            "protocol": p.name,
            "part": "loop",
            "replay_vs_torch_loop_max_abs": summary["replay_vs_torch_loop_max_abs"],
        }
    )
    truth_a = same_run_truth(first, p.targets, sizes.lds_models, seed=10_000)
    _, _, truth_b = timed(lambda: p.fresh_truth(progress))
    table: dict[str, dict[str, Any]] = {}
    summary["lds"] = table
    scored: dict[str, np.ndarray] = {}
    truths = {"same-run": truth_a, "fresh-seeds": truth_b}

    def report(name: str, s: np.ndarray) -> None:
        scored[name] = s
        table[name] = {}
        for setting, truth in truths.items():
            est, low, high = linear_datamodeling_interval(s, *truth)
            table[name][setting] = round(est, 4)
            table[name][f"{setting}_ci95"] = [round(low, 4), round(high, 4)]
        emit({"bench": "replay", "protocol": p.name, "part": "lds", "method": name, **table[name]})

    for name, s in methods.items():
        report(name, s)
    if others:
        for name in OTHER_METHODS:
            with tempfile.TemporaryDirectory() as tmp:
                try:
                    t, c, scores = timed(
                        functools.partial(p.others, ordinary, Path(tmp), progress, name)
                    )
                except Exception as exc:  # report the failure, keep the other methods' rows
                    summary.setdefault("others_error", {})[name] = repr(exc)
                    emit(
                        {
                            "bench": "replay",
                            "protocol": p.name,
                            "part": "lds",
                            "method": name,
                            "error": repr(exc),
                        }
                    )
                    continue
            cpu[name] = c
            emit(
                {
                    "bench": "replay",
                    "protocol": p.name,
                    "part": "other-cost",
                    "method": name,
                    "s": t,
                    "cpu_s": c,
                    "queries": sizes.num_targets,
                    "models_scored": 1,
                }
            )
            report(name, scores)
        summary["lds_diff"] = compare_with_best_other(p.name, table, scored, truths)
    return summary


def compare_with_best_other(
    protocol: str,
    table: dict[str, dict[str, Any]],
    scored: dict[str, np.ndarray],
    truths: dict[str, tuple[np.ndarray, np.ndarray]],
) -> dict[str, dict[str, Any]]:
    """Each replay row minus the best other method, per setting, with a paired 95 % interval.

    The interval resamples the retrains (the queries kept): one that holds 0
    means these retrains do not tell the two apart.
    """
    diffs: dict[str, dict[str, Any]] = {}
    others = [m for m in OTHER_METHODS if m in scored]
    if not others:
        return diffs
    for setting, truth in truths.items():
        best = max(others, key=lambda m: table[m][setting])
        for name in scored:
            if name in OTHER_METHODS:
                continue
            est, low, high = linear_datamodeling_interval(
                scored[name], *truth, baseline_scores=scored[best]
            )
            row = {"minus": best, "diff": round(est, 4), "ci95": [round(low, 4), round(high, 4)]}
            diffs.setdefault(name, {})[setting] = row
            emit(
                {
                    "bench": "replay",
                    "protocol": protocol,
                    "part": "lds-diff",
                    "method": name,
                    "setting": setting,
                    **row,
                }
            )
    return diffs


def run_removal(p: Protocol, keeps: tuple[float, ...]) -> dict[str, float]:
    """Same-run LDS as the retrains keep more of the data: the metagradient's linear range.

    For each fraction ``α`` in ``keeps``: the run's metagradients at
    ``w = α·1`` against ``lds_models`` same-run retrains on random subsets of
    ``α·n`` rows (setting (a) with smaller removals than halves).
    """
    table: dict[str, float] = {}
    for keep in keeps:
        r = p.run(p.base_seed, keep)
        r.train()
        scores = r.metagradients(p.targets).cpu().numpy()
        truth = same_run_truth(r, p.targets, p.sizes.lds_models, seed=10_000, keep=keep)
        table[f"{keep:g}"] = lds(scores, truth)
        emit(
            {
                "bench": "replay",
                "protocol": p.name,
                "part": "removal",
                "keep": keep,
                "linearize_at": keep,
                "same-run": table[f"{keep:g}"],
            }
        )
    return table


def ridge_datamodel(masks: np.ndarray, outputs: np.ndarray) -> tuple[np.ndarray, float]:
    """A linear datamodel ``[n_train, n_targets]`` fitted to ``(masks, outputs)`` by ridge.

    The ridge ``λ`` is chosen from :data:`RIDGES` on the last fifth of the
    rows (fitted on the rest), then the model is refitted on all of them.
    Halves of one size leave the coefficients' common offset free (every
    mask sums to the same count); the ridge takes the smallest, which no
    LDS sees.
    """
    if len(masks) < 15:
        raise ValueError(
            f"a datamodel needs at least 15 retrains (its held-out fifth ranks 3), got "
            f"{len(masks)}; pass --fit-models 20 or more"
        )
    x, y = masks.astype(np.float64), outputs.astype(np.float64)

    def fit(x: np.ndarray, y: np.ndarray, lam: float) -> np.ndarray:
        xc, yc = x - x.mean(0), y - y.mean(0)
        beta: np.ndarray = np.linalg.solve(xc.T @ xc + lam * np.eye(x.shape[1]), xc.T @ yc)
        return beta

    (x_fit, y_fit), held = held_out_fifth(x, y)
    best = max(RIDGES, key=lambda lam: lds(fit(x_fit, y_fit, lam), held))
    return fit(x, y, best), best


def held_out_fifth(
    masks: np.ndarray, outputs: np.ndarray
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """``(masks, outputs)`` split into its first four fifths and its last fifth."""
    cut = len(masks) * 4 // 5
    return (masks[:cut], outputs[:cut]), (masks[cut:], outputs[cut:])


def seed_noise_bound(first: np.ndarray, second: np.ndarray) -> tuple[float, float]:
    """``(mean ρ, mean √ρ)`` over targets of two seeds' outputs ``[halves, n_targets]``.

    Write one seed's output on half ``S`` as ``f(S) + ε`` with ``ε`` the
    seed's part, independent across seeds, mean 0. Across halves the two
    seeds' outputs then have covariance ``Var f`` and correlation
    ``ρ = Var f / (Var f + Var ε)``. Any predictor ``p(S)`` of one seed's
    output has ``corr(p, f + ε) = corr(p, f) · √ρ ≤ √ρ``, the seed average
    ``f`` itself included. Negative ``ρ`` (noise) counts as 0.
    """
    rho = np.array([np.corrcoef(first[:, j], second[:, j])[0, 1] for j in range(first.shape[1])])
    return float(rho.mean()), float(np.sqrt(np.clip(rho, 0.0, 1.0)).mean())


#: Ridge strengths the ceiling's datamodels choose from.
RIDGES = (0.1, 1.0, 10.0, 100.0, 1000.0)


def run_ceiling(p: Protocol, linearize_at: float, fit_models: int, pairs: int) -> dict[str, Any]:
    """How high any linear attribution can score on the protocol, beside the replay.

    Per setting, a linear datamodel (:func:`ridge_datamodel`) fitted to
    ``fit_models`` retrains on random halves other than the evaluation's,
    scored on the evaluation's halves and on a fifth of its own halves held
    out of the fit: what ``fit_models`` retrains buy, the empirical ceiling of
    a linear method. Setting (a) retrains the replayed run with 0/1 weights;
    setting (b) trains fresh seeds by the protocol's torch loop. For (b) also
    the seed noise: ``pairs`` halves each trained from two fresh seeds, whose
    outputs' correlation ``ρ`` bounds every predictor's (Pearson) correlation
    with one seed's outputs by ``√ρ`` (:func:`seed_noise_bound`); the LDS is
    Spearman's, which the bound describes only roughly.
    """
    sizes = p.sizes
    r = p.run(p.base_seed, linearize_at)
    r.train()
    replay = r.metagradients(p.targets).cpu().numpy()
    rng = np.random.default_rng(40_000)

    def fresh(num: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        masks = np.stack([subset_mask(rng, p.n_train) for _ in range(num)])
        outs = [p.fresh_train(np.flatnonzero(mk), seed + i) for i, mk in enumerate(masks)]
        return masks, np.stack(outs)

    truths = {
        "same-run": (
            same_run_truth(r, p.targets, sizes.lds_models, seed=10_000),
            same_run_truth(r, p.targets, fit_models, seed=20_000),
        ),
        "fresh-seeds": (p.fresh_truth(False), fresh(fit_models, 50_000)),
    }
    summary: dict[str, Any] = {"linearize_at": linearize_at, "fit_models": fit_models}
    for setting, (evaluation, (masks, outputs)) in truths.items():
        beta, lam = ridge_datamodel(masks, outputs)
        fit, held = held_out_fifth(masks, outputs)
        own, _ = ridge_datamodel(*fit)
        row = {
            "replay": lds(replay, evaluation),
            "datamodel": lds(beta, evaluation),
            "ridge": lam,
            # On the fit set's held-out fifth, more halves than the evaluation's.
            "replay_held_out": lds(replay, held),
            "datamodel_held_out": lds(own, held),
        }
        summary[setting] = row
        emit({"bench": "replay", "protocol": p.name, "part": "ceiling", "setting": setting, **row})
    rng_pairs = np.random.default_rng(60_000)
    outs = np.zeros((2, pairs, sizes.num_targets))
    for h in range(pairs):
        rows = np.flatnonzero(subset_mask(rng_pairs, p.n_train))
        for k in range(2):
            outs[k, h] = p.fresh_train(rows, 70_000 + 2 * h + k)
    rho, bound = seed_noise_bound(outs[0], outs[1])
    noise = {"pairs": pairs, "seed_pair_pearson": round(rho, 4), "bound": round(bound, 4)}
    summary["seed_noise"] = noise
    emit({"bench": "replay", "protocol": p.name, "part": "ceiling", "setting": "noise", **noise})
    return summary


# -- cost ---------------------------------------------------------------------------------
def run_cost(p: Protocol, linearize_at: float) -> dict[str, Any]:
    """Wall and CPU time of one plain training run, and of the reverse pass per query block."""
    r = p.run(p.base_seed, linearize_at)
    t_train, _, _ = timed(r.train)
    t_plain, c_plain, _ = timed(r.retrain)
    # The protocol's own torch loop runs on the CPU: timed there only.
    t_torch = timed(lambda: p.torch_train(p.base_seed))[0] if p.device == "cpu" else None
    summary: dict[str, Any] = {
        "device": p.device,
        "steps": r.settings.num_steps,
        "train_with_checkpoints_s": t_train,
        "plain_train_s": t_plain,
        "plain_train_cpu_s": c_plain,
        "torch_train_s": t_torch,
    }
    cost = {}
    for m in p.sizes.cost_m:
        q = tuple(t[:m] for t in p.targets)
        dt, dc, _ = timed(functools.partial(r.metagradients, q))
        cost[m] = {
            "reverse_s": dt,
            "reverse_cpu_s": dc,
            "per_query_s": dt / m,
            "train_runs": dt / t_plain,
            # The same in CPU seconds: on a loaded machine the wall ratio moves with the load.
            "train_runs_cpu": dc / c_plain,
        }
        emit({"bench": "replay", "protocol": p.name, "part": "cost", "m": m, **cost[m]})
    summary["cost"] = cost
    return summary


def run_ops(p: Protocol, linearize_at: float) -> dict[str, Any]:
    """Aten operations dispatched per step: training, and the reverse for each query block.

    A proxy for CUDA kernel launches, which bound small models on a GPU;
    views are counted too (they launch nothing but cost dispatch time).
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            self.ops += 1
            return func(*args, **(kwargs or {}))

    r = p.run(p.base_seed, linearize_at)
    steps = r.settings.num_steps
    with Count() as count:
        r.train()
    out: dict[str, Any] = {"train_ops_per_step": count.ops / steps}
    for m in p.sizes.cost_m:
        with Count() as count:
            r.metagradients(tuple(t[:m] for t in p.targets))
        out[f"reverse_ops_per_step_m{m}"] = count.ops / steps
        emit(
            {
                "bench": "replay",
                "protocol": p.name,
                "part": "ops",
                "m": m,
                "train_ops_per_step": out["train_ops_per_step"],
                "reverse_ops_per_step": count.ops / steps,
                "ratio": count.ops / steps / out["train_ops_per_step"],
            }
        )
    return out


# -- bergson ------------------------------------------------------------------------------
class _WeightedLoss(nn.Module):
    """``Σ w_i ℓ_i / |B|`` as a module bergson's trainer calls with one batch's keywords.

    The batch's first tensor travels as ``input_ids``: bergson divides micro-batch
    losses by a token count read from it, which is the same for every batch here.
    """

    def __init__(self, model: nn.Module, loss: Callable[..., Tensor]) -> None:
        super().__init__()
        self.model = model
        self.loss = loss

    def forward(self, input_ids: Tensor, example_weight: Tensor, **rest: Tensor) -> Tensor:
        rows = (input_ids, *(rest[f"t{j}"] for j in range(1, len(rest) + 1)))
        losses = self.loss(self.model, *rows)
        return (example_weight * losses).sum() / input_ids.shape[0]


class _Stream:
    """The replay's batch order as the data stream bergson's ``Trainer`` iterates."""

    def __init__(self, data: tuple[Tensor, ...], order: list[Tensor], device: str) -> None:
        self.device = torch.device(device)
        self.data, self.order = tuple(t.to(self.device) for t in data), order
        self.weights = nn.Parameter(torch.ones(int(data[0].shape[0]), device=self.device))

    @property
    def requires_grad(self) -> bool:
        return self.weights.requires_grad

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        self.weights.requires_grad = value

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        idx = self.order[i]
        batch = {"input_ids": self.data[0][idx], "example_weight": self.weights[idx]}
        batch.update({f"t{j}": t[idx] for j, t in enumerate(self.data[1:], start=1)})
        return batch


def _untied(model: nn.Module) -> tuple[nn.Module, list[str]]:
    """``model`` with every tied parameter (GPT-2's ``lm_head.weight``) made a copy of its own.

    bergson's trainer keeps tied names as separate entries of its state, and
    the query gradient's ``functional_call`` refuses tied names given twice;
    both libraries then train the same untied model.
    """
    unique = {n for n, _ in model.named_parameters()}
    tied = [n for n, _ in model.named_parameters(remove_duplicate=False) if n not in unique]
    for name in tied:
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        setattr(module, leaf, nn.Parameter(getattr(module, leaf).detach().clone()))
    if tied and hasattr(model, "config"):
        cast(Any, model).config.tie_word_embeddings = False
    return model, tied


def run_bergson(p: Protocol, linearize_at: float) -> dict[str, Any]:
    """The replay and bergson's MAGIC on the same run: time per query, agreement."""
    import bergson
    import torchopt
    from bergson.magic import BackwardState, Trainer
    from torchopt.pytree import tree_iter

    model, untied = _untied(p.build(p.base_seed))
    model.to(p.device)
    settings = dataclasses.replace(
        p.settings(p.base_seed), linearize_at=linearize_at, subset_loss="full_batch"
    )
    r = ReplayAttributor(copy.deepcopy(model), p.task, p.train_data, settings, progress=False)
    s = r.settings
    t_train, c_train, _ = timed(r.train)
    lrs = torch.tensor(s.lr, dtype=torch.float32, device=p.device)

    def schedule(count: Any) -> Tensor:
        return lrs[count]

    if s.optimizer == "sgd":
        opt = torchopt.sgd(schedule, momentum=s.momentum, weight_decay=s.weight_decay)
    elif s.optimizer == "adamw":
        # bergson's default eps_root (1e-17, inside the square root): at 0 the reverse pass
        # through √v is 0 · ∞ for entries whose gradient is exactly 0 (unused embedding rows).
        opt = torchopt.adamw(
            schedule, betas=s.betas, eps=s.eps, eps_root=1e-17, weight_decay=s.weight_decay
        )
    else:
        raise ValueError(f"no torchopt counterpart for {s.optimizer!r} here")
    trainer, state = Trainer.initialize(
        _WeightedLoss(copy.deepcopy(model), p.per_example_loss), opt
    )
    stream = _Stream(p.train_data, r.order, p.device)
    stream.weights.data.fill_(linearize_at)
    m = p.sizes.bergson_queries
    queries = tuple(t[:m].to(p.device) for t in p.targets)
    task = r.task
    with tempfile.TemporaryDirectory() as tmp:
        tb_train, cb_train, state = timed(
            lambda: trainer.train(state, stream, save_dir=tmp, save_mode="sqrt")
        )
        final = {k.removeprefix("model."): v.detach().clone() for k, v in state.params.items()}
        ours = r._require_trained()
        params_diff = max(float((final[n] - ours[n]).abs().max()) for n in ours)
        zeros = [
            torch.zeros_like(b)
            for b in tree_iter(state.opt_state)
            if isinstance(b, torch.Tensor) and b.is_floating_point()
        ]
        theirs, tb, cb = [], 0.0, 0.0
        for j in range(m):
            example = tuple(t[j] for t in queries)

            def out(params: dict[str, Tensor], example: tuple[Tensor, ...] = example) -> Tensor:
                return task.get_output(model, params, r.buffers, *example)

            cot = torch.func.grad(out)(final)
            state.detach_()
            for k, v in final.items():
                state.params[f"model.{k}"].copy_(v)
            stream.weights.grad = None
            stream.requires_grad = True
            seed = BackwardState(
                {f"model.{k}": v for k, v in cot.items()},
                [z.clone() for z in zeros],
                torch.zeros_like(stream.weights),
            )
            dt, dc, bwd = timed(
                functools.partial(
                    trainer.backward,
                    tmp,
                    stream,
                    seed,
                    state,
                    cleanup=False,
                    inplace=True,
                    save_mode="sqrt",
                )
            )
            tb, cb = tb + dt, cb + dc
            theirs.append(bwd.weight_grads.detach().double().cpu())
    theirs_m = torch.stack(theirs, 1).numpy()
    r.metagradients(tuple(t[:1] for t in p.targets))  # warm-up, as bergson's first query
    t1, c1, g1 = timed(lambda: r.metagradients(tuple(t[:1] for t in p.targets)))
    q16 = tuple(t[:16] for t in p.targets)
    n16 = int(q16[0].shape[0])
    t16, c16, g16 = timed(lambda: r.metagradients(q16))
    ours_m = g16[:, :m].double().cpu().numpy()
    corr = [float(np.corrcoef(ours_m[:, j], theirs_m[:, j])[0, 1]) for j in range(m)]
    rel = float(np.abs(ours_m - theirs_m).max() / np.abs(theirs_m).max())
    per_query_b, per_query_bc = tb / m, cb / m
    record = {
        "device": p.device,
        "eps_root": 1e-17 if s.optimizer == "adamw" else None,
        "untied": untied,
        "bergson_version": bergson.__version__ if hasattr(bergson, "__version__") else "2.5.1",
        "steps": s.num_steps,
        "n_train": r.n_train,
        "parameters": sum(v.numel() for v in ours.values()),
        "linearize_at": linearize_at,
        "bergson_train_s": tb_train,
        "bergson_train_cpu_s": cb_train,
        "replay_train_s": t_train,
        "replay_train_cpu_s": c_train,
        "final_params_max_abs_diff": params_diff,
        "bergson_per_query_s": per_query_b,
        "bergson_per_query_cpu_s": per_query_bc,
        "replay_m1_s": t1,
        "replay_m1_cpu_s": c1,
        f"replay_m{n16}_s": t16,
        f"replay_m{n16}_cpu_s": c16,
        "ratio_m1": t1 / per_query_b,
        f"ratio_m{n16}": t16 / (n16 * per_query_b),
        f"ratio_m{n16}_cpu": c16 / (n16 * per_query_bc),
        "corr": corr,
        "max_rel_diff": rel,
        "agree_m1_vs_block": float((g1[:, 0] - g16[:, 0]).abs().max()),
    }
    emit({"bench": "replay", "protocol": p.name, "part": "bergson", **record})
    return record


# -- report -------------------------------------------------------------------------------
def _with_interval(value: float, interval: list[float]) -> str:
    """``0.470 [0.41, 0.52]``: a value and its 95 % interval."""
    return f"{value:.3f} [{interval[0]:.2f}, {interval[1]:.2f}]"


def format_table(summary: dict[str, Any]) -> str:
    """The closing table: LDS per method and setting, cost per query, bergson."""
    lines = [f"protocol {summary['protocol']}"]
    if "lds" in summary:
        cpu = summary.get("cpu_s", {})
        lines.append(
            f"{'method':<26}{'LDS same-run [95 %]':>24}{'LDS fresh-seeds [95 %]':>26}{'CPU s':>9}"
        )
        for name, row in summary["lds"].items():
            cost = f"{cpu[name]:>9.1f}" if name in cpu else f"{'':>9}"
            cells = "".join(
                f"{_with_interval(row[k], row[k + '_ci95']):>{w}}"
                for k, w in (("same-run", 24), ("fresh-seeds", 26))
            )
            lines.append(f"{name:<26}{cells}{cost}")
        for name, settings in summary.get("lds_diff", {}).items():
            for setting, d in settings.items():
                lines.append(
                    f"{name} minus {d['minus']}, {setting}: {_with_interval(d['diff'], d['ci95'])}"
                )
    if "removal" in summary:
        for keep, value in summary["removal"].items():
            lines.append(f"same-run LDS, subsets keeping {keep} of the rows: {value:.3f}")
    if "cost" in summary:
        c = summary["cost"]
        torch_loop = (
            "" if c["torch_train_s"] is None else f", {c['torch_train_s']:.2f} s by the torch loop"
        )
        lines.append(
            f"one training run ({c['steps']} steps) on {c['device']}: {c['plain_train_s']:.2f} s "
            f"by the replay's functional loop{torch_loop}"
        )
        for m, row in c["cost"].items():
            lines.append(
                f"m={m:<4} reverse {row['reverse_s']:.2f} s ({row['reverse_cpu_s']:.2f} CPU s), "
                f"{row['per_query_s']:.3f} s/query, {row['train_runs']:.1f} training runs "
                f"({row['train_runs_cpu']:.1f} by CPU time)"
            )
    if "ops" in summary:
        ops = summary["ops"]
        lines.append(f"aten ops per step: training {ops['train_ops_per_step']:.0f}")
        for key, value in ops.items():
            if key.startswith("reverse_ops_per_step_m"):
                m = key.removeprefix("reverse_ops_per_step_m")
                ratio = value / ops["train_ops_per_step"]
                lines.append(f"m={m:<4} reverse {value:.0f} ops per step ({ratio:.2f}x training)")
    if "ceiling" in summary:
        c = summary["ceiling"]
        for setting in ("same-run", "fresh-seeds"):
            row = c[setting]
            lines.append(
                f"{setting}: replay {row['replay']:.3f}, datamodel of {c['fit_models']} retrains "
                f"{row['datamodel']:.3f} (on held-out halves of the fit: replay "
                f"{row['replay_held_out']:.3f}, datamodel {row['datamodel_held_out']:.3f})"
            )
        n = c["seed_noise"]
        lines.append(
            f"two seeds of one half correlate {n['seed_pair_pearson']:.3f} over {n['pairs']} "
            f"halves: no predictor of one seed's outputs correlates above {n['bound']:.3f}"
        )
    if "bergson" in summary:
        b = summary["bergson"]
        n = next(k for k in b if k.startswith("ratio_m") and k != "ratio_m1" and "cpu" not in k)
        lines.append(
            f"bergson MAGIC {b['bergson_per_query_s']:.2f} s/query "
            f"({b['bergson_per_query_cpu_s']:.2f} CPU s); replay m=1 {b['replay_m1_s']:.2f} s, "
            f"{n.removeprefix('ratio_')} ratio {b[n]:.3f} (CPU {b[n + '_cpu']:.3f}); "
            f"corr {min(b['corr']):.6f}, params diff {b['final_params_max_abs_diff']:.2e}"
        )
    return "\n".join(lines)
