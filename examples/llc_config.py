"""Config for ``gradsketch llc examples/llc_config.py``: a small MLP trained on digits.

Defines ``model``, ``loader``, ``evaluate`` and ``settings`` (keyword arguments of
``estimate_learning_coeff_with_summary``). Everything here is module level so
that chains can run in spawned processes (``cores > 1``).
"""

import torch
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

_digits = load_digits()
_x = torch.tensor(_digits.data, dtype=torch.float32) / 16.0
_y = torch.tensor(_digits.target)

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
_opt = torch.optim.Adam(model.parameters(), lr=1e-2)
for _ in range(150):
    _opt.zero_grad()
    torch.nn.functional.cross_entropy(model(_x), _y).backward()
    _opt.step()

loader = DataLoader(TensorDataset(_x, _y), batch_size=64, shuffle=True)


def evaluate(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


settings = dict(
    num_chains=4,
    num_draws=200,
    num_burnin_steps=50,
    seed=0,
    cores=1,
    optimizer_kwargs=dict(lr=1e-4, localization=100.0, nbeta=20.0),
)
