"""Build, check and load gradsketch's native CPU libraries (the ground floor under them).

Each native library is one C file (with the headers it includes) described
by a :class:`NativeSpec`: ``sketch`` (the count-sketch scatter and the
sampler's Gram, :mod:`gradsketch.sketch._native`) and ``train`` (the SLT
sampler's train-mode kernels, :mod:`gradsketch.slt._fast._native`). This
module holds what they share: compiling at first use with the system C
compiler (``$CC``, else ``cc``) and ``-O3 -march=native -fopenmp``, the way
``torch.compile`` builds its CPU kernels, caching under
``$GRADSKETCH_CACHE`` (default ``~/.cache/gradsketch``) keyed by the
sources, the compiler and the CPU, the switches, and the BLAS lookup.

Switches: ``GRADSKETCH_NATIVE=0`` turns every library off;
``GRADSKETCH_NATIVE_SKETCH=0`` / ``GRADSKETCH_NATIVE_TRAIN=0`` one of them.
Their OpenMP regions run on the libgomp torch has already loaded, so they
share torch's threads; where that cannot be guaranteed (not Linux, torch
built without OpenMP, no compiler, a second OpenMP runtime) the callers use
torch's operations instead.

A cached library cannot take the process down: it is built under a
temporary name and renamed into place, its size, SHA-256 and interface
version are recorded in a sidecar (``<library>.json``) written the same way,
and the bytes are checked against the record before ``ctypes`` maps them (a
truncated file mapped would end the process with SIGBUS). A library that
fails the check, or lacks a kernel, is rebuilt; builds and checks hold a
file lock beside the library, so concurrent processes build once.

Example:
    >>> status, lib = load(NativeSpec("demo", Path("/nonexistent"), ("x.c",), 1, ()),
    ...                    env={"GRADSKETCH_NATIVE_DEMO": "0"})
    >>> status.available, status.reason, lib
    (False, 'disabled by GRADSKETCH_NATIVE_DEMO=0', None)
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
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch
from filelock import FileLock

logger = logging.getLogger(__name__)

__all__ = [
    "FLAGS",
    "X86_FLAGS",
    "NativeSpec",
    "NativeStatus",
    "blas_sgemm",
    "build",
    "cache_root",
    "check_cached",
    "find_sgemm",
    "load",
    "record",
    "report_fallback",
    "segment_pointers",
    "sidecar",
    "switched_off",
]

#: Compiler flags (``-march=native`` is added when the compiler accepts it); C11 for
#: ``aligned_alloc``.
FLAGS = ("-O3", "-funroll-loops", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
#: Tried first with ``-march=native`` on x86-64: loops vectorize with AVX-512's 16 lanes where
#: the CPU has them (gcc and clang default to 8 on most AVX-512 CPUs).
X86_FLAGS = ("-mprefer-vector-width=512",)
#: The switch that turns every native library off.
ALL_SWITCH = "GRADSKETCH_NATIVE"
_OFF = ("0", "false", "no", "off")


@dataclass(frozen=True)
class NativeStatus:
    """Whether a native library is in use, and why not when it is not.

    Attributes:
        available: the library is loaded and every eligible call uses it.
        reason: how it was obtained (``"compiled"``, ``"cached"``) or why not.
        path: the shared library, when available.
    """

    available: bool
    reason: str
    path: str | None = None


@dataclass(frozen=True)
class NativeSpec:
    """One native library: its sources, interface version and required kernels.

    Attributes:
        name: the library's name (``"sketch"``, ``"train"``): its file stem
            ``gs_<name>`` and its switch ``GRADSKETCH_NATIVE_<NAME>``.
        source_dir: the directory of the sources (package data).
        sources: the compiled C file first, then the headers it includes
            (all of them key the cache).
        abi_version: what the library's ``abi_symbol`` must return.
        symbols: kernels the library must export; one missing gets it rebuilt.
        abi_symbol: the exported ``int f(void)`` giving the interface version.
    """

    name: str
    source_dir: Path
    sources: tuple[str, ...]
    abi_version: int
    symbols: tuple[str, ...]
    abi_symbol: str = "gs_abi_version"

    @classmethod
    def typed(
        cls, name: str, package_file: str, sources: tuple[str, ...], abi_version: int, prefix: str
    ) -> NativeSpec:
        """A library in ``csrc/`` beside ``package_file`` exporting ``{prefix}_{value}_{index}``.

        Those kernels are instantiated for every value and index type
        (:func:`kernel_symbols`).
        """
        return cls(
            name, Path(package_file).with_name("csrc"), sources, abi_version, kernel_symbols(prefix)
        )

    @property
    def switch(self) -> str:
        """The environment variable that turns this library alone off."""
        return f"{ALL_SWITCH}_{self.name.upper()}"


def cache_root() -> Path:
    """``$GRADSKETCH_CACHE``, else ``$XDG_CACHE_HOME/gradsketch`` (``~/.cache/gradsketch``)."""
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
    return shutil.which(os.environ.get("CC", "cc"))


def _openmp_runtimes() -> set[str]:
    """Distinct OpenMP runtime files mapped into this process (Linux)."""
    names = ("libgomp", "libiomp", "libomp.")
    found = set()
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            if "omp" not in line:  # most of the thousands of lines: skip them cheaply
                continue
            path = line.split()[-1]
            if any(n in os.path.basename(path) for n in names):
                found.add(os.path.realpath(path))
    except OSError:
        pass
    return found


def switched_off(spec: NativeSpec, env: Mapping[str, str] | None = None) -> str | None:
    """``"disabled by <switch>=0"`` when ``GRADSKETCH_NATIVE`` or the library's switch is off."""
    env = os.environ if env is None else env
    for switch in (ALL_SWITCH, spec.switch):
        if env.get(switch, "1").strip().lower() in _OFF:
            return f"disabled by {switch}=0"
    return None


def _unsupported_reason(spec: NativeSpec, env: Mapping[str, str] | None) -> str | None:
    off = switched_off(spec, env)
    if off is not None:
        return off
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


def sidecar(target: Path) -> Path:
    """The record of ``target``'s size, SHA-256 and interface version."""
    return target.with_name(target.name + ".json")


def record(data: bytes, abi: int) -> dict[str, Any]:
    """The sidecar record of a library's bytes ``data`` with interface version ``abi``."""
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "abi": abi}


def check_cached(target: Path, abi: int) -> str | None:
    """None when ``target`` matches its sidecar record; else what is wrong with it.

    Reads the bytes rather than mapping them: a truncated or garbled file is
    found here, before ``ctypes.CDLL`` could fault on it.
    """
    side = sidecar(target)
    try:
        recorded = json.loads(side.read_text())
    except (OSError, ValueError) as err:
        return f"its record {side.name} is missing or unreadable ({type(err).__name__})"
    try:
        data = target.read_bytes()
    except OSError as err:
        return f"it cannot be read ({err})"
    if not data.startswith(b"\x7fELF"):
        return "it is not an ELF shared library"
    if recorded != record(data, abi):
        return (
            f"its {len(data)} bytes do not match the record ({recorded.get('size')} bytes, "
            f"SHA-256 {str(recorded.get('sha256'))[:12]}..., ABI {recorded.get('abi')})"
        )
    return None


def build(spec: NativeSpec, compiler: str, target: Path) -> None:
    """Compile ``spec``'s C file into ``target`` atomically (a concurrent reader sees no torn file).

    The library is written under a temporary name, its sidecar record next,
    then both are renamed into place (record first: a library without its
    matching record is rebuilt, never loaded).
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    base = [compiler, *FLAGS]
    tail = ["-I", str(spec.source_dir), str(spec.source_dir / spec.sources[0])]
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
                staged = Path(tmp) / "record.json"
                staged.write_text(json.dumps(record(built.read_bytes(), spec.abi_version)))
                os.replace(staged, sidecar(target))
                os.replace(built, target)
                return
            errors.append(f"{' '.join(cmd)}: {proc.stderr.strip()[-500:]}")
    raise RuntimeError("; ".join(errors))


def _target(spec: NativeSpec, compiler: str) -> Path | str:
    """The cache path for ``spec`` built by ``compiler`` here, or why it cannot be named."""
    digest = hashlib.sha256()
    for name in spec.sources:
        digest.update((spec.source_dir / name).read_bytes())
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=60, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError) as err:
        return f"running {compiler} --version failed: {err}"
    digest.update(
        f"{compiler}|{version}|{FLAGS}|{X86_FLAGS}|{_march()}|{_cpu_signature()}|{sys.platform}".encode()
    )
    return cache_root() / "native" / f"gs_{spec.name}-{digest.hexdigest()[:20]}.so"


def load(
    spec: NativeSpec, *, env: Mapping[str, str] | None = None
) -> tuple[NativeStatus, ctypes.CDLL | None]:
    """Load ``spec``'s library, compiling it first if the cache has no sound copy.

    Never raises for a missing compiler, a failed build or a bad cache entry:
    the status says why the library is not available (None beside it).
    """
    reason = _unsupported_reason(spec, env)
    if reason is not None:
        return NativeStatus(False, reason), None
    compiler = _compiler()
    if compiler is None:
        return NativeStatus(False, "no C compiler found (set CC or install gcc)"), None
    target = _target(spec, compiler)
    if isinstance(target, str):
        return NativeStatus(False, target), None
    failed = f"compiling the native {spec.name} kernels failed"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(target.with_name(target.name + ".lock")), timeout=900):
            how = _ensure_built(spec, compiler, target)
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        return NativeStatus(False, f"{failed}: {err}"), None
    status, lib = _bind(spec, target, how)
    if lib is None and how == "cached" and status.reason.startswith(str(target)):
        # Checked bytes that still lack a kernel (another library with a record to match):
        # build afresh once.
        logger.warning("gradsketch native kernels: rebuilding %s (%s)", target, status.reason)
        try:
            with FileLock(str(target.with_name(target.name + ".lock")), timeout=900):
                sidecar(target).unlink(missing_ok=True)
                how = _ensure_built(spec, compiler, target)
        except (OSError, RuntimeError, subprocess.SubprocessError) as err:
            return NativeStatus(False, f"{failed}: {err}"), None
        status, lib = _bind(spec, target, how)
    return status, lib


def _ensure_built(spec: NativeSpec, compiler: str, target: Path) -> str:
    """``"cached"`` when ``target`` passes :func:`check_cached`, else build it: ``"compiled"``."""
    problem = check_cached(target, spec.abi_version) if target.exists() else "absent"
    if problem is None:
        return "cached"
    if target.exists():
        logger.warning(
            "gradsketch native kernels: the cached %s failed its check (%s); rebuilding it",
            target,
            problem,
        )
    build(spec, compiler, target)
    problem = check_cached(target, spec.abi_version)
    if problem is not None:
        raise RuntimeError(f"the library just built at {target} fails its check: {problem}")
    return "compiled"


def _bind(spec: NativeSpec, target: Path, how: str) -> tuple[NativeStatus, ctypes.CDLL | None]:
    """Map the checked ``target`` and check its interface; say why not when it cannot."""
    before = _openmp_runtimes()
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as err:
        return NativeStatus(False, f"loading {target} failed: {err}"), None
    after = _openmp_runtimes()
    if len(after) > max(1, len(before)):
        return NativeStatus(False, f"a second OpenMP runtime was loaded: {sorted(after)}"), None
    try:
        if getattr(lib, spec.abi_symbol)() != spec.abi_version:
            return NativeStatus(False, f"{target} has another interface version"), None
        for symbol in spec.symbols:
            getattr(lib, symbol)
    except AttributeError as err:
        return NativeStatus(False, f"{target} lacks a kernel ({err}); delete it to rebuild"), None
    logger.info("gradsketch native %s kernels %s: %s", spec.name, how, target)
    return NativeStatus(True, how, str(target)), lib


#: Name suffixes of the value and index types the kernels are instantiated for.
VALUE_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}
INDEX_SUFFIX = {torch.int16: "i16", torch.int32: "i32", torch.int64: "i64"}


def kernel_symbols(prefix: str) -> tuple[str, ...]:
    """``{prefix}_{value}_{index}`` for every value and index type the kernels take."""
    return tuple(f"{prefix}_{v}_{i}" for v in VALUE_SUFFIX.values() for i in INDEX_SUFFIX.values())


#: Bound kernels by (value type, index type) name, as :func:`bind_kernels` returns them.
Kernels = dict[tuple[str, str], Any]
_Bound = TypeVar("_Bound")


def bind_kernels(
    spec: NativeSpec,
    prefix: str,
    values: Iterable[str],
    indices: Iterable[str],
    argtypes: list[Any],
    *,
    keep_library: bool = False,
) -> tuple[NativeStatus, Kernels | None]:
    """Load ``spec``'s library and bind ``{prefix}_{value}_{index}`` for every pair.

    Every kernel takes ``argtypes`` and returns a C ``int``. With
    ``keep_library`` the library itself stands under the key ``("library", "")``.
    """
    status, lib = load(spec)
    if lib is None:
        return status, None
    kernels: Kernels = {("library", ""): lib} if keep_library else {}
    indices = tuple(indices)
    for value in values:
        for index in indices:
            fn = getattr(lib, f"{prefix}_{value}_{index}")
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int
            kernels[value, index] = fn
    return status, kernels


class OnceLoaded(Generic[_Bound]):
    """A native library's kernels, bound the first time any thread asks for them.

    ``bind`` runs once per process, under a lock; a library that is not used
    is reported then (:func:`report_fallback`), ``instead`` naming what the
    callers use in its place. :attr:`state` is ``None`` until then; tests set
    it to switch the kernels off or to force a fresh load.

    Example:
        >>> spec = NativeSpec("demo", Path("."), ("gs_demo.c",), 1, ())
        >>> loaded = OnceLoaded(spec, lambda: (NativeStatus(False, "disabled by a test"), None),
        ...                     "plain torch")
        >>> loaded.get() is None, loaded.status().reason
        (True, 'disabled by a test')
    """

    def __init__(
        self,
        spec: NativeSpec,
        bind: Callable[[], tuple[NativeStatus, _Bound | None]],
        instead: str,
    ) -> None:
        self.spec = spec
        self._bind = bind
        self._instead = instead
        self._lock = threading.Lock()
        self.state: tuple[NativeStatus, _Bound | None] | None = None

    def _loaded(self) -> tuple[NativeStatus, _Bound | None]:
        state = self.state
        if state is None:
            with self._lock:
                state = self.state
                if state is None:
                    state = self.state = self._bind()
                    report_fallback(self.spec, state[0], self._instead)
        return state

    def get(self) -> _Bound | None:
        """The bound kernels (or library), loading them first; None when unavailable."""
        return self._loaded()[1]

    def status(self) -> NativeStatus:
        """Whether the kernels are in use, and why not when they are not (loads them first)."""
        return self._loaded()[0]


def report_fallback(spec: NativeSpec, status: NativeStatus, instead: str) -> None:
    """Log once why ``spec``'s kernels are not used: WARNING, or INFO when switched off.

    ``instead`` names what the callers use in their place.
    """
    if status.available:
        return
    logger.log(
        logging.INFO if status.reason.startswith("disabled by ") else logging.WARNING,
        "gradsketch native %s kernels unavailable, using %s (same results, slower): %s",
        spec.name,
        instead,
        status.reason,
    )


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
    return find_sgemm()


def find_sgemm(*, torch_first: bool = True) -> int | None:
    """:func:`blas_sgemm`'s lookup (``torch_first=False``: SciPy's, for the tests)."""
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


def segment_pointers(
    segments: list[list[torch.Tensor]],
) -> tuple[list[int], list[int]] | None:
    """Rows given as segments, as a kernel reads them: data pointers and segment starts.

    ``segments[s][q]`` is row q's part s. Every part of a segment has the
    segment's length, and every part is contiguous CPU memory of the first
    part's dtype. Returns the pointers (segment by segment, row by row) and
    each segment's first column, the last entry the total width; None where a
    part breaks those rules, so that the caller runs its torch path instead.

    Example:
        >>> rows = [[torch.ones(3), torch.zeros(3)], [torch.ones(2), torch.ones(2)]]
        >>> segment_pointers(rows)[1]
        [0, 3, 5]
    """
    r = len(segments[0])
    dtype = segments[0][0].dtype
    ptrs: list[int] = []
    starts = [0]
    for seg in segments:
        if len(seg) != r:
            return None
        length = seg[0].numel()
        for t in seg:
            if t.dtype != dtype or t.device.type != "cpu" or t.numel() != length:
                return None
            if not (t.is_contiguous() or length <= 1):
                return None
            ptrs.append(t.data_ptr())
        starts.append(starts[-1] + length)
    return ptrs, starts
