"""The attribution pipelines the torch.distributed tests run, in one process or under torchrun.

``python -m torch.distributed.run --nproc_per_node 2 _trak_dist_worker.py OUT`` runs
:func:`pipeline` on every rank (gloo, one thread each) in stores under ``OUT``
and saves each rank's returned arrays to ``OUT/rank{r}.npz``. The tests run the
same :func:`pipeline` in one process and compare. Every method goes through
it: TRAK (loaders, the TRAK loop, scores on disk, ``del_grads``, TRAK's score
computer), identity, K-FAC, EK-FAC (and its per-token scores of a tiny GPT-2),
TRAK and EK-FAC with ``rows="recompute"`` (where the TRAKer has it), and the
replay (queries split over ranks). Each rank also returns the rows it
wrote to the store (``written_*``) and the query blocks it reversed, which
the tests compare with the rank's share.
"""

from __future__ import annotations

import inspect
import logging
import sys
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from gradsketch.attribution import BasicScoreComputer, ReplaySettings, TRAKer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers.hf_families import tiny_gpt2

N_TRAIN, N_TARGETS, PROJ_DIM = 100, 24, 16
CHUNK_ROWS, BATCH = 16, 8  # BATCH divides CHUNK_ROWS: the same batches as one process
#: 4 n m = 9,600 bytes of scores exceed it: scores go to disk in tiles.
SMALL_BUDGET = 8_000
#: The per-token language model: training sequences, targets, tokens per sequence.
N_LM, LM_TARGETS, LM_T = 16, 5, 6
QUIET = {"logging_level": logging.WARNING, "progress": False, "device": "cpu"}
#: Methods run once each through the loaders, beside TRAK and EK-FAC (one checkpoint).
LAYER_METHODS = ("identity", "kfac")
#: The replay: training rows, queries, and the queries a rank carries through one
#: reverse pass (ceil(M_REPLAY / 2): each of 2 ranks reverses its share as one block,
#: and one process reverses the same blocks one after the other).
N_REPLAY, M_REPLAY = 24, 6
REPLAY_BLOCK = 3
REPLAY = ReplaySettings(optimizer="sgd", lr=0.1, momentum=0.9, num_steps=8, batch_size=6, seed=3)


def problem():
    """A tanh MLP, two checkpoints, training rows and targets (float32, seeded)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N_TRAIN + N_TARGETS, 6, generator=g)
    y = torch.randint(0, 4, (N_TRAIN + N_TARGETS,), generator=g)
    ckpts = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        net = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 4))
        ckpts.append({k: v.detach().clone() for k, v in net.state_dict().items()})
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 4))
    return model, ckpts, x[:N_TRAIN], y[:N_TRAIN], x[N_TRAIN:], y[N_TRAIN:]


class WrittenRows:
    """The rows this process writes to a TRAKer's store: training rows and target rows.

    Wraps the store's ``write_rows`` on the instance (a torchrun rank writes
    only its own share; one process writes every row).
    """

    def __init__(self, traker: TRAKer) -> None:
        self.train: set[int] = set()
        self.targets: set[int] = set()
        store = traker.store
        write = store.write_rows  # the bound method of this store

        def counted(rows, data, **kw):
            if isinstance(rows, slice):
                rows = range(rows.start, rows.stop)
            for kind, kept in (("checkpoints/", self.train), ("experiments/", self.targets)):
                if any(name.startswith(kind) for name in data):
                    kept.update(int(r) for r in np.asarray(rows).reshape(-1))
            return write(rows, data, **kw)

        store.write_rows = counted  # type: ignore[method-assign]

    def arrays(self, name: str) -> dict[str, np.ndarray]:
        """``written_train_<name>`` and ``written_targets_<name>``: sorted row indices."""
        return {
            f"written_train_{name}": np.array(sorted(self.train), dtype=np.int64),
            f"written_targets_{name}": np.array(sorted(self.targets), dtype=np.int64),
        }


def pipeline(root: Path) -> dict[str, np.ndarray]:
    """Featurize, finalize, score (in memory, on disk, and with ``del_grads``).

    Checkpoint 0 goes through the loaders (sharded DataLoaders), checkpoint 1
    through TRAK's ``featurize(batch, num_samples=...)`` loop (every rank
    sees every batch and keeps its own rows).
    """
    model, ckpts, x, y, xt, yt = problem()
    kw = {"proj_dim": PROJ_DIM, "chunk_rows": CHUNK_ROWS, "lambda_reg": 0.05, **QUIET}
    traker = TRAKer(model, "image_classification", N_TRAIN, save_dir=root / "store", **kw)
    written = {"trak": WrittenRows(traker)}
    for mid, state in enumerate(ckpts):
        traker.load_checkpoint(state, model_id=mid)
        if mid == 0:
            traker.featurize_loader(DataLoader(TensorDataset(x, y), batch_size=BATCH))
        else:
            for s in range(0, N_TRAIN, BATCH):
                traker.featurize(
                    (x[s : s + BATCH], y[s : s + BATCH]), num_samples=len(x[s : s + BATCH])
                )
    traker.finalize_features()
    for mid, state in enumerate(ckpts):
        traker.start_scoring_checkpoint("exp", state, model_id=mid, num_targets=N_TARGETS)
        if mid == 0:
            traker.score_loader(DataLoader(TensorDataset(xt, yt), batch_size=BATCH))
        else:
            # Batches inside one chunk of targets: a rank featurizes whole batches or
            # none, as one process does (a row's features may differ in the last bit
            # with the rows batched beside it, e.g. on AVX2 code paths).
            for s in range(0, N_TARGETS, BATCH):
                part = (xt[s : s + BATCH], yt[s : s + BATCH])
                traker.score(part, num_samples=len(part[0]))
    scores = np.array(traker.finalize_scores("exp"))

    budget = TRAKer(
        model,
        "image_classification",
        N_TRAIN,
        save_dir=root / "store",
        memory_budget=SMALL_BUDGET,
        **kw,
    )
    disk = budget.finalize_scores("exp")
    on_disk = not isinstance(disk, np.ndarray)
    scores_disk = np.array(disk[:])

    pre = TRAKer(model, "image_classification", N_TRAIN, save_dir=root / "pre", **kw)
    pre.load_checkpoint(ckpts[0], model_id=0)
    pre.featurize_loader(DataLoader(TensorDataset(x, y), batch_size=BATCH))
    pre.finalize_features(del_grads=True)
    pre.start_scoring_checkpoint("exp", ckpts[0], model_id=0, num_targets=N_TARGETS)
    pre.score_loader(DataLoader(TensorDataset(xt, yt), batch_size=BATCH))
    scores_pre = np.array(pre.finalize_scores("exp"))

    # TRAK's own score-computer interface: XᵀX reduced, score columns split.
    sc = TRAKer(
        model,
        "image_classification",
        N_TRAIN,
        save_dir=root / "sc",
        score_computer=BasicScoreComputer,
        **kw,
    )
    sc.load_checkpoint(ckpts[1], model_id=0)
    sc.featurize_loader(DataLoader(TensorDataset(x, y), batch_size=BATCH))
    sc.finalize_features()
    sc.start_scoring_checkpoint("exp", ckpts[1], model_id=0, num_targets=N_TARGETS)
    sc.score_loader(DataLoader(TensorDataset(xt, yt), batch_size=BATCH))
    scores_sc = np.array(sc.finalize_scores("exp"))
    # A per-layer method through the same flow: each rank fits the Kronecker
    # factors and EK-FAC's correction on its own rows; finalize sums them.
    ek = TRAKer(
        model,
        "image_classification",
        N_TRAIN,
        save_dir=root / "ekfac",
        method="ekfac",
        chunk_rows=CHUNK_ROWS,
        lambda_reg="auto",
        **QUIET,
    )
    written["ekfac"] = WrittenRows(ek)
    for mid, state in enumerate(ckpts):
        ek.load_checkpoint(state, model_id=mid)
        ek.featurize_loader(DataLoader(TensorDataset(x, y), batch_size=BATCH))
    ek.finalize_features()
    for mid, state in enumerate(ckpts):
        ek.start_scoring_checkpoint("exp", state, model_id=mid, num_targets=N_TARGETS)
        ek.score_loader(DataLoader(TensorDataset(xt, yt), batch_size=BATCH))
    scores_ekfac = np.array(ek.finalize_scores("exp"))
    top = ek.topk("exp", 3)
    shares = {
        key: value for name, rows in written.items() for key, value in rows.arrays(name).items()
    }
    return {
        **layer_methods(root),
        **replay(root),
        **recompute(root),
        **shares,
        "scores_lm_tokens": lm_per_token(root),
        "top_ekfac": top.proponents.numpy(),
        "top_ekfac_scores": top.proponent_scores.numpy(),
        "bottom_ekfac": top.opponents.numpy(),
        "scores_ekfac": scores_ekfac,
        "scores_sc": scores_sc,
        "scores": scores,
        "scores_disk": scores_disk,
        "on_disk": np.array(on_disk),
        "scores_pre": scores_pre,
    }


def layer_methods(root: Path) -> dict[str, np.ndarray]:
    """Identity and K-FAC through the loaders: ``scores_<method>`` and the rows written."""
    model, ckpts, x, y, xt, yt = problem()
    out: dict[str, np.ndarray] = {}
    for method in LAYER_METHODS:
        traker = TRAKer(
            model,
            "image_classification",
            N_TRAIN,
            save_dir=root / method,
            method=method,
            chunk_rows=CHUNK_ROWS,
            **QUIET,
        )
        written = WrittenRows(traker)
        traker.load_checkpoint(ckpts[0], model_id=0)
        traker.featurize_loader(DataLoader(TensorDataset(x, y), batch_size=BATCH))
        traker.finalize_features()
        traker.start_scoring_checkpoint("exp", ckpts[0], model_id=0, num_targets=N_TARGETS)
        traker.score_loader(DataLoader(TensorDataset(xt, yt), batch_size=BATCH))
        out[f"scores_{method}"] = np.array(traker.finalize_scores("exp"))
        out.update(written.arrays(method))
    return out


def has_recompute() -> bool:
    """Whether this TRAKer has recompute mode (``rows="recompute"``)."""
    return "rows" in inspect.signature(TRAKer.__init__).parameters


def recompute(root: Path) -> dict[str, np.ndarray]:
    """TRAK and EK-FAC with ``rows="recompute"``: nothing stored per training row but Q.

    Each rank accumulates the curvature of its rows and, at scoring, recomputes
    the training gradients of its shard of the rows from the loader.
    """
    if not has_recompute():
        return {}
    model, ckpts, x, y, xt, yt = problem()
    out: dict[str, np.ndarray] = {}
    settings = {"trak": {"proj_dim": PROJ_DIM, "lambda_reg": 0.05}, "ekfac": {"lambda_reg": "auto"}}
    for method, kw in settings.items():
        traker = TRAKer(
            model,
            "image_classification",
            N_TRAIN,
            save_dir=root / f"recompute_{method}",
            method=method,
            rows="recompute",
            chunk_rows=CHUNK_ROWS,
            **kw,
            **QUIET,
        )
        written = WrittenRows(traker)
        traker.load_checkpoint(ckpts[0], model_id=0)
        traker.featurize_loader(DataLoader(TensorDataset(x, y), batch_size=BATCH))
        traker.finalize_features()
        traker.start_scoring_checkpoint("exp", ckpts[0], model_id=0, num_targets=N_TARGETS)
        traker.score_loader(DataLoader(TensorDataset(xt, yt), batch_size=BATCH))
        out[f"scores_recompute_{method}"] = np.array(traker.finalize_scores("exp"))
        out.update(written.arrays(f"recompute_{method}"))
    return out


def replay_problem() -> tuple[torch.nn.Module, dict, tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """The replay's float64 MLP, its initial state, N_REPLAY training rows and M_REPLAY queries."""
    model, ckpts, x, y, xt, yt = problem()
    model = model.double()
    model.load_state_dict(ckpts[0])
    init = {k: v.clone() for k, v in model.state_dict().items()}
    train = (x[:N_REPLAY].double(), y[:N_REPLAY])
    return model, init, train, (xt[:M_REPLAY].double(), yt[:M_REPLAY])


def replay(root: Path) -> dict[str, np.ndarray]:
    """The replay through TRAKer's TRAK loop: ``scores_replay`` and this rank's share.

    Every rank is given every training batch and keeps every row (each replays
    the whole run); the queries come in blocks of REPLAY_BLOCK, and each rank
    reverses only the block of its share. A second experiment of one query
    leaves a rank with no query at all.
    """
    model, init, (x, y), (xq, yq) = replay_problem()
    traker = TRAKer(
        model,
        "image_classification",
        N_REPLAY,
        save_dir=root / "replay",
        method="replay",
        replay=REPLAY,
        logging_level=logging.WARNING,
        progress=False,
    )
    written = WrittenRows(traker)
    traker.load_checkpoint(init, model_id=0)
    for s in range(0, N_REPLAY, BATCH):
        traker.featurize((x[s : s + BATCH], y[s : s + BATCH]), num_samples=len(x[s : s + BATCH]))
    traker.finalize_features()
    blocks: list[int] = []
    attributor = traker.attributor
    reverse = attributor.metagradients

    def counted(queries, **kw):
        blocks.append(int(queries[0].shape[0]))
        return reverse(queries, **kw)

    attributor.metagradients = counted  # type: ignore[method-assign]
    traker.start_scoring_checkpoint("q", init, model_id=0, num_targets=M_REPLAY)
    traker.score_loader(DataLoader(TensorDataset(xq, yq), batch_size=REPLAY_BLOCK))
    out = {
        "scores_replay": np.array(traker.finalize_scores("q")),
        "replay_blocks": np.array(blocks, dtype=np.int64),
        # Bytes of one reverse pass over this rank's largest block, and over every query.
        "replay_bytes_share": np.array(attributor.memory_estimate(max(blocks, default=1)).total),
        "replay_bytes_all": np.array(attributor.memory_estimate(M_REPLAY).total),
        **written.arrays("replay"),
    }
    # Fewer queries than ranks: one rank reverses nothing and gathers the other's column.
    traker.start_scoring_checkpoint("one", init, model_id=0, num_targets=1)
    traker.score((xq[-1:], yq[-1:]), num_samples=1)
    out["scores_replay_one"] = np.array(traker.finalize_scores("one"))
    return out


def lm_per_token(root: Path) -> np.ndarray:
    """EK-FAC per-token scores of a tiny float32 GPT-2: ``[N_LM, LM_TARGETS, LM_T]``.

    Each rank keeps its rows as one process does (each layer's per-position
    factors, or dense rows where those are not narrower) and scores its column
    shard of the targets' tokens.
    """
    model = tiny_gpt2(11, LM_T, dtype=torch.float32)
    ids = torch.randint(
        0, 11, (N_LM + LM_TARGETS, LM_T), generator=torch.Generator().manual_seed(5)
    )
    rows = TensorDataset(ids, torch.ones_like(ids), ids.clone())
    lm = TRAKer(
        model,
        "language_modeling",
        N_LM,
        save_dir=root / "lm",
        method="ekfac",
        chunk_rows=BATCH,
        **QUIET,
    )
    lm.load_checkpoint(model.state_dict(), model_id=0)
    lm.featurize_loader(DataLoader(torch.utils.data.Subset(rows, range(N_LM)), batch_size=BATCH))
    lm.finalize_features()
    lm.start_scoring_checkpoint(
        "q", model.state_dict(), model_id=0, num_targets=LM_TARGETS, per_token=True
    )
    targets = torch.utils.data.Subset(rows, range(N_LM, N_LM + LM_TARGETS))
    lm.score_loader(DataLoader(targets, batch_size=BATCH))
    return np.asarray(lm.finalize_scores("q", per_token=True))


def main(out: Path) -> None:
    import torch.distributed as dist

    from gradsketch.attribution import DistributedMismatchError

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        result = pipeline(out)
        model, ckpts, *_ = problem()
        traker = TRAKer(model, "image_classification", N_TRAIN, save_dir=out / "mismatch", **QUIET)
        try:
            traker.load_checkpoint(ckpts[dist.get_rank() % 2], model_id=7)
            result["mismatch"] = np.array("no error")
        except DistributedMismatchError as err:
            result["mismatch"] = np.array(str(err))
        np.savez(out / f"rank{dist.get_rank()}.npz", **result)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
