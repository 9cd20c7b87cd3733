"""Sample config for `gradsketch factorize examples/factorize_config.py`.

A config defines `model` (or `build_model()`), `calibration_data` (one batch
the model is called on) and, optionally, any setting of `apply_factorization`.
"""

import torch
from torch import nn


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 64, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(64, 64, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(64 * 8 * 8, 256),
        nn.ReLU(),
        nn.Linear(256, 10),
    )


calibration_data = torch.randn(32, 3, 16, 16)

min_channels = 32
latent_channels = 16
min_features = 128
latent_features = 64
