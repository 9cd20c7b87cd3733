"""Shared pytest fixtures: devices, a seeded global generator, scatter backends, a one-rank group.

Float64 references are built explicitly in each test (``dtype=torch.float64``
or ``.double()``): torch's default dtype stays float32, as in users' code, so
a path that silently drops to the default dtype shows up as a float32 result.
Shared helpers (reference solvers, rounding bounds, torchrun) live in the
``helpers`` package beside this file.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

#: The CPU, and CUDA as a `gpu` case (skipped without CUDA; `make test-gpu` runs them all).
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    """Each device: the CPU always, CUDA where it exists."""
    return torch.device(request.param)


@pytest.fixture(autouse=True)
def _seeded_global_generator() -> None:
    """Every test starts from the same global torch seed (tests that care pass generators)."""
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _default_dtype_stays_float32() -> Iterator[None]:
    """The float32 default the references rely on: a test that changes it must restore it."""
    yield
    assert torch.get_default_dtype() == torch.float32, (
        f"the test left torch's default dtype at {torch.get_default_dtype()}; restore it "
        "(torch.set_default_dtype(torch.float32)) or pass dtype= explicitly"
    )


@pytest.fixture(params=["native", "torch"])
def scatter_backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with the native scatter kernels and again with torch's scatter.

    ``torch`` disables the native kernels for the test, so every scatter, Gram
    and sampler reduction takes the torch path. Slow tests run once, native.
    """
    from gradsketch.sketch import _native

    if request.param == "native":
        if not _native.native_status().available:
            pytest.skip(f"native kernels unavailable: {_native.native_status().reason}")
    else:
        if request.node.get_closest_marker("slow") is not None:
            pytest.skip("slow tests run once, with the native kernels")
        off = (_native.NativeStatus(False, "disabled by the test"), None)
        monkeypatch.setattr(_native._LOADED, "state", off)
    return str(request.param)


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """A real gloo process group of one rank, in this process."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `gpu`-marked tests cleanly when CUDA is absent."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
