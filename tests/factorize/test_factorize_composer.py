"""Side by side with Composer's factorize_core (needs `pip install --no-deps mosaicml`)."""

from __future__ import annotations

import importlib.util
import statistics
import time
from pathlib import Path
from types import ModuleType

import pytest
import torch

from gradsketch.factorize import factorize_conv2d, factorize_matrix
from helpers.factorize import predict, true_nmse

pytestmark = pytest.mark.bench


@pytest.fixture(scope="module")
def composer_core() -> ModuleType:
    spec = importlib.util.find_spec("composer")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("mosaicml (Composer) is not installed")
    path = Path(spec.submodule_search_locations[0]) / "algorithms/factorize/factorize_core.py"
    if not path.is_file():
        pytest.skip(f"Composer's factorize_core.py not found at {path}")
    core_spec = importlib.util.spec_from_file_location("_composer_factorize_core", path)
    assert core_spec is not None and core_spec.loader is not None
    module = importlib.util.module_from_spec(core_spec)
    core_spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
def test_matches_or_beats_composer(composer_core, with_bias):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 512, generator=gen)
    w = torch.randn(512, 512, generator=gen)
    b = torch.randn(512, generator=gen) if with_bias else None
    y = x @ w + (b if b is not None else 0)
    theirs = composer_core.factorize_matrix(x, y, w, bias=b, rank=128, n_iters=3)
    ours = factorize_matrix(x, y, w, bias=b, rank=128, n_iters=3)
    theirs_true = true_nmse(y, predict(x, theirs.Wa, theirs.Wb, theirs.bias))
    assert ours.nmse == pytest.approx(
        true_nmse(y, predict(x, ours.Wa, ours.Wb, ours.bias)), rel=1e-4
    )
    assert ours.nmse < theirs_true
    if with_bias:  # Composer's reported nmse is not the error of what it returns
        assert abs(theirs.nmse - theirs_true) > 1e-4
    # Same start, same sweeps: init="weights" reproduces Composer's trajectory
    # (better only by the jointly fitted bias).
    same = factorize_matrix(x, y, w, bias=b, rank=128, n_iters=3, init="weights")
    assert same.nmse <= theirs_true + 1e-4


def test_faster_than_composer(composer_core):
    """Interleaved medians on the issue's problem; the margin is loose because
    a shared CI machine's load moves both timings (the benchmark script reports
    the measured ratio)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 1024, generator=gen)
    w = torch.randn(1024, 1024, generator=gen)
    y = x @ w
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ours, theirs = [], []
        for _ in range(5):
            t0 = time.perf_counter()
            factorize_matrix(x, y, w, rank=256)
            t1 = time.perf_counter()
            composer_core.factorize_matrix(x, y, w, rank=256)
            t2 = time.perf_counter()
            ours.append(t1 - t0)
            theirs.append(t2 - t1)
    finally:
        torch.set_num_threads(threads)
    assert statistics.median(ours) < statistics.median(theirs)


def test_conv_matches_or_beats_composer(composer_core):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 32, 12, 12, generator=gen)
    w = torch.randn(32, 32, 3, 3, generator=gen)
    theirs = composer_core.factorize_conv2d(x, w, rank=8, n_iters=3)
    ours = factorize_conv2d(x, w, rank=8, n_iters=3)
    assert ours.nmse <= theirs.nmse + 1e-6  # no bias: Composer's nmse is true here
