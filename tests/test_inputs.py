"""A model's input expectations, checked before any forward pass (gradsketch._inputs)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradsketch._inputs import check_labels, check_model_inputs, class_count
from gradsketch.errors import BatchFormatError


def _cnn() -> nn.Sequential:
    # The digits CNN's layout: flat [B, 64] inputs reshaped by the first (parameter-free) module.
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 4, 3), nn.Flatten(), nn.Linear(144, 10)
    )


GOOD = [
    pytest.param(nn.Sequential(nn.Linear(4, 3)), torch.zeros(2, 4), id="linear"),
    pytest.param(nn.Sequential(nn.Linear(4, 3)), torch.zeros(2, 7, 4), id="linear-tokens"),
    pytest.param(nn.Sequential(nn.Flatten(), nn.Linear(12, 3)), torch.zeros(2, 3, 4), id="flatten"),
    pytest.param(_cnn(), torch.zeros(2, 64), id="unflatten-conv"),
    pytest.param(nn.Sequential(nn.Embedding(5, 3)), torch.tensor([[0, 4]]), id="embedding"),
    pytest.param(nn.Linear(4, 3), torch.zeros(2, 9), id="not-a-chain-is-not-read"),
    pytest.param(
        nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 3)), torch.zeros(2, 9), id="norm-first"
    ),
]


@pytest.mark.parametrize("model, x", GOOD)
def test_inputs_the_model_takes_pass(model, x):
    check_model_inputs(model, x, argument="x")


BAD = [
    pytest.param(
        nn.Sequential(nn.Linear(4, 3)),
        torch.zeros(2, 5),
        r"5 features per example.*expects 4",
        id="width",
    ),
    pytest.param(
        nn.Sequential(nn.Flatten(), nn.Linear(12, 3)),
        torch.zeros(2, 3, 5),
        r"15 features per example \(after Flatten\).*expects 12",
        id="width-after-flatten",
    ),
    pytest.param(_cnn(), torch.zeros(2, 63), r"`x` has shape \(2, 63\)", id="cnn-width"),
    pytest.param(
        nn.Sequential(nn.Conv2d(3, 4, 3)),
        torch.zeros(2, 1, 8, 8),
        r"expects \[batch, 3 channels, 2 spatial dims\]",
        id="channels",
    ),
    pytest.param(
        nn.Sequential(nn.Linear(4, 3)),
        torch.zeros(2, 4, dtype=torch.float64),
        r"`x` is torch\.float64 but the model's parameters are torch\.float32",
        id="dtype",
    ),
    pytest.param(
        nn.Sequential(nn.Linear(4, 3)),
        torch.zeros(2, 4, dtype=torch.long),
        r"holds torch\.int64 values.*`x\.to\(torch\.float32\)`",
        id="integer-inputs",
    ),
    pytest.param(
        nn.Sequential(nn.Embedding(5, 3)),
        torch.tensor([[0, 5]]),
        r"holds index 5, but the model's first layer '0' \(Embedding\(5, 3\)\) has 5 rows",
        id="index-range",
    ),
    pytest.param(
        nn.Sequential(nn.Embedding(5, 3)),
        torch.zeros(1, 2),
        r"looks up integer indices",
        id="float-indices",
    ),
]


@pytest.mark.parametrize("model, x, message", BAD)
def test_inputs_the_model_cannot_take_are_named(model, x, message):
    with pytest.raises(BatchFormatError, match=message):
        check_model_inputs(model, x, argument="x")


def test_class_count_and_label_range():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 10))
    assert class_count(model) == 10
    assert class_count(nn.Linear(4, 10)) is None  # not a chain: not read
    check_labels(torch.tensor([0, 9]), 10, argument="y")
    with pytest.raises(BatchFormatError, match=r"`y` holds label 10, but the model has 10 classes"):
        check_labels(torch.tensor([0, 10]), 10, argument="y")
    with pytest.raises(BatchFormatError, match=r"`y` holds label -2"):
        check_labels(torch.tensor([-2, 1]), None, argument="y")


def test_apply_factorization_names_calibration_data_of_the_wrong_width():
    from gradsketch.factorize import apply_factorization

    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(
        BatchFormatError,
        match=r"`calibration_data` has shape \(4, 63\): 63 features per example, but the model's "
        r"first layer '0' .*expects 64",
    ):
        apply_factorization(
            model, min_features=32, latent_features=8, calibration_data=torch.randn(4, 63)
        )
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # untouched
