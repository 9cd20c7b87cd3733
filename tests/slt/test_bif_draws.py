"""Bayesian influence: the statistic against numpy float64 covariances of the same draws."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from gradsketch.slt import (
    LossDraws,
    bayesian_influence,
    bif_from_draws,
    sample_loss_draws,
)

N, M = 16, 5


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, 3, generator=g, dtype=torch.float64)
    y = torch.randint(0, 2, (N,), generator=g)
    return model, x, y


def _loss(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1], reduction="none")


def _margin(model, batch):
    logits = model(batch[0])
    right = logits.gather(1, batch[1].reshape(-1, 1)).squeeze(1)
    return right - logits.gather(1, (1 - batch[1]).reshape(-1, 1)).squeeze(1)


SAMPLER = dict(
    num_chains=3, num_draws=6, lr=1e-3, nbeta=8.0, localization=10.0, batch_size=4, progress=False
)


def _draws(**kwargs):
    model, x, y = _setup()
    return sample_loss_draws(model, (x, y), (x[:M], y[:M]), _loss, seed=3, **{**SAMPLER, **kwargs})


@pytest.mark.parametrize("reduce", ["stack", "mean"])
@pytest.mark.parametrize("covariance", [True, False])
def test_bif_equals_numpy_statistic_of_the_same_draws(reduce, covariance):
    draws = _draws()
    a, b = draws.train.numpy(), draws.query.numpy()
    if reduce == "stack":
        x, y = a.reshape(-1, N), b.reshape(-1, M)
    else:
        x, y = a.mean(0), b.mean(0)
    joint = np.concatenate([x, y], axis=1).T  # variables in rows
    full = np.cov(joint, ddof=1) if covariance else np.corrcoef(joint)
    ref = -full[:N, N:]
    got = bif_from_draws(draws, compute_covariance=covariance, reduce_chain_dimension_method=reduce)
    assert got.dtype == torch.float64
    np.testing.assert_allclose(got.numpy(), ref, rtol=1e-10, atol=1e-14)


def test_draws_are_the_losses_at_the_sampled_weights():
    """One chain, one step per draw: replaying the same SGLD steps gives the same losses."""
    from gradsketch.sampling import SGMCMC

    model, x, y = _setup()
    draws = sample_loss_draws(
        model,
        (x, y),
        (x[:M], y[:M]),
        _loss,
        query_fn=_margin,
        num_chains=1,
        num_draws=3,
        lr=1e-3,
        nbeta=8.0,
        localization=10.0,
        batch_size=N,
        seed=5,
        progress=False,
    )
    replay = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(5)
    opt = SGMCMC.sgld(list(replay.parameters()), lr=1e-3, nbeta=8.0, localization=10.0)
    for t in range(3):
        order = torch.randperm(N, generator=gen)  # the full batch, in a shuffled order
        opt.zero_grad(set_to_none=True)
        _loss(replay, (x[order], y[order])).mean().backward()
        opt.step(noise_generator=gen)
        with torch.no_grad():
            torch.testing.assert_close(draws.train[0, t], _loss(replay, (x, y)), rtol=0, atol=0)
            torch.testing.assert_close(
                draws.query[0, t], _margin(replay, (x[:M], y[:M])), rtol=0, atol=0
            )
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), _setup()[0].parameters()))


def test_bayesian_influence_is_bif_of_the_draws_and_diagonal_is_minus_variance():
    model, x, y = _setup()
    scores = bayesian_influence(model, (x, y), (x[:M], y[:M]), _loss, seed=3, **SAMPLER)
    draws = _draws()
    torch.testing.assert_close(scores, bif_from_draws(draws), rtol=0, atol=0)
    var = draws.train.reshape(-1, N).var(0, correction=1)[:M]
    torch.testing.assert_close(scores[:M].diagonal(), -var, rtol=1e-12, atol=0)


def test_dataset_and_dataloader_inputs_give_the_same_draws_as_tensors():
    model, x, y = _setup()
    kwargs = {**SAMPLER, "batch_size": N}  # one full batch per step: order-free losses
    ref = sample_loss_draws(model, (x, y), (x[:M], y[:M]), _loss, seed=1, **kwargs)
    ds = TensorDataset(x, y)
    via_ds = sample_loss_draws(model, ds, TensorDataset(x[:M], y[:M]), _loss, seed=1, **kwargs)
    torch.testing.assert_close(via_ds.train, ref.train, rtol=1e-12, atol=1e-12)
    loader = DataLoader(ds, batch_size=N, shuffle=False)
    via_loader = sample_loss_draws(model, loader, (x[:M], y[:M]), _loss, seed=1, **kwargs)
    assert via_loader.train.shape == (3, 6, N)


def test_checkpoint_ensemble_is_the_mean_of_each_checkpoints_bif():
    model, x, y = _setup()
    states = [_setup(seed=s)[0].state_dict() for s in (0, 1)]
    both = bayesian_influence(
        model, (x, y), (x[:M], y[:M]), _loss, checkpoints=states, seed=3, **SAMPLER
    )
    parts = []
    for k, state in enumerate(states):
        member = _setup()[0]
        member.load_state_dict(state)
        parts.append(
            bayesian_influence(
                member, (x, y), (x[:M], y[:M]), _loss, seed=3 + k * SAMPLER["num_chains"], **SAMPLER
            )
        )
    torch.testing.assert_close(both, (parts[0] + parts[1]) / 2, rtol=1e-12, atol=0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_chains": 0}, "`num_chains` must be an int >= 1"),
        ({"num_draws": 1, "num_chains": 1}, "`num_draws` must be an int >= 2"),
        ({"num_steps_bw_draws": 0}, "`num_steps_bw_draws` must be an int >= 1"),
        ({"batch_size": 0}, "`batch_size` must be an int >= 1"),
    ],
    ids=["chains", "draws", "steps-between", "batch"],
)
def test_invalid_sampler_arguments(kwargs, match):
    model, x, y = _setup()
    with pytest.raises(ValueError, match=match):
        sample_loss_draws(model, (x, y), (x, y), _loss, **{**SAMPLER, **kwargs})


def test_invalid_inputs_and_statistics():
    model, x, y = _setup()
    with pytest.raises(ValueError, match="must return one value per example"):
        sample_loss_draws(
            model, (x, y), (x, y), lambda m, b: F.cross_entropy(m(b[0]), b[1]), **SAMPLER
        )
    with pytest.raises(ValueError, match="share their first dimension"):
        sample_loss_draws(model, (x, y[:3]), (x, y), _loss, **SAMPLER)
    with pytest.raises(TypeError, match="must be a tuple of tensors"):
        sample_loss_draws(model, 3, (x, y), _loss, **SAMPLER)
    draws = LossDraws(torch.zeros(2, 1, 3), torch.zeros(2, 1, 2))
    with pytest.raises(ValueError, match="`reduce_chain_dimension_method` must be one of"):
        bif_from_draws(draws, reduce_chain_dimension_method="median")
    with pytest.raises(ValueError, match="a covariance needs at least 2"):
        bif_from_draws(draws, reduce_chain_dimension_method="mean")
    with pytest.raises(ValueError, match="same chains and draws"):
        bif_from_draws(LossDraws(torch.zeros(2, 3, 3), torch.zeros(2, 2, 2)))
    with pytest.raises(ValueError, match="`checkpoints` is empty"):
        bayesian_influence(model, (x, y), (x, y), _loss, checkpoints=[], **SAMPLER)
    with pytest.raises(TypeError, match=r"bayesian_influence\(\) got unexpected keyword .*'lrr'"):
        bayesian_influence(model, (x, y), (x, y), _loss, lrr=1e-3)


def test_a_diverging_chain_is_refused_naming_the_chain_and_the_fix():
    """A squared output under a step size of 1e60 grows by ~1e60 a step and overflows
    float64 (1.8e308) within a few steps: the sampler stops there instead of filling the
    draws with NaN."""
    from gradsketch.slt import NonFiniteLossError

    def squared(model, batch):
        return model(batch[0]).pow(2).sum(1)

    model, x, y = _setup()
    with pytest.raises(
        NonFiniteLossError,
        match=r"chain 0: .* is NaN or infinite after \d+ steps: the chain diverged; lower "
        r"`lr` \(try lr=1e\+59\) or raise `localization`",
    ):
        sample_loss_draws(model, (x, y), (x[:M], y[:M]), squared, seed=3, **{**SAMPLER, "lr": 1e60})


def test_a_non_finite_loss_at_the_start_is_refused():
    from gradsketch.slt import NonFiniteLossError

    def nan_loss(model, batch):
        return _loss(model, batch) * float("nan")

    model, x, y = _setup()
    with pytest.raises(
        NonFiniteLossError,
        match=r"chain 0: the minibatch loss is NaN or "
        r"infinite at the model's own weights: check them and `loss_fn`",
    ):
        sample_loss_draws(model, (x, y), (x[:M], y[:M]), nan_loss, seed=3, **SAMPLER)


def test_a_non_finite_query_value_is_refused_at_its_draw():
    from gradsketch.slt import NonFiniteLossError

    def inf_query(model, batch):
        return _margin(model, batch) + float("inf")

    model, x, y = _setup()
    with pytest.raises(NonFiniteLossError, match=r"chain 0: `query_fn` at draw 0 is NaN"):
        sample_loss_draws(
            model, (x, y), (x[:M], y[:M]), _loss, query_fn=inf_query, seed=3, **SAMPLER
        )
