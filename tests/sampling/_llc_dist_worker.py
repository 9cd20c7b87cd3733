"""The LLC run the torch.distributed tests make, in one process or under torchrun.

``python -m torch.distributed.run --nproc_per_node 2 _llc_dist_worker.py OUT`` runs
:func:`estimate_learning_coeff_distributed` on every rank (gloo, one thread
each), recording draws in ``OUT/store``, and pickles each rank's summary to
``OUT/rank{r}.pkl``. The tests compare it with one process.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

#: Three chains on two ranks: rank 0 runs chains 0 and 2, rank 1 runs chain 1.
SETTINGS = {
    "num_chains": 3,
    "num_draws": 8,
    "num_burnin_steps": 2,
    "num_steps_bw_draws": 2,
    "seed": 7,
    "online": True,
    "verbose": False,
    "optimizer_kwargs": {
        "lr": 1e-3,
        "localization": 100.0,
        "nbeta": 6.0,
        "save_metrics": True,
        "sketch_dim": 8,
    },
}


def problem() -> tuple[torch.nn.Module, DataLoader]:
    """A small trained-looking MLP and a shuffling loader (its order is seeded per chain)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 5, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long() + (x[:, 2] > 1).long()
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    return model, DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)


def main(out: Path) -> None:
    import torch.distributed as dist

    from gradsketch.sampling import estimate_learning_coeff_distributed
    from gradsketch.sampling._distributed import DistributedMismatchError

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        model, loader = problem()
        result = estimate_learning_coeff_distributed(model, loader, store=out / "store", **SETTINGS)
        # Ranks disagreeing on the seed are refused on every rank.
        try:
            estimate_learning_coeff_distributed(model, loader, **{**SETTINGS, "seed": rank})
            result["mismatch"] = "no error"
        except DistributedMismatchError as err:
            result["mismatch"] = str(err)
        (out / f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
