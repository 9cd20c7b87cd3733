"""Per-layer rows under torchrun: float64 runs kept factored as in one process, and the plan.

``python -m torch.distributed.run --nproc_per_node 2 _factored_dist_worker.py OUT`` runs
:func:`pipeline` and :func:`plans` on every rank (gloo, one thread each) in stores
under ``OUT`` and saves each rank's arrays to ``OUT/rank{r}.npz``; the tests run
:func:`pipeline` in one process and compare. Everything is float64 (model, inputs,
stored rows), so what differs between the runs is only the order of the float64
sums split across ranks:

* identity, K-FAC and EK-FAC on a tanh MLP, rows stored and recomputed: every
  layer sees one position, rows are each layer's ``[a, g]`` (``rank_one``);
* EK-FAC per-token scores of a tiny GPT-2: rows are each position's ``[a, g]``
  (``token_factors``);
* a model whose first layer sees a number of positions that changes from one
  rank's rows to the other's: ``"grow"`` (rank 0's rows one position, rank 1's
  three: rank 0 keeps ``rank_one`` rows while featurizing, rank 1 creates
  ``token_factors``, and ``finalize_features`` rewrites rank 0's rows there)
  and ``"overflow"`` (two positions, then three: one process turns dense at
  the second batch; under torchrun either rank may pick the form first).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gradsketch.attribution import TRAKer
from gradsketch.errors import MemoryBudgetError, StoreIntegrityError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers.hf_families import tiny_gpt2

N, M, CHUNK, BATCH = 64, 12, 16, 8
#: The per-token language model: training sequences, targets, tokens per sequence.
N_LM, M_LM, T_LM = 16, 3, 4
#: Positions of the first layer of :class:`Pooled` in rank 0's rows and rank 1's.
POSITIONS = {"grow": (1, 3), "overflow": (2, 3)}
QUIET = {"logging_level": logging.WARNING, "progress": False, "device": "cpu"}
F64 = {"dtype": torch.float64, "chunk_rows": CHUNK, **QUIET}
LAYER_METHODS = ("identity", "kfac", "ekfac")
ROWS = ("stored", "recompute")
MEMORY = "GRADSKETCH_AVAILABLE_MEMORY"


def mlp_problem() -> tuple[nn.Module, dict, tuple, tuple]:
    """A float64 tanh MLP 6-12-4, its weights, N training rows and M targets (seeded)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N + M, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 4, (N + M,), generator=g)
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 4)).double()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return model, state, (x[:N], y[:N]), (x[N:], y[N:])


def layer_methods(root: Path) -> dict[str, np.ndarray]:
    """``scores_<method>_<rows>`` of every per-layer method, rows stored and recomputed."""
    model, state, train, targets = mlp_problem()
    out = {}
    for method in LAYER_METHODS:
        for rows in ROWS:
            traker = TRAKer(
                model,
                "image_classification",
                N,
                save_dir=root / f"{method}_{rows}",
                method=method,
                rows=rows,
                **F64,
            )
            traker.load_checkpoint(state, model_id=0)
            traker.featurize_loader(DataLoader(TensorDataset(*train), batch_size=BATCH))
            traker.finalize_features()
            traker.start_scoring_checkpoint("q", state, model_id=0, num_targets=M)
            traker.score_loader(DataLoader(TensorDataset(*targets), batch_size=BATCH))
            out[f"scores_{method}_{rows}"] = np.asarray(traker.finalize_scores("q"))
    return out


def lm_per_token(root: Path) -> dict[str, np.ndarray]:
    """EK-FAC per-token scores ``[N_LM, M_LM, T_LM]`` of a tiny float64 GPT-2."""
    model = tiny_gpt2(11, T_LM, width=16)
    ids = torch.randint(0, 11, (N_LM + M_LM, T_LM), generator=torch.Generator().manual_seed(5))
    rows = TensorDataset(ids, torch.ones_like(ids), ids.clone())
    # Chunks of BATCH sequences: each rank featurizes one of the two.
    kw = {**F64, "chunk_rows": BATCH}
    lm = TRAKer(model, "language_modeling", N_LM, save_dir=root / "lm", method="ekfac", **kw)
    lm.load_checkpoint(model.state_dict(), model_id=0)
    lm.featurize_loader(DataLoader(torch.utils.data.Subset(rows, range(N_LM)), batch_size=BATCH))
    lm.finalize_features()
    lm.start_scoring_checkpoint(
        "q", model.state_dict(), model_id=0, num_targets=M_LM, per_token=True
    )
    targets = torch.utils.data.Subset(rows, range(N_LM, N_LM + M_LM))
    lm.score_loader(DataLoader(targets, batch_size=BATCH))
    return {"scores_lm_tokens": np.asarray(lm.finalize_scores("q", per_token=True))}


class Pooled(nn.Module):
    """``[B, T, 6]`` -> Linear(6, 12) at each position, tanh, sum over T, Linear(12, 4)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.head = nn.Linear(6, 12), nn.Linear(12, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.inner(x)).sum(1))


def positions(root: Path) -> dict[str, np.ndarray]:
    """Rows 0-15 with the first count of :data:`POSITIONS`, rows 16-31 with the second.

    Every rank is given both batches (TRAK's loop) and featurizes its own chunk
    (rank 0 rows 0-15, rank 1 rows 16-31), at the same time.
    """
    out = {}
    g = torch.Generator().manual_seed(7)
    for case, (first, second) in POSITIONS.items():
        torch.manual_seed(2)
        model = Pooled().double()
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        xa = torch.randn(CHUNK, first, 6, generator=g, dtype=torch.float64)
        xb = torch.randn(CHUNK, second, 6, generator=g, dtype=torch.float64)
        y = torch.randint(0, 4, (2 * CHUNK,), generator=g)
        xt = torch.randn(M, 2, 6, generator=g, dtype=torch.float64)
        yt = torch.randint(0, 4, (M,), generator=g)
        traker = TRAKer(
            model, "image_classification", 2 * CHUNK, save_dir=root / case, method="ekfac", **F64
        )
        traker.load_checkpoint(state, model_id=0)
        traker.featurize((xa, y[:CHUNK]), num_samples=CHUNK)
        traker.featurize((xb, y[CHUNK:]), num_samples=CHUNK)
        traker.finalize_features()
        traker.start_scoring_checkpoint("q", state, model_id=0, num_targets=M)
        traker.score((xt, yt), num_samples=M)
        out[f"scores_{case}"] = np.asarray(traker.finalize_scores("q"))
        out[f"features_{case}"] = np.asarray(traker.stored_features(0)[0 : 2 * CHUNK])
    return out


def pipeline(root: Path) -> dict[str, np.ndarray]:
    """Every float64 run of this module: scores and the rows they were made from."""
    return {**layer_methods(root), **lm_per_token(root), **positions(root)}


def plan_traker(root: Path, name: str) -> TRAKer:
    model, *_ = mlp_problem()
    return TRAKer(model, "image_classification", N, save_dir=root / name, method="ekfac", **F64)


def plans(root: Path) -> dict[str, np.ndarray]:
    """The per-rank plan: what a rank is held to, logged; and two refusals.

    ``plan_*``: a run under a given machine memory, after its first batch.
    ``refused_one``: rank 1's machine reports 1 kB (rank 0's plenty): every rank
    stops, naming rank 1. ``refused_shared``: 1.5x one process's estimate, which
    one process fits; two ranks on the machine get 0.75x each and both are named.
    """
    import torch.distributed as dist

    rank = dist.get_rank()
    before = os.environ.get(MEMORY)
    out: dict[str, np.ndarray] = {}
    try:
        os.environ[MEMORY] = str(64 * 2**30)
        traker = plan_traker(root, "plan")
        need = traker.plan.stage_bytes("featurize")
        _, state, train, _ = mlp_problem()
        traker.load_checkpoint(state, model_id=0)
        traker.featurize_loader(DataLoader(TensorDataset(*train), batch_size=BATCH))
        plan = traker.plan
        out["plan_available"] = np.array(plan.available_memory)
        out["plan_rows_left"] = np.array(plan.rows_left)
        out["plan_text"] = np.array(str(plan))
        out["plan_need"] = np.array(need)
        os.environ[MEMORY] = str(64 * 2**30 if rank == 0 else 1000)
        out["refused_one"] = np.array(_refusal(root, "refused_one"))
        os.environ[MEMORY] = str(int(1.5 * need))
        out["refused_shared"] = np.array(_refusal(root, "refused_shared"))
    finally:
        if before is None:
            os.environ.pop(MEMORY, None)
        else:
            os.environ[MEMORY] = before
    return out


def damaged(root: Path) -> dict[str, np.ndarray]:
    """``damaged``: finalize_features's refusal where rank 1's last chunk of Q is lost.

    Each rank checks only the chunks of its own rows; rank 1 finds the loss and
    every rank refuses with its findings.
    """
    import torch.distributed as dist

    _, state, train, _ = mlp_problem()
    traker = plan_traker(root, "damaged")
    traker.load_checkpoint(state, model_id=0)
    traker.featurize_loader(DataLoader(TensorDataset(*train), batch_size=BATCH))
    traker.store.flush()
    dist.barrier()
    if dist.get_rank() == 0:
        (root / "damaged/checkpoints/0/out_to_loss/c/3/0").unlink()
    dist.barrier()
    try:
        traker.finalize_features()
        message = "no error"
    except StoreIntegrityError as err:
        message = str(err)
    return {"damaged": np.array(message)}


def split_jobs() -> dict[str, np.ndarray]:
    """``split_*``: :func:`split_over_ranks` on six jobs of mixed shapes, then one failing.

    Each rank records the jobs it computed; the results (job ``i``: ``i`` then
    ``[i, i + 1]`` float64 and an int64 ``[2, i + 1]``) are on every rank.
    Then job 4 raises where it runs, and every rank saves the message.
    """
    from gradsketch.attribution._distributed import balanced_owners, split_over_ranks

    costs = [8.0, 1.0, 27.0, 8.0, 1.0, 64.0]
    done: list[int] = []

    def job(i: int) -> tuple[torch.Tensor, ...]:
        done.append(i)
        return torch.full((i, i + 1), float(i), dtype=torch.float64), torch.arange(
            2 * (i + 1)
        ).reshape(2, -1)

    got = split_over_ranks(job, costs, torch.device("cpu"))
    out = {f"split_{i}_{j}": t.numpy() for i, parts in enumerate(got) for j, t in enumerate(parts)}

    def failing(i: int) -> tuple[torch.Tensor, ...]:
        if i == 4:
            raise ValueError("job four cannot be done")
        return (torch.zeros(1),)

    try:
        split_over_ranks(failing, costs, torch.device("cpu"))
        message = "no error"
    except RuntimeError as err:
        message = str(err)
    owner = balanced_owners(costs, 2)
    return {
        **out,
        "split_done": np.array(done),
        "split_owner": np.array(owner),
        "split_failed": np.array(message),
    }


def _refusal(root: Path, name: str) -> str:
    try:
        plan_traker(root, name)
    except MemoryBudgetError as err:
        return str(err)
    return "no error"


def main(out: Path) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        result = {**pipeline(out), **plans(out), **damaged(out), **split_jobs()}
        np.savez(out / f"rank{dist.get_rank()}.npz", **result)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
