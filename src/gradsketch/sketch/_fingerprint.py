"""Fingerprints: the small JSON record that fixes a sketch completely."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from gradsketch._settings import settings_from_record
from gradsketch.errors import FingerprintMismatchError
from gradsketch.sketch._tables import HASH_VERSION


@dataclass(frozen=True)
class Fingerprint:
    """Everything that determines a sketch's linear map, and nothing else.

    Two sketches with equal fingerprints are the same map on every device,
    for every block size and chunking. Block sizes, devices and dtypes are
    deliberately *not* part of it.

    Attributes:
        kind: ``"count_sketch"``, ``"count_sketch_projector"``, ``"sparse"``,
            ``"dense"`` or ``"noop"``.
        seed: the user's seed.
        input_dim: d, the number of coordinates sketched.
        output_dim: k, the sketch size.
        proj_type: ``"normal"`` / ``"rademacher"`` for dense maps, else None.
        model_id: checkpoint id for projectors (TRAK re-seeds per checkpoint);
            None for :class:`CountSketch`.
        nnz: non-zeros per input coordinate for sparse maps, else None.
        mask: fingerprint of a :class:`gradsketch.masked.ParamMask` when only
            selected coordinates are sketched, else None.
        extra: kind-specific structure as compact JSON text (for example the
            per-layer dimensions of a factorized projection), else None.
        hash_version: version of the counter-based hash.

    Example:
        >>> fp = Fingerprint("sparse", seed=0, input_dim=10, output_dim=4, nnz=2)
        >>> Fingerprint.from_json(fp.to_json()) == fp
        True
    """

    kind: str
    seed: int
    input_dim: int
    output_dim: int
    proj_type: str | None = None
    model_id: int | None = None
    nnz: int | None = None
    mask: str | None = None
    extra: str | None = None
    hash_version: int = HASH_VERSION

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form, suitable for JSON."""
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        """JSON text with sorted keys (stable across runs)."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Fingerprint:
        """Inverse of :meth:`to_dict`; unknown keys are an error."""
        return settings_from_record(cls, data, what="fingerprint")

    @classmethod
    def from_json(cls, text: str) -> Fingerprint:
        """Inverse of :meth:`to_json`."""
        return cls.from_dict(json.loads(text))

    def with_model_id(self, model_id: int) -> Fingerprint:
        """The same fingerprint for another checkpoint."""
        return dataclasses.replace(self, model_id=model_id)

    def require_same(self, other: Fingerprint, what: str = "sketches") -> None:
        """Raise :class:`FingerprintMismatchError` unless ``other`` equals ``self``.

        The message lists every field that differs, with both values.
        """
        if self == other:
            return
        diffs = [
            f"{f.name}: {getattr(self, f.name)!r} != {getattr(other, f.name)!r}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]
        raise FingerprintMismatchError(
            f"cannot combine {what} made by different maps ({'; '.join(diffs)}). "
            "Recompute one side with the other's fingerprint."
        )
