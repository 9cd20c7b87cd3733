"""Seeded linear maps ``R^d -> R^k``: count sketch, sparse and dense JL projectors.

Every map is fixed by its :class:`Fingerprint` and keeps three promises:
same fingerprint, same map (any device, block size or chunking); streaming by
coordinates (``project_into_`` / ``scatter_into_`` at an offset); inner
products preserved in expectation, with the normalisation in each docstring.
"""

from gradsketch.sketch._backend import NativeStatus, native_status
from gradsketch.sketch._countsketch import SKETCH_QUANTITIES, CountSketch, SketchBuffer
from gradsketch.sketch._factorized import (
    FactorizedLayer,
    FactorizedLayoutError,
    FactorizedProjector,
    PlainParam,
)
from gradsketch.sketch._fingerprint import Fingerprint, FingerprintMismatchError
from gradsketch.sketch._projectors import (
    AbstractProjector,
    BasicProjector,
    BasicSingleBlockProjector,
    ChunkedCudaProjector,
    CountSketchProjector,
    CudaProjector,
    NoOpProjector,
    ProjectionType,
    SparseProjector,
)

__all__ = [
    # count sketch (devinterp-compatible)
    "SKETCH_QUANTITIES",
    "CountSketch",
    "SketchBuffer",
    # projectors (TRAK-compatible)
    "ProjectionType",
    "AbstractProjector",
    "NoOpProjector",
    "BasicSingleBlockProjector",
    "BasicProjector",
    "CudaProjector",
    "ChunkedCudaProjector",
    "CountSketchProjector",
    "SparseProjector",
    "FactorizedProjector",
    "FactorizedLayer",
    "PlainParam",
    "FactorizedLayoutError",
    # identity
    "Fingerprint",
    "FingerprintMismatchError",
    # native CPU kernels (compiled at first use)
    "NativeStatus",
    "native_status",
]
