"""Bayesian influence from SGMCMC draws (per-example losses, any architecture).

Kreer et al., "Bayesian Influence Functions for Hessian-Free Data
Attribution" (2025): under the localized tempered posterior
``p(w) ∝ exp(-nβ Σ_i ℓ_i(w) - γ/2 |w - w*|²)`` around the trained weights
``w*``, upweighting training example ``i`` by ``ε`` changes the posterior mean
of an observable ``φ`` by ``-nβ ε Cov(ℓ_i, φ)``. So the Bayesian influence of
training example ``i`` on query ``j`` is

    BIF[i, j] = -Cov_w(ℓ_i(w), φ_j(w))

estimated over SGLD draws (:meth:`gradsketch.sampling.SGMCMC.sgld`). No
per-example gradient and no Hessian is formed: each draw costs one forward
pass over the training and query rows, so it works for any architecture.

It lives in :mod:`gradsketch.slt` because it stands on the sampler
(DESIGN.md's floors: ``slt`` on ``sampling``; ``attribution`` and
``sampling`` never import each other). Where :func:`gradsketch.slt.bif`
reads devinterp's per-token store of a language model, these functions take
any model, a per-example ``loss_fn`` and rows in memory.

The statistic follows devinterp's ``bif`` (and :func:`gradsketch.slt.bif`):
covariance with ``ddof=1`` or Pearson correlation (``compute_covariance``),
chains pooled (``"stack"``: one series of ``chains * draws``, centred on the
pooled mean) or averaged first (``"mean"``: the chain-mean series over
draws). devinterp returns the statistic itself; here it is negated so that,
with a query observable that grows with the query's fit (a margin, a
log-likelihood), proponents score positive, as in TRAK and
:class:`~gradsketch.attribution.InfluenceComputer`. With the query's *loss*
as observable (the default), proponents score negative.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, default_collate
from tqdm.auto import tqdm

from gradsketch.sampling import SGMCMC, DrawSchedule, default_nbeta, run_chain
from gradsketch.slt._data import NonFiniteLossError, nonfinite_cause

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["LossDraws", "bayesian_influence", "bif_from_draws", "sample_loss_draws"]

#: ``loss_fn(model, batch) -> [B]`` per-example values.
PerExampleFn = Callable[[nn.Module, Sequence[Any]], Tensor]
_REDUCTIONS = ("stack", "mean")


@dataclass
class LossDraws:
    """Per-example observables at every draw.

    Attributes:
        train: ``[chains, draws, n_train]`` float64 training losses.
        query: ``[chains, draws, n_query]`` float64 query observables.
    """

    train: Tensor
    query: Tensor


class _Rows:
    """Ordered and shuffled batches of a tuple of tensors, a Dataset or a DataLoader."""

    def __init__(self, data: Any, name: str, batch_size: int) -> None:
        self.loader: DataLoader[Any] | None = data if isinstance(data, DataLoader) else None
        source = data.dataset if isinstance(data, DataLoader) else data
        self.tensors: tuple[Tensor, ...] | None = None
        self.dataset: Dataset[Any] | None = None
        if (
            isinstance(source, (tuple, list))
            and source
            and all(isinstance(t, Tensor) for t in source)
        ):
            self.tensors = tuple(source)
            sizes = {int(t.shape[0]) for t in self.tensors}
            if len(sizes) != 1:
                raise ValueError(
                    f"`{name}` tensors must share their first dimension, got "
                    f"{[tuple(t.shape) for t in self.tensors]}."
                )
            self.n = sizes.pop()
        elif hasattr(source, "__getitem__") and hasattr(source, "__len__"):
            self.dataset = source
            self.n = len(source)
        else:
            raise TypeError(
                f"`{name}` must be a tuple of tensors, a map-style Dataset or a DataLoader over "
                f"one, got {type(data).__name__}."
            )
        if self.n < 1:
            raise ValueError(f"`{name}` is empty; pass at least one example.")
        self.batch_size = batch_size

    def ordered(self) -> Iterator[Sequence[Any]]:
        if self.tensors is not None:
            for start in range(0, self.n, self.batch_size):
                yield tuple(t[start : start + self.batch_size] for t in self.tensors)
            return
        assert self.dataset is not None
        yield from DataLoader(self.dataset, batch_size=self.batch_size, shuffle=False)

    def shuffled(self, generator: torch.Generator) -> Iterator[Sequence[Any]]:
        """Endless minibatches: the user's DataLoader as given, else reshuffled each pass.

        Tensors and Datasets draw the same permutations from ``generator``, so
        both give the same chains.
        """
        while True:
            if self.loader is not None:
                yield from self.loader
                continue
            order = torch.randperm(self.n, generator=generator)
            for start in range(0, self.n, self.batch_size):
                idx = order[start : start + self.batch_size]
                if self.tensors is not None:
                    yield tuple(t[idx.to(t.device)] for t in self.tensors)
                else:
                    assert self.dataset is not None
                    yield default_collate([self.dataset[int(i)] for i in idx])


def _check_int(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"`{name}` must be an int >= {low}, got {value!r}.")
    return value


@torch.no_grad()
def _evaluate(model: nn.Module, rows: _Rows, fn: PerExampleFn, name: str) -> Tensor:
    parts = []
    for batch in rows.ordered():
        out = fn(model, batch)
        size = int(batch[0].shape[0])
        if not isinstance(out, Tensor) or out.shape != (size,):
            raise ValueError(
                f"`{name}` must return one value per example, shape ({size},), got "
                f"{getattr(out, 'shape', type(out).__name__)}; reduce with reduction='none'."
            )
        parts.append(out.detach().double().cpu())
    return torch.cat(parts)


def _sample_chain(
    sampler: nn.Module,
    opt: torch.optim.Optimizer,
    schedule: DrawSchedule,
    gen: torch.Generator,
    *,
    steps: _Rows,
    rows: tuple[_Rows, _Rows],
    fns: tuple[PerExampleFn, PerExampleFn],
    out: tuple[Tensor, Tensor],
    tick: Callable[[], object],
    chain: int = 0,
    lr: float = 1e-4,
) -> None:
    """One chain of :func:`sample_loss_draws`: ``gen`` draws its minibatches and its noise.

    Fills ``out`` (``[draws, n_train]``, ``[draws, n_query]``) with the
    per-example values of ``rows`` under ``fns`` at every draw. A NaN or
    infinite minibatch loss or drawn value raises :class:`NonFiniteLossError`
    naming the chain and the step, before the sampler steps on it.
    """
    batches = steps.shuffled(gen)

    def diverged(step: int, what: str) -> NonFiniteLossError:
        return NonFiniteLossError(
            f"chain {chain}: {what} is NaN or infinite {nonfinite_cause(step, lr)}."
        )

    def step_loss(step: int) -> Tensor:
        with torch.enable_grad():
            loss = fns[0](sampler, next(batches)).mean()
            loss.backward()
        return loss.detach()

    def on_draw(draw: int, step: int, loss: Tensor) -> None:
        for k, (name, rows_k) in enumerate(zip(("loss_fn", "query_fn"), rows, strict=True)):
            values = _evaluate(sampler, rows_k, fns[k], name)
            if not bool(torch.isfinite(values).all()):
                raise diverged(step + 1, f"`{name}` at draw {draw}")
            out[k][draw] = values

    run_chain(
        opt,
        step_loss,
        schedule,
        noise_generator=gen,
        nonfinite_error=lambda step, loss: diverged(step, "the minibatch loss"),
        on_draw=on_draw,
        tick=tick,
    )


def sample_loss_draws(
    model: nn.Module,
    train: Any,
    query: Any,
    loss_fn: PerExampleFn,
    *,
    query_fn: PerExampleFn | None = None,
    num_chains: int = 4,
    num_draws: int = 100,
    num_burnin_steps: int = 0,
    num_steps_bw_draws: int = 1,
    lr: float = 1e-4,
    nbeta: float | None = None,
    localization: float = 100.0,
    batch_size: int = 64,
    eval_batch_size: int = 1024,
    seed: int = 0,
    progress: bool = True,
) -> LossDraws:
    """Run SGLD chains from ``model``'s weights; record every example's loss at each draw.

    Each chain samples a copy of ``model`` (left unchanged) with
    :meth:`~gradsketch.sampling.SGMCMC.sgld` on minibatches of ``train``
    (mean of ``loss_fn``), localized at the starting weights. After every
    ``num_steps_bw_draws`` steps past the burn-in, the per-example losses of
    all of ``train`` and the observables of all of ``query`` are evaluated.

    Args:
        model: the trained network (evaluated in eval mode).
        train: training rows: a tuple of tensors, a map-style Dataset, or a
            DataLoader (its batches drive the sampler; its dataset, in
            order, is evaluated).
        query: query rows, in the same forms.
        loss_fn: ``(model, batch) -> [B]`` per-example training loss.
        query_fn: ``(model, batch) -> [B]`` query observable (default ``loss_fn``).
        num_chains: independent chains.
        num_draws: draws per chain.
        num_burnin_steps: steps before the first draw.
        num_steps_bw_draws: steps between draws.
        lr: SGLD step size.
        nbeta: inverse temperature times n (default
            :func:`~gradsketch.sampling.default_nbeta` of ``batch_size``).
        localization: γ of the localizing prior.
        batch_size: sampler minibatch size (ignored for a DataLoader ``train``).
        eval_batch_size: batch size of the per-draw evaluations.
        seed: chain ``c`` uses ``torch.Generator().manual_seed(seed + c)`` for
            its minibatches and noise.
        progress: show a tqdm bar.

    Returns:
        :class:`LossDraws` (float64).
    """
    _check_int("num_chains", num_chains, 1)
    _check_int("num_draws", num_draws, 2 if num_chains == 1 else 1)
    _check_int("num_burnin_steps", num_burnin_steps, 0)
    _check_int("num_steps_bw_draws", num_steps_bw_draws, 1)
    _check_int("batch_size", batch_size, 1)
    _check_int("eval_batch_size", eval_batch_size, 1)
    query_fn = loss_fn if query_fn is None else query_fn
    train_rows = _Rows(train, "train", eval_batch_size)
    query_rows = _Rows(query, "query", eval_batch_size)
    step_rows = _Rows(train, "train", batch_size)
    nbeta = default_nbeta(batch_size) if nbeta is None else nbeta
    # Each draw evaluates the weights after its step's update (w_{b + (k+1) d}).
    schedule = DrawSchedule(num_draws, num_burnin_steps, num_steps_bw_draws, after_update=True)
    train_out = torch.empty(num_chains, num_draws, train_rows.n, dtype=torch.float64)
    query_out = torch.empty(num_chains, num_draws, query_rows.n, dtype=torch.float64)
    bar = tqdm(total=num_chains * schedule.num_steps, desc="BIF sampling", disable=not progress)
    for chain in range(num_chains):
        sampler = copy.deepcopy(model).eval()
        params = [p for p in sampler.parameters() if p.requires_grad]
        opt = SGMCMC.sgld(params, lr=lr, nbeta=nbeta, localization=localization)
        _sample_chain(
            sampler,
            opt,
            schedule,
            torch.Generator().manual_seed(seed + chain),
            steps=step_rows,
            rows=(train_rows, query_rows),
            fns=(loss_fn, query_fn),
            out=(train_out[chain], query_out[chain]),
            tick=bar.update,
            chain=chain,
            lr=lr,
        )
    bar.close()
    return LossDraws(train_out, query_out)


def bif_from_draws(
    draws: LossDraws,
    *,
    compute_covariance: bool = True,
    reduce_chain_dimension_method: str = "stack",
) -> Tensor:
    """``-Cov`` (or ``-Corr``) over draws of every (training loss, query observable) pair.

    Args:
        draws: :class:`LossDraws` ``[chains, draws, n]`` and ``[chains, draws, m]``.
        compute_covariance: covariance (``ddof=1``); ``False``: Pearson correlation.
        reduce_chain_dimension_method: ``"stack"`` pools chains and draws into
            one series; ``"mean"`` averages over chains, then uses the draws.

    Returns:
        ``[n_train, n_query]`` float64. A constant series gives NaN correlations.

    Example:
        >>> train = torch.tensor([[[1.0, 2.0], [2.0, 2.0], [3.0, 2.0]]]).double()  # 1 chain
        >>> query = torch.tensor([[[0.0], [1.0], [2.0]]]).double()
        >>> bif_from_draws(LossDraws(train, query))
        tensor([[-1.],
                [-0.]], dtype=torch.float64)
    """
    if reduce_chain_dimension_method not in _REDUCTIONS:
        raise ValueError(
            f"`reduce_chain_dimension_method` must be one of {list(_REDUCTIONS)}, got "
            f"{reduce_chain_dimension_method!r}."
        )
    a, b = draws.train.double(), draws.query.double()
    if a.dim() != 3 or b.dim() != 3 or a.shape[:2] != b.shape[:2]:
        raise ValueError(
            f"`draws` must hold [chains, draws, n] arrays with the same chains and draws, got "
            f"{tuple(a.shape)} and {tuple(b.shape)}."
        )
    if reduce_chain_dimension_method == "stack":
        x, y = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    else:
        x, y = a.mean(0), b.mean(0)
    if x.shape[0] < 2:
        raise ValueError(
            f"{x.shape[0]} observation per series after reducing chains; a covariance needs at "
            "least 2 (more draws, or reduce_chain_dimension_method='stack')."
        )
    xc, yc = x - x.mean(0), y - y.mean(0)
    cov = xc.T @ yc / (x.shape[0] - 1)
    if not compute_covariance:
        sx = xc.pow(2).sum(0).div(x.shape[0] - 1).sqrt()
        sy = yc.pow(2).sum(0).div(x.shape[0] - 1).sqrt()
        cov = cov / torch.outer(sx, sy)
    return -cov


class DrawOptions(TypedDict, total=False):
    """The keywords :func:`bayesian_influence` passes on to :func:`sample_loss_draws`.

    Their meaning and defaults are :func:`sample_loss_draws`'s.
    """

    query_fn: PerExampleFn | None
    num_draws: int
    num_burnin_steps: int
    num_steps_bw_draws: int
    lr: float
    nbeta: float | None
    localization: float
    batch_size: int
    eval_batch_size: int
    progress: bool


def bayesian_influence(
    model: nn.Module,
    train: Any,
    query: Any,
    loss_fn: PerExampleFn,
    *,
    checkpoints: Sequence[Mapping[str, Any]] | None = None,
    num_chains: int = 4,
    seed: int = 0,
    compute_covariance: bool = True,
    reduce_chain_dimension_method: str = "stack",
    **draws: Unpack[DrawOptions],
) -> Tensor:
    """Bayesian influence ``-Cov(ℓ_train_i, φ_query_j)`` over SGLD draws (Kreer et al. 2025).

    :func:`sample_loss_draws` then :func:`bif_from_draws`; with
    ``checkpoints`` (state dicts of ``model``'s architecture), the mean over
    checkpoints of each one's BIF, chains seeded ``seed + k * num_chains + c``.
    See the module docstring for the sign and the statistic; the arguments
    are those two functions'.

    Returns:
        ``[n_train, n_query]`` float64 scores.

    Example:
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> model = torch.nn.Linear(3, 2)
        >>> x, y = torch.randn(20, 3), torch.arange(20) % 2
        >>> def loss(m, batch):
        ...     return torch.nn.functional.cross_entropy(m(batch[0]), batch[1], reduction="none")
        >>> bif = bayesian_influence(model, (x, y), (x[:4], y[:4]), loss, num_chains=2,
        ...                          num_draws=10, lr=1e-3, nbeta=10.0, progress=False)
        >>> tuple(bif.shape), bool((bif[:4].diagonal() <= 0).all())  # -Var on the diagonal
        ((20, 4), True)
    """
    unknown = sorted(set(draws) - set(DrawOptions.__annotations__))
    if unknown:
        raise TypeError(
            f"bayesian_influence() got unexpected keyword arguments {unknown}; besides its own "
            f"it takes sample_loss_draws's: {sorted(DrawOptions.__annotations__)}."
        )
    stat: dict[str, Any] = dict(
        compute_covariance=compute_covariance,
        reduce_chain_dimension_method=reduce_chain_dimension_method,
    )
    if checkpoints is None:
        drawn = sample_loss_draws(
            model, train, query, loss_fn, num_chains=num_chains, seed=seed, **draws
        )
        return bif_from_draws(drawn, **stat)
    if not checkpoints:
        raise ValueError("`checkpoints` is empty; pass None to sample around `model` itself.")
    total: Tensor | None = None
    for k, state in enumerate(checkpoints):
        member = copy.deepcopy(model)
        member.load_state_dict(state)
        drawn = sample_loss_draws(
            member,
            train,
            query,
            loss_fn,
            num_chains=num_chains,
            seed=seed + k * num_chains,
            **draws,
        )
        one = bif_from_draws(drawn, **stat)
        total = one if total is None else total + one
    assert total is not None
    return total / len(checkpoints)
