"""Start a script under ``torchrun`` on 127.0.0.1 for the torch.distributed tests."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import torch


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def torchrun(script: Path, *args: str, nproc: int = 2, timeout: float = 120.0) -> str:
    """Run ``torchrun --nproc_per_node nproc script args`` with one thread per rank.

    Returns the combined output; raises AssertionError with it when a rank fails.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(script),
        *args,
    ]
    proc = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{output[-6000:]}"
    return output


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Single-threaded torch, like every torchrun rank, so GEMMs and steps round the same way."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
