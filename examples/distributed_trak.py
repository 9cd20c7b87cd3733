"""TRAK on several processes with torch.distributed: the same script, launched by torchrun.

Run:
    torchrun --nproc_per_node 2 examples/distributed_trak.py        # 2 CPU ranks (gloo)
    python examples/distributed_trak.py                             # or one process

Each rank featurizes its own chunk-aligned share of the training rows into
one shared store (``--save-dir``), XᵀX is summed with all_reduce, and the
targets' score columns are split across ranks and gathered; every rank ends
with the full score matrix. Rerunning resumes: rows already stored are
skipped. Across machines, point ``--save-dir`` at a shared file system and
launch torchrun with ``--nnodes`` / ``--rdzv-endpoint``; on GPUs the
process group uses NCCL and each rank its own ``cuda:LOCAL_RANK``.
"""

import argparse
import logging
import os

if "LOCAL_RANK" in os.environ and hasattr(os, "sched_setaffinity"):
    # CPU ranks scale best on their own cores: bind this rank's share of the
    # cores before torch, zarr or gloo start their threads (they inherit it).
    cores = sorted(os.sched_getaffinity(0))
    per_rank = len(cores) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")) or 1
    first = int(os.environ["LOCAL_RANK"]) * per_rank % len(cores)
    os.sched_setaffinity(0, cores[first : first + per_rank])

import numpy as np
import torch
import torch.distributed as dist

from gradsketch.attribution import TRAKer
from gradsketch.demos import (
    build_mlp,
    load_digits_split,
    make_loader,
    train_digits_model,
)

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--save-dir", default="trak_distributed_results")
parser.add_argument("--num-targets", type=int, default=128)
args = parser.parse_args()

distributed = "RANK" in os.environ  # set by torchrun
use_cuda = torch.cuda.is_available()
if distributed:
    dist.init_process_group("nccl" if use_cuda else "gloo")
    if use_cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
rank = dist.get_rank() if distributed else 0
world = dist.get_world_size() if distributed else 1
device = f"cuda:{torch.cuda.current_device()}" if use_cuda else "cpu"
logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING)

split = load_digits_split(seed=0)  # scikit-learn's bundled digits, no download
x, y = split.x_train, split.y_train
xt, yt = split.x_test[: args.num_targets], split.y_test[: args.num_targets]

# Rank 0 trains two models; every rank gets the same weights.
checkpoints = [None, None]
if rank == 0:
    checkpoints = [train_digits_model(x, y, seed=s).state_dict() for s in range(2)]
if distributed:
    dist.broadcast_object_list(checkpoints, src=0)

traker = TRAKer(
    model=build_mlp(),
    task="image_classification",
    train_set_size=len(x),
    save_dir=args.save_dir,
    device=device,
    proj_dim=512,
    lambda_reg="auto",
    chunk_rows=64,  # the unit of sharding: rank r featurizes whole chunks of 64 rows
    logging_level=logging.WARNING,
    progress=rank == 0,
)
for model_id, ckpt in enumerate(checkpoints):
    traker.load_checkpoint(ckpt, model_id=model_id)
    traker.featurize_loader(make_loader(x, y, batch_size=64))  # this rank's rows only
traker.finalize_features()  # XᵀX: all_reduce of the ranks' partial sums

for model_id, ckpt in enumerate(checkpoints):
    traker.start_scoring_checkpoint("test", ckpt, model_id=model_id, num_targets=len(xt))
    traker.score_loader(make_loader(xt, yt, batch_size=64))
scores = np.asarray(traker.finalize_scores("test"))  # [n_train, num_targets] on every rank

if rank == 0:
    print(f"{world} rank(s): scores {scores.shape} in {args.save_dir}/scores/test")
    for t in range(3):
        top = np.argsort(-scores[:, t])[:5]
        labels = ", ".join(str(int(y[i])) for i in top)
        print(f"test digit {int(yt[t])}: top-5 proponents are training digits {labels}")
if distributed:
    dist.destroy_process_group()
