"""Quick tour of gradsketch.sampling: SGLD with metrics + sketches, then an LLC estimate.

Run: ``.venv/bin/python examples/llc_example.py`` (writes ``llc_example_out/``).
"""

import torch
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

from gradsketch.sampling import (
    SGMCMC,
    default_nbeta,
    estimate_learning_coeff_with_summary,
    plot_trace,
)

digits = load_digits()
x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
y = torch.tensor(digits.target)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
for _ in range(150):
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True)

# 1. One sampler step, split into components: exact norms/dots and 256-bucket sketches.
sampler = SGMCMC.sgld(
    model.parameters(),
    lr=1e-4,
    nbeta=default_nbeta(loader),
    localization=100.0,
    save_metrics=True,
    sketch_dim=256,
)
xb, yb = next(iter(loader))
torch.nn.functional.cross_entropy(model(xb), yb).backward()
sampler.step(noise_generator=torch.Generator().manual_seed(0))
metrics, sketches = sampler.get_metrics(), sampler.get_sketches()
print("exact |noise| =", float(metrics.noise), " sketch |S noise| =", float(sketches.noise.norm()))
print("cos(grad, noise) =", metrics.cosine("scaled_grad", "noise"))

# 2. The local learning coefficient at the trained weights (model itself is not modified).
model.zero_grad()
results = estimate_learning_coeff_with_summary(
    model,
    loader,
    num_chains=4,
    num_draws=200,
    num_burnin_steps=50,
    seed=0,
    optimizer_kwargs=dict(lr=1e-4, localization=100.0, nbeta=20.0),
)
print(
    f"LLC = {results['llc/mean']:.3f} ± {results['llc/std']:.3f}  "
    f"(ESS {results['llc/ess']:.0f}, R-hat {results['llc/rhat']:.3f})"
)
print("plot:", plot_trace(results, "llc_example_out/trace.png"))
