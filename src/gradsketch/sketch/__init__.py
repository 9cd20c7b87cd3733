"""Seeded linear maps ``R^d -> R^k``: count sketch, sparse and dense JL projectors.

Every map is fixed by its :class:`Fingerprint` and keeps three promises:
same fingerprint, same map (any device, block size or chunking); streaming by
coordinates (``project_into_`` / ``scatter_into_`` at an offset); inner
products preserved in expectation, with the normalisation in each docstring.
"""

from gradsketch.sketch._backend import NativeStatus, default_backend, native_status
from gradsketch.sketch._countsketch import (
    SKETCH_QUANTITIES,
    CountSketch,
    SketchBuffer,
)
from gradsketch.sketch._factorized import (
    TRANSPOSED_WEIGHT,
    FactorizedLayer,
    FactorizedLayoutError,
    FactorizedProjector,
    PlainParam,
    param_layout,
)
from gradsketch.sketch._fingerprint import Fingerprint, FingerprintMismatchError
from gradsketch.sketch._ordered import SketchComponent, scatter_components_
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
from gradsketch.sketch._reduce import REDUCE_TILE, reduce_workspace
from gradsketch.sketch._validate import output_dtype

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
    # building blocks of the packages above (sampling's sketched steps, attribution's hooks)
    "default_backend",
    "reduce_workspace",
    "REDUCE_TILE",
    "scatter_components_",
    "SketchComponent",
    "param_layout",
    "TRANSPOSED_WEIGHT",
    "output_dtype",
]
