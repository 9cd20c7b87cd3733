"""The one choice point between native C, Triton and torch kernels (sketch._backend)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import gradsketch
from gradsketch.sketch import _backend, _native

CPU = torch.device("cpu")
HAVE_NATIVE = _native.native_status().available


def test_torch_is_always_available_and_forced_by_the_option():
    for kernel in _backend.KERNELS:
        assert _backend.default_backend(CPU, kernel=kernel, backend="torch") == "torch"
        assert _backend.KERNELS[kernel][-1] == "torch"


def test_cpu_scatter_is_native_exactly_when_the_kernels_are_loaded():
    expected = "native" if HAVE_NATIVE else "torch"
    assert _backend.default_backend(CPU, kernel="scatter") == expected
    assert _backend.default_backend(torch.zeros(2, 3), kernel="scatter") == expected
    assert _backend.default_backend(CPU, kernel="scatter", dtype=torch.float64) == expected
    # The native kernels add float32/float64 only, and run on CPU only.
    assert _backend.default_backend(CPU, kernel="scatter", dtype=torch.float16) == "torch"
    assert _backend.default_backend(torch.device("meta"), kernel="scatter") == "torch"


def test_disabled_native_kernels_give_torch(monkeypatch):
    monkeypatch.setattr(
        _native._LOADED, "state", (_native.NativeStatus(False, "off in a test"), None)
    )
    assert _backend.default_backend(CPU, kernel="scatter") == "torch"
    out = torch.zeros(1, 4)
    assert not _backend.reduce_(out, torch.tensor([0, 3]), torch.ones(1, 2))
    assert not _backend.reduce_rows_(out, torch.tensor([0, 3]), [[torch.ones(2)]])
    assert torch.equal(out, torch.zeros(1, 4))  # touched nothing
    with pytest.raises(RuntimeError, match=r"`backend='native'`.*off in a test"):
        _backend.default_backend(CPU, kernel="scatter", backend="native")


def test_cpu_tensors_under_auto_never_use_triton(monkeypatch):
    monkeypatch.delenv("GRADSKETCH_TRITON", raising=False)
    assert _backend.default_backend(CPU, kernel="hashed") == "torch"
    assert _backend.default_backend(CPU, kernel="dense", dtype=torch.float32) == "torch"
    monkeypatch.setenv("GRADSKETCH_TRITON", "0")
    with pytest.raises(RuntimeError, match=r"`backend='triton'`.*GRADSKETCH_TRITON"):
        _backend.default_backend(CPU, kernel="dense", backend="triton")


@pytest.mark.skipif(not HAVE_NATIVE, reason="native kernels unavailable")
def test_reduce_through_the_backend_equals_torch_in_float64():
    gen = torch.Generator().manual_seed(0)
    block = torch.randn(3, 50, generator=gen, dtype=torch.float64)
    index = torch.randint(0, 9, (50,), generator=gen)
    out, gram = torch.zeros(3, 9, dtype=torch.float64), torch.empty(3, 3, dtype=torch.float64)
    assert _backend.reduce_(out, index, block, gram=gram)
    torch.testing.assert_close(
        out, torch.zeros(3, 9, dtype=torch.float64).index_add_(1, index, block)
    )
    torch.testing.assert_close(gram, block @ block.T)
    segs = [[block[q, :20].clone() for q in range(3)], [block[q, 20:].clone() for q in range(3)]]
    out2 = torch.zeros(3, 9, dtype=torch.float64)
    assert _backend.reduce_rows_(out2, index, segs, rows=3)
    torch.testing.assert_close(out2, out)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param(
            {"kernel": "gather"},
            r"`kernel` must be one of \['scatter', 'hashed', 'dense'\]",
            id="kernel",
        ),
        pytest.param(
            {"kernel": "scatter", "backend": "triton"},
            r"`backend` for the 'scatter' kernel must be one of "
            r"\['auto', 'native', 'torch'\], got 'triton'",
            id="scatter-triton",
        ),
        pytest.param(
            {"kernel": "dense", "backend": "native"},
            r"must be one of \['auto', 'triton', 'torch'\], got 'native'",
            id="dense-native",
        ),
    ],
)
def test_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _backend.default_backend(CPU, **kwargs)


def test_only_the_backend_imports_the_kernel_modules():
    """Sampling and the sketches reach the native and Triton kernels through ``_backend``."""
    root = Path(gradsketch.__file__).parent
    offenders = []
    for path in sorted(root.rglob("*.py")):
        if path.name in ("_backend.py", "_native.py", "_triton.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            if any(n.endswith(("sketch._native", "sketch._triton")) for n in names):
                offenders.append(f"{path.relative_to(root)}:{node.lineno}")
    assert offenders == []
