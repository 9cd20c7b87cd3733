"""The native scatter / Gram kernels against float64 references, and their loader."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import platform
from pathlib import Path

import pytest
import torch

from gradsketch import _native_build
from gradsketch.sketch import _native

needs_native = pytest.mark.skipif(
    not _native.native_status().available,
    reason=f"native kernels unavailable: {_native.native_status().reason}",
)


_TARGETS: dict[str, tuple[_native.NativeStatus, object]] = {}


@pytest.fixture(params=["native", "x86-64-v3", "x86-64-v2"])
def kernel_target(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> str:
    """The kernels built for this CPU, and for older x86-64 levels than it may have.

    ``x86-64-v3`` is AVX2 without AVX-512 and ``x86-64-v2`` SSE4.2 only: a
    kernel that relied on the build machine's AVX-512 (say a 64-byte vector
    type lowered to one register) is compiled here for CPUs without it and
    must give the same results. Each target is built once per session.
    """
    target = str(request.param)
    if target == "native":
        return target
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"-march={target} is an x86-64 target")
    if target not in _TARGETS:
        with pytest.MonkeyPatch.context() as env:
            env.delenv("GRADSKETCH_NATIVE", raising=False)
            env.setenv("GRADSKETCH_NATIVE_MARCH", target)
            env.setenv("GRADSKETCH_CACHE", str(tmp_path_factory.mktemp(target)))
            _TARGETS[target] = _native._load()
    state = _TARGETS[target]
    if not state[0].available:
        pytest.skip(f"no kernels for -march={target}: {state[0].reason}")
    monkeypatch.setattr(_native._LOADED, "state", state)
    return target


def reference(block: torch.Tensor, index: torch.Tensor, width: int, rows: int) -> torch.Tensor:
    """Slow float64 scatter: an explicit loop over columns."""
    out = torch.zeros(rows, width, dtype=torch.float64)
    for i, j in enumerate(index.tolist()):
        out[:, j] += block[:rows, i].double()
    return out


@needs_native
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 33, 70])
@pytest.mark.parametrize("index_dtype", [torch.int16, torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_scatter_matches_a_float64_loop(rows, index_dtype, dtype, threads, kernel_target):
    """Every row grouping (4, 3, 2, 1 and slices past MAX_ROWS) and split, with tails."""
    n, width = 1003, 37
    gen = torch.Generator().manual_seed(rows)
    block = torch.randn(rows, n, generator=gen, dtype=dtype)
    index = torch.randint(0, width, (n,), generator=gen).to(index_dtype)
    out = torch.ones(rows, width, dtype=dtype)  # adds into what is there
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        # MIN_PER_THREAD would keep 1003 columns on one thread: lower it for the test.
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(_native, "MIN_PER_THREAD", 16)
            assert _native.reduce_(out, index, block)
    finally:
        torch.set_num_threads(before)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(
        out.double(), 1.0 + reference(block, index, width, rows), atol=tol, rtol=tol
    )


@needs_native
@pytest.mark.parametrize("rows", [0, 2, 3])
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_gram_and_scatter_match_float64(rows, threads, monkeypatch, kernel_target):
    """The Gram of all r rows (float64, symmetric) and the scatter of the leading ``rows``.

    Products are summed in float32 lanes within a chunk of CHUNK columns:
    each lane sums at most CHUNK / 64 = 32 products, so the relative error
    of a Gram entry is below 32 * 2^-24 ~ 2e-6 of the sum of |products|.
    """
    r, n, width = 4, 5 * _native.CHUNK + 77, 11
    gen = torch.Generator().manual_seed(3)
    block = torch.randn(r, n, generator=gen)
    block[2] *= 1e-3  # rows of very different scales, like a sampler's
    index = torch.randint(0, width, (n,), generator=gen)
    out = torch.zeros(max(rows, 1), width)
    gram = torch.full((r, r), float("nan"), dtype=torch.float64)  # overwritten
    monkeypatch.setattr(_native, "MIN_PER_THREAD", 16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert _native.reduce_(
            out if rows else None, index if rows else None, block, rows=rows, gram=gram
        )
    finally:
        torch.set_num_threads(before)
    exact = block.double() @ block.double().T
    scale = block.double().abs() @ block.double().abs().T
    assert torch.all((gram - exact).abs() <= 2e-6 * scale)
    assert torch.equal(gram, gram.T)
    if rows:
        torch.testing.assert_close(
            out[:rows].double(), reference(block, index, width, rows), atol=1e-4, rtol=1e-5
        )


@needs_native
def test_segments_equal_the_concatenated_block(monkeypatch, kernel_target):
    """Rows given per segment (a sampler's gradients in place) == one [r, n] block.

    The scatter is exactly equal (same order of additions per bucket on one
    thread per column range); the Gram agrees within its float32-lane bound.
    """
    gen = torch.Generator().manual_seed(5)
    lengths = [0, 1, 700, 3, 4096 + 5]
    segments = [[torch.randn(m, generator=gen) for _ in range(3)] for m in lengths]
    block = torch.stack([torch.cat([seg[q] for seg in segments]) for q in range(3)])
    index = torch.randint(0, 9, (block.shape[1],), generator=gen, dtype=torch.int64).to(torch.int16)
    monkeypatch.setattr(_native, "MIN_PER_THREAD", 16)
    out_seg, gram_seg = torch.zeros(2, 9), torch.empty(3, 3, dtype=torch.float64)
    assert _native.reduce_rows_(out_seg, index, segments, rows=2, gram=gram_seg)
    out_blk, gram_blk = torch.zeros(2, 9), torch.empty(3, 3, dtype=torch.float64)
    assert _native.reduce_(out_blk, index, block, rows=2, gram=gram_blk)
    assert torch.equal(out_seg, out_blk)
    # Chunks end at segment ends, so the float32 lane sums differ: the bound
    # of test_fused_gram_and_scatter_match_float64 holds for both.
    scale = block.double().abs() @ block.double().abs().T
    exact = block.double() @ block.double().T
    assert torch.all((gram_seg - exact).abs() <= 2e-6 * scale)
    assert torch.all((gram_blk - exact).abs() <= 2e-6 * scale)
    torch.testing.assert_close(
        out_seg.double(), reference(block, index, 9, 2), atol=1e-4, rtol=1e-5
    )


@needs_native
@pytest.mark.parametrize("rows", [4, 8, 17, 33, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("threads", [1, 2])
def test_transposed_scatter_equals_the_row_wise_one(
    rows, dtype, threads, monkeypatch, kernel_target
):
    """Many rows are scattered transposed (``[width, lanes]`` per thread) only for speed.

    Each output element still sums its inputs one at a time in column order,
    starting from what the output held, as the row-wise scatter does; so the
    two are bit-equal on every CPU (no reassociation, no fused multiply-add),
    for segments, row counts that are not a multiple of the lanes and tails
    of columns. Both are checked against float64 too.
    """
    gen = torch.Generator().manual_seed(rows)
    lengths = [5, 1000, 0, 2049, 3]
    segments = [[torch.randn(m, generator=gen, dtype=dtype) for _ in range(rows)] for m in lengths]
    block = torch.stack([torch.cat([seg[q] for seg in segments]) for q in range(rows)])
    width = 97
    index = torch.randint(0, width, (block.shape[1],), generator=gen)
    start = torch.randn(rows, width, generator=gen, dtype=dtype)
    monkeypatch.setattr(_native, "MIN_PER_THREAD", 16)
    results = {}
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for tmin in (0, 1):
            monkeypatch.setattr(_native, "TRANSPOSED_MIN_ROWS", tmin)
            out_blk, out_seg = start.clone(), start.clone()
            assert _native.reduce_(out_blk, index, block)
            assert _native.reduce_rows_(out_seg, index, segments)
            assert torch.equal(out_blk, out_seg)
            results[tmin] = out_blk
    finally:
        torch.set_num_threads(before)
    assert torch.equal(results[0], results[1])
    tol = 1e-4 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(
        results[1].double(),
        start.double() + reference(block, index, width, rows),
        atol=tol,
        rtol=tol,
    )


@needs_native
def test_transposed_scatter_flags_bad_indices_and_skips_wide_outputs(monkeypatch):
    """A bad index is skipped and reported; outputs too wide stay row-wise.

    Too wide: the buffer would not stay in L2, or the block has fewer than
    two columns per output column.
    """
    monkeypatch.setattr(_native, "MIN_PER_THREAD", 16)
    monkeypatch.setattr(_native, "TRANSPOSED_MIN_ROWS", 1)
    out = torch.zeros(16, 4)
    with pytest.raises(IndexError, match=r"outside \[0, 4\)"):
        _native.reduce_(out, torch.tensor([0, 4, 1] * 7), torch.ones(16, 21))
    assert torch.equal(out, torch.tensor([[7.0, 7.0, 0.0, 0.0]]).expand(16, 4))
    assert _native._transposed_min_rows(out, 8) == 1
    assert _native._transposed_min_rows(out, 7) == 0  # fewer than 2 columns per output column
    wide = torch.zeros(1, _native.TRANSPOSED_MAX_BYTES // 64 + 1)
    assert _native._transposed_min_rows(wide, 10 * wide.shape[1]) == 0


@needs_native
def test_index_outside_the_output_raises_and_names_the_width():
    out = torch.zeros(2, 4)
    with pytest.raises(IndexError, match=r"outside \[0, 4\)"):
        _native.reduce_(out, torch.tensor([0, 4, 1]), torch.ones(2, 3))
    # The entries with good indices were added; the bad one was skipped.
    assert out.sum() == 4.0


@pytest.mark.parametrize(
    "case",
    ["float16", "strided", "index_float", "index_length", "out_dtype", "gram_dtype"],
)
def test_inputs_the_kernel_does_not_take_fall_back_untouched(case):
    block, index, out = torch.ones(2, 6), torch.zeros(6, dtype=torch.int64), torch.zeros(2, 3)
    gram = None
    if case == "float16":
        block = block.half()
    elif case == "strided":
        block = torch.ones(2, 12)[:, ::2]
    elif case == "index_float":
        index = index.float()
    elif case == "index_length":
        index = index[:5]
    elif case == "out_dtype":
        out = out.double()
    elif case == "gram_dtype":
        gram = torch.zeros(2, 2)
    assert not _native.reduce_(out, index, block, gram=gram)
    assert out.abs().sum() == 0


def test_rows_without_out_or_index_are_refused_by_name():
    with pytest.raises(ValueError, match="`out` and `index`"):
        _native.reduce_(None, None, torch.ones(2, 3), rows=1)


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("GRADSKETCH_NATIVE", "0")
    status, kernels = _native._load()
    assert not status.available and kernels is None
    assert "GRADSKETCH_NATIVE=0" in status.reason


def test_missing_compiler_is_reported_not_raised(monkeypatch, tmp_path):
    monkeypatch.delenv("GRADSKETCH_NATIVE", raising=False)
    monkeypatch.setenv("GRADSKETCH_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "/nonexistent/cc")
    status, kernels = _native._load()
    assert not status.available and kernels is None
    assert "compiler" in status.reason or status.reason.startswith("native kernels are built")


@needs_native
def test_fresh_build_into_an_empty_cache_loads_and_agrees(monkeypatch, tmp_path):
    """A clean cache compiles the library (atomically) and the result scatters correctly."""
    monkeypatch.delenv("GRADSKETCH_NATIVE", raising=False)
    monkeypatch.setenv("GRADSKETCH_CACHE", str(tmp_path))
    status, kernels = _native._load()
    assert status.available and status.reason == "compiled", status
    assert status.path is not None and status.path.startswith(str(tmp_path))
    name = status.path.split("/")[-1]
    files = sorted(p.name for p in (tmp_path / "native").iterdir())
    assert files == [name, f"{name}.json", f"{name}.lock"]  # library, its record, its lock
    assert _native_build.check_cached(tmp_path / "native" / name, _native.ABI_VERSION) is None
    assert ctypes.CDLL(status.path).gs_abi_version() == _native.ABI_VERSION
    again, _ = _native._load()
    assert again.reason == "cached" and again.path == status.path
    assert kernels is not None


@needs_native
def test_an_explicit_march_target_is_a_cache_entry_of_its_own(monkeypatch, tmp_path):
    monkeypatch.delenv("GRADSKETCH_NATIVE", raising=False)
    monkeypatch.setenv("GRADSKETCH_CACHE", str(tmp_path))
    native, _ = _native._load()
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86-64 targets only")
    monkeypatch.setenv("GRADSKETCH_NATIVE_MARCH", "x86-64-v2")
    older, _ = _native._load()
    assert native.available and older.available, (native, older)
    assert native.path != older.path
    monkeypatch.setenv("GRADSKETCH_NATIVE_MARCH", "no-such-cpu")
    refused, kernels = _native._load()
    assert not refused.available and kernels is None
    assert "-march=no-such-cpu" in refused.reason


def test_native_status_is_reported():
    status = _native.native_status()
    assert isinstance(status.available, bool) and status.reason
    assert _native.available(torch.device("cpu")) == status.available
    assert not _native.available(torch.device("meta"))


# ------------------------------------------------------------------ a corrupt cache
# A real build takes 10-20 s on two shared cores: these tests "build" by copying the
# library this session already loaded (with its record), which is what _build leaves.


@pytest.fixture
def fake_builds(monkeypatch, tmp_path):
    """A fresh cache under ``tmp_path`` whose builds copy the loaded library; the build count."""
    monkeypatch.delenv("GRADSKETCH_NATIVE", raising=False)
    monkeypatch.setenv("GRADSKETCH_CACHE", str(tmp_path))
    built = []

    def copy_build(spec, compiler, target):
        assert spec is _native.SPEC
        data = Path(str(_native.native_status().path)).read_bytes()
        target.parent.mkdir(parents=True, exist_ok=True)
        _native_build.sidecar(target).write_text(
            json.dumps(_native_build.record(data, _native.ABI_VERSION))
        )
        staged = Path(f"{target}.staged")  # renamed into place, as _build does
        staged.write_bytes(data)
        os.replace(staged, target)
        built.append(target)

    monkeypatch.setattr(_native_build, "build", copy_build)
    first, kernels = _native._load()
    assert first.available and first.reason == "compiled" and kernels is not None
    assert built == [Path(str(first.path))]
    return built


def _corrupt(path, how):
    """Replace the library (by rename: this process has the old one mapped) with a bad one."""
    if how in ("no-record", "torn-record"):
        _corrupt_in_place(path, how)
        return
    staged = Path(f"{path}.staged")
    staged.write_bytes(Path(path).read_bytes())
    _corrupt_in_place(staged, how)
    os.replace(staged, path)


def _corrupt_in_place(path, how):
    data = Path(path).read_bytes()
    if how == "truncated":
        Path(path).write_bytes(data[: len(data) // 3])
    elif how == "empty":
        Path(path).write_bytes(b"")
    elif how == "garbled":
        middle = len(data) // 2
        Path(path).write_bytes(data[:middle] + bytes(b ^ 0x5A for b in data[middle:]))
    elif how == "bit-flip":
        middle = len(data) // 2
        Path(path).write_bytes(data[:middle] + bytes([data[middle] ^ 1]) + data[middle + 1 :])
    elif how == "other-elf":
        other = Path(torch.__file__).parent / "lib" / "libshm.so"
        Path(path).write_bytes(other.read_bytes())
    elif how == "no-record":
        _native_build.sidecar(Path(path)).unlink()
    elif how == "torn-record":
        _native_build.sidecar(Path(path)).write_text('{"size": 12')
    else:
        raise AssertionError(how)


@needs_native
@pytest.mark.parametrize(
    "how", ["truncated", "empty", "garbled", "bit-flip", "other-elf", "no-record", "torn-record"]
)
def test_a_corrupt_cached_library_is_rebuilt_before_it_is_mapped(fake_builds, how, caplog):
    """Checked before ``ctypes.CDLL``: a truncated file mapped would SIGBUS the process."""
    target = fake_builds[0]
    if how == "other-elf" and not (Path(torch.__file__).parent / "lib" / "libshm.so").exists():
        pytest.skip("no libshm.so beside torch to stand in for another library")
    _corrupt(target, how)
    assert _native_build.check_cached(target, _native.ABI_VERSION) is not None
    with caplog.at_level(logging.WARNING, logger=_native_build.__name__):
        status, kernels = _native._load()
    assert status.available and status.reason == "compiled", status
    assert kernels is not None and len(fake_builds) == 2
    assert f"the cached {target} failed its check" in caplog.text
    assert _native_build.check_cached(target, _native.ABI_VERSION) is None
    again, _ = _native._load()
    assert again.reason == "cached" and len(fake_builds) == 2


@needs_native
def test_another_library_with_a_matching_record_is_not_an_attribute_error(
    fake_builds, caplog, monkeypatch, tmp_path
):
    """Both the library and its record replaced: the missing kernel is reported, not raised."""
    other = Path(torch.__file__).parent / "lib" / "libshm.so"
    if not other.exists():
        pytest.skip("no libshm.so beside torch to stand in for another library")
    # A cache path this process has not mapped yet (dlopen reuses a loaded path's handle).
    fresh = tmp_path / "fresh"
    monkeypatch.setenv("GRADSKETCH_CACHE", str(fresh))
    target = fresh / "native" / fake_builds[0].name
    target.parent.mkdir(parents=True)
    target.write_bytes(other.read_bytes())
    _native_build.sidecar(target).write_text(
        json.dumps(_native_build.record(other.read_bytes(), _native.ABI_VERSION))
    )
    with caplog.at_level(logging.WARNING, logger=_native_build.__name__):
        status, kernels = _native._load()
    # Rebuilt on disk; this process may still hold the other library under the same name.
    assert (
        fake_builds[1:] == [target]
        and _native_build.check_cached(target, _native.ABI_VERSION) is None
    )
    assert target.read_bytes() == fake_builds[0].read_bytes()
    assert "rebuilding" in caplog.text and "gs_abi_version" in caplog.text
    assert status.available or ("lacks a kernel" in status.reason and kernels is None), status


def test_falling_back_to_torch_warns_once_with_the_reason(monkeypatch, tmp_path, caplog):
    monkeypatch.delenv("GRADSKETCH_NATIVE", raising=False)
    monkeypatch.setenv("GRADSKETCH_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setattr(_native._LOADED, "state", None)
    with caplog.at_level(logging.INFO, logger=_native_build.__name__):
        assert _native.library() is None and not _native.available(torch.device("cpu"))
        assert _native.native_status().available is False
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, caplog.text
    assert "using torch's scatter" in warnings[0].getMessage()
    assert _native.native_status().reason in warnings[0].getMessage()


def test_turning_the_kernels_off_is_logged_at_info(monkeypatch, caplog):
    monkeypatch.setenv("GRADSKETCH_NATIVE", "0")
    monkeypatch.setattr(_native._LOADED, "state", None)
    with caplog.at_level(logging.INFO, logger=_native_build.__name__):
        assert _native.library() is None
    assert [r.levelno for r in caplog.records] == [logging.INFO]
