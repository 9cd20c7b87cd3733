"""Masked semantics in five minutes: optimizers that touch only chosen entries.

Run: ``python examples/masked_example.py``
"""

from __future__ import annotations

import torch
from torch import nn

from gradsketch.masked import MaskedAdagrad, MaskedAdam, ParamMask

torch.manual_seed(0)

# 1. The seed's 2x4 example: a "sparse" gradient is really a mask.
param = nn.Parameter(torch.arange(8.0).reshape(2, 4))
opt = MaskedAdagrad([param], lr=0.1, initial_accumulator_value=0.5)
param.grad = torch.tensor([[0.0, 0.0, 3.0, 0.0], [4.0, 0.0, 5.0, 0.0]])
opt.step(masks={param: param.grad != 0})  # no indices, no values, no sparse tensor
print("seed example after one step:\n", param.detach())

# 2. Restrict training of a model to chosen weights with a ParamMask.
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
mask = ParamMask.from_patterns(model, include=["0.*"]) & ParamMask.random(model, 0.25, seed=0)
print(f"\n{mask}")
opt = MaskedAdam([{"params": model.named_parameters(), "mask": mask}], lr=1e-2)
before = mask.select(model).detach().clone()
frozen = model[2].weight.detach().clone()
x, y = torch.randn(64, 8), torch.randn(64, 1)
for _ in range(20):
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
print("selected entries moved by", (mask.select(model) - before).norm().item())
print("unselected layer unchanged:", torch.equal(frozen, model[2].weight))

# 3. The selected coordinates are what a sketch sees: select <-> scatter.
flat = mask.select(model)
assert flat.numel() == mask.numel
full = mask.scatter(flat.detach())
print("scatter/select round trip:", torch.equal(mask.select(full), flat.detach()))
print("fingerprint (differs for every mask):", mask.fingerprint)
