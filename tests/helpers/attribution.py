"""Small models and data shared by the attribution tests."""

from __future__ import annotations

import torch


def replay_mlp() -> torch.nn.Module:
    """The float64 ``4 -> 5 -> 3`` tanh MLP of the replay tests (seeded: equal on every call)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)
    ).double()


def replay_data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` float64 rows of 4 features for :func:`replay_mlp`, labels ``0, 1, 2, 0, ...``."""
    gen = torch.Generator().manual_seed(1)
    return torch.randn(n, 4, generator=gen, dtype=torch.float64), torch.arange(n) % 3


def logreg_data(n=40, d=5, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    y = torch.randint(0, classes, (n,), generator=g)
    return x, y


def logreg_checkpoints(d=5, classes=3, count=2, seed=0):
    """Independent random logistic-regression weights (float64)."""
    out = []
    for c in range(count):
        torch.manual_seed(seed + c)
        model = torch.nn.Linear(d, classes).double()
        out.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return out


def margin_grad_reference(state, x, y):
    """d margin / d (W, b) per example, explicit float64 formula.

    margin = z_y - log Σ_{j≠y} exp(z_j); dmargin/dz = e_y - softmax_{j≠y}(z).
    """
    w, b = state["weight"], state["bias"]
    z = x @ w.T + b
    masked = z.clone()
    masked[torch.arange(len(y)), y] = float("-inf")
    s = torch.softmax(masked, dim=1)
    dz = -s
    dz[torch.arange(len(y)), y] += 1.0
    gw = dz[:, :, None] * x[:, None, :]
    return torch.cat([gw.reshape(len(y), -1), dz], dim=1)


def q_reference(state, x, y):
    z = x @ state["weight"].T + state["bias"]
    return 1 - torch.softmax(z, dim=1)[torch.arange(len(y)), y]
