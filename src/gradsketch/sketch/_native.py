"""Native CPU kernels for the count-sketch scatter, compiled at first use.

torch's CPU scatter (``index_add_`` / ``scatter_add_``) is generic: every
element pays for stride arithmetic, a bounds check and a loop over the
other dimensions, and one row runs on one thread. The count sketch is the
library's hot loop (the projectors, :class:`CountSketch`, the sampler's
per-step sketches), so ``csrc/gs_kernels.c`` does it directly: four rows
share each index load, a chunk of columns stays in cache, and few rows are
split by columns over torch's threads. The sampler's pass also takes the
Gram matrix of its rows from the chunk the scatter has just read, so the
rows are read from memory once.

The C file is compiled the first time a kernel is needed, with the system
C compiler (``$CC``, else ``cc``) and ``-O3 -march=native -fopenmp``, the
way ``torch.compile`` builds its CPU kernels, and cached under
``$GRADSKETCH_CACHE`` (default ``~/.cache/gradsketch``) keyed by the source,
the compiler and the CPU. Its OpenMP regions run on the libgomp torch has
already loaded, so they share torch's threads. Where that cannot be
guaranteed (not Linux, torch built without OpenMP, no compiler, a second
OpenMP runtime), or with ``GRADSKETCH_NATIVE=0``, every caller uses torch's
scatter instead: same results up to the order of float additions, with one
WARNING-level log line saying why (INFO when turned off on purpose).

A cached library cannot take the process down: it is built under a
temporary name and renamed into place, its size, SHA-256 and interface
version are recorded in a sidecar (``<library>.json``) written the same way,
and the bytes are checked against the record before ``ctypes`` maps them (a
truncated file mapped would end the process with SIGBUS). A library that
fails the check, or lacks a kernel, is rebuilt; builds and checks hold a
file lock beside the library, so concurrent processes build once.

Example:
    >>> import torch
    >>> out = torch.zeros(1, 4)
    >>> used = reduce_(out, torch.tensor([0, 3, 3]), torch.ones(1, 3))
    >>> out if used else torch.tensor([[1.0, 0.0, 0.0, 2.0]])
    tensor([[1., 0., 0., 2.]])
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock

logger = logging.getLogger(__name__)

__all__ = [
    "NativeStatus",
    "available",
    "blas_sgemm",
    "library",
    "native_status",
    "reduce_",
    "reduce_rows_",
]

#: The C sources, shipped as package data.
SOURCE_DIR = Path(__file__).with_name("csrc")
SOURCES = ("gs_kernels.c", "gs_reduce.h", "gs_train.h")
#: Compiler flags (``-march=native`` is added when the compiler accepts it).
FLAGS = ("-O3", "-funroll-loops", "-fopenmp", "-shared", "-fPIC", "-std=gnu99")
#: Tried first with ``-march=native`` on x86-64: loops vectorize with AVX-512's 16 lanes where
#: the CPU has them (gcc and clang default to 8 on most AVX-512 CPUs).
X86_FLAGS = ("-mprefer-vector-width=512",)
#: Must equal ``gs_abi_version()`` in ``gs_kernels.c``.
ABI_VERSION = 4
#: Columns per chunk when threads split the columns: the chunk's rows stay in
#: L1 from the scatter to the Gram (3 rows of 2048 float32 are 24 KB).
CHUNK = 2048
#: Columns per chunk when threads take whole rows: the index slice is read by
#: every group of four rows from L2 (measured on 32 rows of 2^20: 16384 columns
#: take 9.1-10.7 ms, 2048 take 10.6-11.6 ms).
ROW_CHUNK = 1 << 14
#: Fewest rows per thread for the transposed scatter (0 turns it off), which
#: holds a ``[width, 16]`` float32 (``[width, 8]`` float64) buffer per thread
#: (on two threads, per row: 2 rows lose, 4 rows gain a third, 16 rows two thirds).
TRANSPOSED_MIN_ROWS = 4
#: Largest transposed buffer per thread, in bytes: it stays in L2.
TRANSPOSED_MAX_BYTES = 1 << 20
#: Fewest elements per thread worth a thread of its own.
MIN_PER_THREAD = 1 << 15

_VALUE = {torch.float32: "f32", torch.float64: "f64"}
_INDEX = {torch.int16: "i16", torch.int32: "i32", torch.int64: "i64"}
_ARGTYPES = [
    ctypes.c_void_p,  # ptrs: row q of segment s at [s * r + q]
    ctypes.c_void_p,  # starts: int64 [nseg + 1] first column of each segment
    ctypes.c_int64,  # nseg
    ctypes.c_int64,  # r
    ctypes.c_int64,  # srows
    ctypes.c_void_p,  # idx
    ctypes.c_void_p,  # out
    ctypes.c_int64,  # width
    ctypes.c_int64,  # os
    ctypes.c_void_p,  # gram
    ctypes.c_int,  # threads
    ctypes.c_int64,  # chunk
    ctypes.c_int64,  # tmin
]
#: Rows one kernel call takes (``GS_MAX_ROWS`` in ``gs_kernels.c``).
MAX_ROWS = 64


@dataclass(frozen=True)
class NativeStatus:
    """Whether the native kernels are in use, and why not when they are not.

    Attributes:
        available: the library is loaded and every eligible call uses it.
        reason: how it was obtained (``"compiled"``, ``"cached"``) or why not.
        path: the shared library, when available.
    """

    available: bool
    reason: str
    path: str | None = None


_lock = threading.Lock()
_state: tuple[NativeStatus, dict[tuple[str, str], Any] | None] | None = None
#: The key of the loaded library itself among ``_state``'s kernels.
_LIBRARY = ("library", "")


def _cache_root() -> Path:
    env = os.environ.get("GRADSKETCH_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gradsketch"


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the machine and its instruction-set flags."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features", "model name")):
                flags += line
    except OSError:
        pass
    return f"{platform.machine()}|{flags}"


def _compiler() -> str | None:
    cc = os.environ.get("CC", "cc")
    return shutil.which(cc)


def _openmp_runtimes() -> set[str]:
    """Distinct OpenMP runtime files mapped into this process (Linux)."""
    names = ("libgomp", "libiomp", "libomp.")
    found = set()
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            path = line.split()[-1]
            if any(n in os.path.basename(path) for n in names):
                found.add(os.path.realpath(path))
    except OSError:
        pass
    return found


def _unsupported_reason() -> str | None:
    if os.environ.get("GRADSKETCH_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        return "disabled by GRADSKETCH_NATIVE=0"
    if not sys.platform.startswith("linux"):
        return f"native kernels are built on Linux only (this is {sys.platform})"
    if "ATen parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return "torch was built without OpenMP, whose threads the kernels share"
    return None


def _march() -> str:
    """The ``-march`` target: ``$GRADSKETCH_NATIVE_MARCH`` (say ``x86-64-v3``), else ``native``.

    An explicit target builds the kernels for another instruction set than
    this CPU's (the tests build an AVX2-only one), in a cache entry of its own.
    """
    return os.environ.get("GRADSKETCH_NATIVE_MARCH", "").strip() or "native"


def _sidecar(target: Path) -> Path:
    """The record of ``target``'s size, SHA-256 and interface version."""
    return target.with_name(target.name + ".json")


def _record(data: bytes) -> dict[str, Any]:
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "abi": ABI_VERSION}


def _check_cached(target: Path) -> str | None:
    """None when ``target`` matches its sidecar record; else what is wrong with it.

    Reads the bytes rather than mapping them: a truncated or garbled file is
    found here, before ``ctypes.CDLL`` could fault on it.
    """
    side = _sidecar(target)
    try:
        record = json.loads(side.read_text())
    except (OSError, ValueError) as err:
        return f"its record {side.name} is missing or unreadable ({type(err).__name__})"
    try:
        data = target.read_bytes()
    except OSError as err:
        return f"it cannot be read ({err})"
    if not data.startswith(b"\x7fELF"):
        return "it is not an ELF shared library"
    if record != _record(data):
        return (
            f"its {len(data)} bytes do not match the record ({record.get('size')} bytes, "
            f"SHA-256 {str(record.get('sha256'))[:12]}..., ABI {record.get('abi')})"
        )
    return None


def _build(compiler: str, target: Path) -> None:
    """Compile the sources into ``target`` atomically (a concurrent build cannot tear it).

    The library is written under a temporary name, its sidecar record next,
    then both are renamed into place (record first: a library without its
    matching record is rebuilt, never loaded).
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    base = [compiler, *FLAGS]
    tail = ["-I", str(SOURCE_DIR), str(SOURCE_DIR / SOURCES[0])]
    errors = []
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        march = _march()
        arch_flags = [f"-march={march}"]
        # -march=native may be refused (an old compiler, an unknown CPU): retry generic.
        tries = [arch_flags, []] if march == "native" else [arch_flags]
        if platform.machine() in ("x86_64", "AMD64"):
            tries.insert(0, [*arch_flags, *X86_FLAGS])
        for arch in tries:
            cmd = [*base, *arch, *tail, "-o", str(built)]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
            if proc.returncode == 0:
                record = Path(tmp) / "record.json"
                record.write_text(json.dumps(_record(built.read_bytes())))
                os.replace(record, _sidecar(target))
                os.replace(built, target)
                return
            errors.append(f"{' '.join(cmd)}: {proc.stderr.strip()[-500:]}")
    raise RuntimeError("; ".join(errors))


def _load() -> tuple[NativeStatus, dict[tuple[str, str], Any] | None]:
    reason = _unsupported_reason()
    if reason is not None:
        return NativeStatus(False, reason), None
    compiler = _compiler()
    if compiler is None:
        return NativeStatus(False, "no C compiler found (set CC or install gcc)"), None
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update((SOURCE_DIR / name).read_bytes())
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=60, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError) as err:
        return NativeStatus(False, f"running {compiler} --version failed: {err}"), None
    digest.update(
        f"{compiler}|{version}|{FLAGS}|{X86_FLAGS}|{_march()}|{_cpu_signature()}|{sys.platform}".encode()
    )
    target = _cache_root() / "native" / f"gs_kernels-{digest.hexdigest()[:20]}.so"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(target.with_name(target.name + ".lock")), timeout=900):
            how = _ensure_built(compiler, target)
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        return NativeStatus(False, f"compiling the native kernels failed: {err}"), None
    status, kernels = _bind(target, how)
    if kernels is None and how == "cached" and status.reason.startswith(str(target)):
        # Checked bytes that still lack a kernel (another library with a record to match):
        # build afresh once.
        logger.warning("gradsketch native kernels: rebuilding %s (%s)", target, status.reason)
        try:
            with FileLock(str(target.with_name(target.name + ".lock")), timeout=900):
                _sidecar(target).unlink(missing_ok=True)
                how = _ensure_built(compiler, target)
        except (OSError, RuntimeError, subprocess.SubprocessError) as err:
            return NativeStatus(False, f"compiling the native kernels failed: {err}"), None
        status, kernels = _bind(target, how)
    return status, kernels


def _ensure_built(compiler: str, target: Path) -> str:
    """``"cached"`` when ``target`` passes :func:`_check_cached`, else build it: ``"compiled"``."""
    problem = _check_cached(target) if target.exists() else "absent"
    if problem is None:
        return "cached"
    if target.exists():
        logger.warning(
            "gradsketch native kernels: the cached %s failed its check (%s); rebuilding it",
            target,
            problem,
        )
    _build(compiler, target)
    problem = _check_cached(target)
    if problem is not None:
        raise RuntimeError(f"the library just built at {target} fails its check: {problem}")
    return "compiled"


def _bind(target: Path, how: str) -> tuple[NativeStatus, dict[tuple[str, str], Any] | None]:
    """Load the checked ``target`` and bind its kernels; say why not when it cannot."""
    before = _openmp_runtimes()
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as err:
        return NativeStatus(False, f"loading {target} failed: {err}"), None
    after = _openmp_runtimes()
    if len(after) > max(1, len(before)):
        return NativeStatus(False, f"a second OpenMP runtime was loaded: {sorted(after)}"), None
    kernels: dict[tuple[str, str], Any] = {_LIBRARY: lib}
    try:
        if lib.gs_abi_version() != ABI_VERSION:
            return NativeStatus(False, f"{target} has another interface version"), None
        for value in _VALUE.values():
            for index in _INDEX.values():
                fn = getattr(lib, f"gs_reduce_{value}_{index}")
                fn.argtypes = _ARGTYPES
                fn.restype = ctypes.c_int
                kernels[value, index] = fn
    except AttributeError as err:
        return NativeStatus(False, f"{target} lacks a kernel ({err}); delete it to rebuild"), None
    logger.info("gradsketch native kernels %s: %s", how, target)
    return NativeStatus(True, how, str(target)), kernels


def _kernels() -> dict[tuple[str, str], Any] | None:
    global _state
    if _state is None:
        with _lock:
            if _state is None:
                _state = _load()
                status = _state[0]
                if not status.available:
                    # Once per process: WARNING unless turned off on purpose.
                    on_purpose = status.reason.startswith("disabled by GRADSKETCH_NATIVE")
                    logger.log(
                        logging.INFO if on_purpose else logging.WARNING,
                        "gradsketch native kernels unavailable, using torch's scatter "
                        "(same results, slower): %s",
                        status.reason,
                    )
    return _state[1]


def native_status() -> NativeStatus:
    """Load (compiling if needed) the native kernels and say whether they are in use.

    Example:
        >>> isinstance(native_status().available, bool)
        True
    """
    _kernels()
    assert _state is not None
    return _state[0]


def library() -> ctypes.CDLL | None:
    """The loaded library (None when unavailable), for callers binding its other kernels.

    ``gs_train.h``'s kernels are reached through
    :func:`gradsketch.sketch._backend.native_library`.

    Example:
        >>> library() is None or hasattr(library(), "gs_dropout_f32")
        True
    """
    kernels = _kernels()
    return None if kernels is None else kernels.get(_LIBRARY)


@functools.cache
def blas_sgemm() -> int | None:
    """The address of a Fortran-interface ``sgemm`` for the native kernels, else None.

    torch's own (MKL's ``sgemm_``, exported by ``libtorch_cpu`` in x86 builds)
    when it has one, else SciPy's (``scipy.linalg.cython_blas``); looked up
    once.

    Example:
        >>> address = blas_sgemm()
        >>> address is None or address > 0
        True
    """
    return _find_sgemm()


def _find_sgemm(*, torch_first: bool = True) -> int | None:
    if torch_first:
        try:
            torch_cpu = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
            return ctypes.cast(torch_cpu.sgemm_, ctypes.c_void_p).value
        except (OSError, AttributeError):
            pass
    try:
        from scipy.linalg import cython_blas
    except ImportError:
        return None
    capsule = cython_blas.__pyx_capi__["sgemm"]  # type: ignore[attr-defined]
    api = ctypes.pythonapi
    api.PyCapsule_GetName.restype = ctypes.c_char_p
    api.PyCapsule_GetName.argtypes = [ctypes.py_object]
    api.PyCapsule_GetPointer.restype = ctypes.c_void_p
    api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    return api.PyCapsule_GetPointer(capsule, api.PyCapsule_GetName(capsule))  # type: ignore[no-any-return]


def available(device: torch.device) -> bool:
    """True when eligible scatters on ``device`` use the native kernels (CPU only)."""
    return device.type == "cpu" and _kernels() is not None


def _eligible(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dim() == 2 and (t.stride(1) == 1 or t.shape[1] <= 1)


def reduce_(
    out: torch.Tensor | None,
    index: torch.Tensor | None,
    block: torch.Tensor,
    *,
    rows: int | None = None,
    gram: torch.Tensor | None = None,
) -> bool:
    """``out[:, index] += block[:rows]`` (a scatter along columns) and ``gram = block @ block.T``.

    Returns False, touching nothing, when the native kernels are unavailable
    or the tensors do not fit them (not CPU, other dtypes, columns not
    contiguous): the caller then does the same with torch.

    Args:
        out: ``[rows, width]`` accumulator, the dtype of ``block``; None with ``rows=0``.
        index: int16/32/64 ``[n]`` column of ``out`` for each column of ``block``.
        block: float32/float64 ``[r, n]`` values.
        rows: leading rows of ``block`` to scatter (default all).
        gram: float64 ``[r, r]`` contiguous output for the Gram matrix, or None.

    Raises:
        IndexError: if ``index`` holds a column outside ``out`` (those
            entries are skipped; the others are added).
        MemoryError: if the per-thread partial sums cannot be allocated.
    """
    if not _eligible(block):
        return False
    r, n = block.shape
    rows = r if rows is None else rows
    # Row pointers by arithmetic: building a view per row costs a microsecond
    # each, which small blocks of many rows (a batch of per-parameter
    # gradients) would pay on every call.
    base, step = block.data_ptr(), block.stride(0) * block.element_size()
    if gram is not None or r <= MAX_ROWS:
        ptrs = [base + q * step for q in range(r)]
        return _run(ptrs, [0, n], r, rows, index, out, gram, block.dtype)
    # More rows than one call takes: slices of rows, each sharing the index.
    for start in range(0, rows, MAX_ROWS):
        stop = min(start + MAX_ROWS, rows)
        ptrs = [base + q * step for q in range(start, stop)]
        part = None if out is None else out[start:stop]
        if not _run(ptrs, [0, n], stop - start, stop - start, index, part, None, block.dtype):
            assert start == 0, "the same tensors were accepted for the first slice"
            return False
    return True


def reduce_rows_(
    out: torch.Tensor | None,
    index: torch.Tensor | None,
    segments: list[list[torch.Tensor]],
    *,
    rows: int | None = None,
    gram: torch.Tensor | None = None,
) -> bool:
    """:func:`reduce_` of a block given as segments of columns, each row its own tensor.

    ``segments[s][q]`` is row ``q`` of the ``s``-th run of columns (any
    contiguous tensor, flattened); the block is their concatenation along
    columns. The sampler passes one segment per parameter, with each
    parameter's gradient as a row where autograd left it (no copy into a
    workspace).

    Returns False, touching nothing, when the kernels or the tensors do not fit.
    """
    if not segments:
        return False
    r = len(segments[0])
    dtype = segments[0][0].dtype if r else None
    starts = [0]
    ptrs: list[int] = []
    for seg in segments:
        if len(seg) != r:
            return False
        length = seg[0].numel()
        for t in seg:
            if t.dtype != dtype or t.device.type != "cpu" or t.numel() != length:
                return False
            if not (t.is_contiguous() or length <= 1):
                return False
            ptrs.append(t.data_ptr())
        starts.append(starts[-1] + length)
    return _run(ptrs, starts, r, r if rows is None else rows, index, out, gram, dtype)


def _transposed_min_rows(out: torch.Tensor | None, columns: int) -> int:
    """The kernel's ``tmin``: rows per thread from which it scatters transposed (0: never).

    Never when the output is too wide for the buffer to stay in L2, or when
    the block has fewer than two columns per output column (copying the
    output into the buffer and back would cost more than it saves).
    """
    if out is None or out.shape[1] * 64 > TRANSPOSED_MAX_BYTES or columns < 2 * out.shape[1]:
        return 0
    return TRANSPOSED_MIN_ROWS


def _run(
    ptrs: list[int],
    starts: list[int],
    r: int,
    rows: int,
    index: torch.Tensor | None,
    out: torch.Tensor | None,
    gram: torch.Tensor | None,
    dtype: torch.dtype | None,
) -> bool:
    """Check the outputs against the rows (``ptrs``, segment ``starts``) and call the kernel."""
    if rows and (out is None or index is None):
        raise ValueError("`out` and `index` are needed to scatter rows; pass rows=0 for none.")
    if dtype not in _VALUE or r > MAX_ROWS or rows > r:
        return False
    n = starts[-1]
    if rows:
        assert out is not None and index is not None
        if not _eligible(out) or out.dtype != dtype or out.shape[0] < rows:
            return False
        if index.dtype not in _INDEX or index.device.type != "cpu" or index.numel() != n:
            return False
        if not index.is_contiguous():
            return False
    if gram is not None and (
        gram.dtype != torch.float64 or gram.shape != (r, r) or not gram.is_contiguous()
    ):
        return False
    kernels = _kernels()
    if kernels is None:
        return False
    if r == 0 or n == 0:
        if gram is not None:
            gram.zero_()
        return True
    fn = kernels[_VALUE[dtype], _INDEX[index.dtype] if rows and index is not None else "i64"]
    threads = max(1, min(torch.get_num_threads(), (r * n) // MIN_PER_THREAD))
    chunk = ROW_CHUNK if gram is None and rows >= 2 * threads else CHUNK
    code = fn(
        (ctypes.c_void_p * len(ptrs))(*ptrs),
        (ctypes.c_int64 * len(starts))(*starts),
        len(starts) - 1,
        r,
        rows,
        index.data_ptr() if rows and index is not None else None,
        out.data_ptr() if rows and out is not None else None,
        out.shape[1] if rows and out is not None else 0,
        out.stride(0) if rows and out is not None else 0,
        gram.data_ptr() if gram is not None else None,
        threads,
        chunk,
        _transposed_min_rows(out, n),
    )
    if code == 1:
        width = out.shape[1] if out is not None else 0
        raise IndexError(
            f"a count-sketch table holds a column outside [0, {width}) of the output; "
            "the table and the output width disagree (rebuild the table for this output_dim)."
        )
    if code == -1:
        raise MemoryError("the native scatter could not allocate its per-thread partial sums")
    return True
