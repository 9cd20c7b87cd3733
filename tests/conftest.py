"""Shared pytest fixtures: devices, float64 defaults, seeded generators, a one-rank group."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    """Every available device; CUDA cases only appear where CUDA exists."""
    return torch.device(request.param)


@pytest.fixture(autouse=True)
def _deterministic_threads() -> None:
    torch.manual_seed(0)


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
        monkeypatch.setattr(_native, "_state", off)
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
