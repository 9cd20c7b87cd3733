"""Ground-floor ``torch.distributed`` helpers shared by attribution and sampling.

Every helper works with or without a process group: without one (or before
``init_process_group``) this process is rank 0 of a world of 1, collectives
return their input, and barriers return at once. So library code calls them
unconditionally and the same code runs in one process and under ``torchrun``
(gloo on CPU, NCCL on GPU).

:func:`init_from_env` creates the default process group from the variables
``torchrun`` sets (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``,
``LOCAL_RANK``); the ``attribute`` and ``llc`` commands call it, so
``torchrun --nproc_per_node 2 -m gradsketch.cli attribute CONFIG.py`` works.

Example:
    >>> rank(), world_size(), is_distributed()
    (0, 1, False)
    >>> broadcast_object({"seed": 3}), all_gather_object(7)
    ({'seed': 3}, [7])
    >>> require_same_across_ranks("`seed`", 3)  # one rank always agrees with itself
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from gradsketch._checks import check_int
from gradsketch.errors import DistributedMismatchError

__all__ = [
    # who am I
    "is_distributed",
    "local_rank",
    "rank",
    "rank_and_world",
    "world_size",
    # synchronisation and object collectives
    "all_gather_object",
    "barrier",
    "broadcast_object",
    "rank_zero_first",
    # agreement checks
    "DistributedMismatchError",
    "require_same_across_ranks",
    # process group set-up
    "BACKENDS",
    "TORCHRUN_VARIABLES",
    "init_from_env",
    "process_group_from_env",
]

logger = logging.getLogger(__name__)

#: Process-group backends :func:`init_from_env` accepts, with what each moves.
BACKENDS: dict[str, str] = {
    "gloo": "CPU tensors (any machine)",
    "nccl": "CUDA tensors, one GPU per rank",
}

#: Variables ``torchrun`` sets for each rank; ``RANK``/``WORLD_SIZE`` trigger set-up.
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

_DEFAULT_FIX = (
    "Every rank must call this with the same value: load the same checkpoint, "
    "settings and seeds on every rank."
)


def is_distributed() -> bool:
    """Whether a ``torch.distributed`` default process group is initialised here."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """The rank of this process in the default group; 0 without one."""
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    """Number of ranks in the default group; 1 without one."""
    return dist.get_world_size() if is_distributed() else 1


def rank_and_world() -> tuple[int, int]:
    """``(rank(), world_size())``: ``(0, 1)`` without a process group."""
    return rank(), world_size()


def local_rank() -> int:
    """The index of this rank on its machine (torchrun's ``LOCAL_RANK``); 0 when unset."""
    return _env_int("LOCAL_RANK", os.environ.get("LOCAL_RANK", "0"), low=0)


def barrier() -> None:
    """Wait for every rank of the default group (returns at once in a world of 1)."""
    if world_size() > 1:
        dist.barrier()


@contextlib.contextmanager
def rank_zero_first() -> Iterator[bool]:
    """Run the block on rank 0 first, then on the other ranks; yields ``rank() == 0``.

    For creating shared files (settings records, zarr arrays): rank 0 creates
    them while the others wait at a barrier, then the others find them in
    place and only open them. The block must write only when the yielded flag
    is true or the file is still absent.

    Example:
        >>> with rank_zero_first() as first:
        ...     first
        True
    """
    me, world = rank_and_world()
    if world > 1 and me != 0:
        dist.barrier()
    yield me == 0
    if world > 1 and me == 0:
        dist.barrier()


def broadcast_object(value: Any, *, src: int = 0) -> Any:
    """Rank ``src``'s ``value`` on every rank (``broadcast_object_list``); ``value`` alone.

    Args:
        value: any picklable object; only rank ``src``'s is used.
        src: the rank whose value every rank receives.

    Returns:
        Rank ``src``'s value (a fresh unpickled copy on the other ranks).

    Raises:
        ValueError: ``src`` is not a rank of the group.

    Example:
        >>> broadcast_object([1, 2], src=0)
        [1, 2]
    """
    world = world_size()
    fix = f"pass the rank that holds the value (the world size is {world}), usually 0"
    check_int("src", src, low=0, high=world, fix=fix)
    if world == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order, on every rank; ``[value]`` without a group.

    Example:
        >>> all_gather_object("a")
        ['a']
    """
    world = world_size()
    if world == 1:
        return [value]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, value)
    return out


def _listing(values: list[Any]) -> str:
    return ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))


def require_same_across_ranks(name: str, value: Any, *, fix: str = _DEFAULT_FIX) -> None:
    """Raise :class:`DistributedMismatchError` on every rank unless all ranks pass equal values.

    The values are exchanged with ``all_gather_object`` (so every rank takes
    part and every rank raises together, none is left waiting). For a
    mapping the message names only the keys whose values differ.

    Args:
        name: what the value is, for the message (e.g. ``"`seed`"``).
        value: a picklable value comparable with ``==`` (a fingerprint, a
            size, a dict of settings).
        fix: how to fix a mismatch, appended to the message.

    Raises:
        DistributedMismatchError: the ranks' values differ; the message shows
            each rank's value.

    Example:
        >>> require_same_across_ranks("settings", {"seed": 0, "chains": 4})
    """
    values = all_gather_object(value)
    if all(v == values[0] for v in values[1:]):
        return
    first = values[0]
    if all(isinstance(v, Mapping) and v.keys() == first.keys() for v in values):
        differing = [key for key in first if any(v[key] != first[key] for v in values)]
        detail = "; ".join(f"{key}: {_listing([v[key] for v in values])}" for key in differing)
    else:
        detail = _listing(values)
    raise DistributedMismatchError(f"{name} differs across ranks ({detail}). {fix}")


def _env_int(variable: str, text: str, *, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if value < low:
        raise ValueError(
            f"environment variable `{variable}` must be an integer >= {low}, got {text!r}; "
            "launch with `torchrun --nproc_per_node N ...`, which sets it, or unset it."
        )
    return value


def init_from_env(backend: str | None = None) -> bool:
    """Create the default process group from torchrun's variables, when asked and needed.

    Does nothing (returns ``False``) when ``RANK``/``WORLD_SIZE`` are unset
    (a plain ``python`` run) or a default group already exists (the caller
    made one). Otherwise it validates the variables and calls
    ``init_process_group(backend, rank=RANK, world_size=WORLD_SIZE)`` with
    the ``env://`` rendezvous of ``MASTER_ADDR:MASTER_PORT``; with NCCL it
    first selects GPU ``LOCAL_RANK``, which NCCL's object collectives use.

    Args:
        backend: one of :data:`BACKENDS`; default ``"nccl"`` when NCCL is
            available and the machine has a GPU for each of its ranks
            (``LOCAL_WORLD_SIZE``), else ``"gloo"`` (two ranks on one GPU
            cannot share it under NCCL).

    Returns:
        Whether this call created the group (the caller then owns it and
        destroys it; :func:`process_group_from_env` does both).

    Raises:
        ValueError: ``backend`` is unknown, or the environment is incomplete
            or malformed (only one of ``RANK``/``WORLD_SIZE``, no
            ``MASTER_ADDR``, ``RANK >= WORLD_SIZE``, non-integers), or
            ``"nccl"`` is asked for a rank without a GPU of its own.

    Example:
        >>> import os
        >>> "RANK" in os.environ or init_from_env()  # a plain run: nothing to do
        False
    """
    if backend is not None and backend not in BACKENDS:
        allowed = ", ".join(f"{k!r} ({v})" for k, v in BACKENDS.items())
        raise ValueError(
            f"`backend` must be one of {allowed} or None (automatic), got {backend!r}."
        )
    env = os.environ
    present = [v for v in ("RANK", "WORLD_SIZE") if v in env]
    if not present or is_distributed():
        return False
    missing = [v for v in TORCHRUN_VARIABLES if v not in env]
    if missing:
        raise ValueError(
            f"environment variables {present} are set but {missing} are not; a process group "
            f"needs all of {list(TORCHRUN_VARIABLES)}. Launch with `torchrun --nproc_per_node "
            "N ...` (which sets them), or unset RANK and WORLD_SIZE for a one-process run."
        )
    world = _env_int("WORLD_SIZE", env["WORLD_SIZE"], low=1)
    me = _env_int("RANK", env["RANK"], low=0)
    if me >= world:
        raise ValueError(
            f"environment variable `RANK` must lie in range(0, {world}) for WORLD_SIZE={world}, "
            f"got {me}; let torchrun set both."
        )
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend is None:
        # Every rank of a machine decides alike: NCCL only with a GPU for each of them.
        ranks_here = _env_int("LOCAL_WORLD_SIZE", env.get("LOCAL_WORLD_SIZE", "1"), low=1)
        use_nccl = dist.is_nccl_available() and ranks_here <= gpus
        backend = "nccl" if use_nccl else "gloo"
    if backend == "nccl":
        if local_rank() >= gpus:
            raise ValueError(
                f"`backend`='nccl' needs one GPU per rank of a machine, but LOCAL_RANK="
                f"{local_rank()} and this machine has {gpus} GPU(s); launch at most {gpus} "
                "ranks per machine (`torchrun --nproc_per_node`), or pass backend='gloo'."
            )
        torch.cuda.set_device(local_rank())
    dist.init_process_group(backend, rank=me, world_size=world)
    logger.info("initialised a %s process group: rank %d of %d", backend, me, world)
    return True


@contextlib.contextmanager
def process_group_from_env(backend: str | None = None) -> Iterator[bool]:
    """:func:`init_from_env` for a block; destroys the group afterwards if it made it.

    Yields whether it made the group. A group made by the caller is left alone.

    Example:
        >>> with process_group_from_env() as made:
        ...     world_size()
        1
    """
    made = init_from_env(backend)
    try:
        yield made
    finally:
        if made and is_distributed():
            dist.destroy_process_group()
