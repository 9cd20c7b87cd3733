"""Factorize a small trained network and see what it costs.

Trains an MLP on scikit-learn's bundled digits (no downloads), replaces its
wide Linear layers by low-rank pairs fitted on a calibration batch, prints
the report and the accuracy before / after, and writes a rank curve PNG.

    python examples/factorize_example.py [--out factorize_out]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from sklearn.datasets import load_digits
from torch import nn

from gradsketch.factorize import apply_factorization, plot_rank_curve


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("factorize_out"))
    args = parser.parse_args()
    torch.manual_seed(0)

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    x_train, y_train, x_test, y_test = x[:1400], y[:1400], x[1400:], y[1400:]

    model = nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(20):
        for i in range(0, len(x_train), 100):
            opt.zero_grad()
            nn.functional.cross_entropy(
                model(x_train[i : i + 100]), y_train[i : i + 100]
            ).backward()
            opt.step()
    before = accuracy(model, x_test, y_test)

    # How much rank does the middle layer need? nmse against rank, speed-up limit marked.
    hidden = model[0](x_train).relu().detach()
    curve = plot_rank_curve(model[2], hidden, args.out / "rank_curve.png")
    print(f"rank curve written to {curve.path} (speed-up limit: rank {curve.max_rank})")

    report = apply_factorization(
        model, min_features=128, latent_features=32, calibration_data=x_train, optimizers=opt
    )
    print(report)
    print(f"test accuracy: {before:.3f} before, {accuracy(model, x_test, y_test):.3f} after")
    report.to_json(args.out / "report.json")


if __name__ == "__main__":
    main()
