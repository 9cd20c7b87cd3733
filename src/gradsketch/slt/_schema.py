"""The sample store's schema: devinterp 2.0's zarr layout, names, dimensions and attributes.

Per chain, per step, per draw::

    sampling_loss_micro      [chain, step, batch_sampling, token_pos]  every micro-batch
    sampling_input_ids_micro [chain, step, batch_sampling, token]
    sampling_loss            [chain, draw, batch, token_pos]   the step's loss at a draw
    loss_<obs>               [chain, draw, batch_<obs>, token_pos]  fixed probe sequences
    input_ids_<obs>          [batch_<obs>, token]
    init_loss                [chain, token_pos]   L(w*) per position
    metrics_<field>          [chain, step]        with save_metrics (norms, dot products)
    sketch_<component>       [chain, step, sketch] with sketch_dim (count sketches)
    progress/init_done       [chain]              the chain's init_loss is written
    progress/chain_done      [chain]              the chain's rows are written

The root attributes hold devinterp's ``metadata`` (the sampler config and
observables), gradsketch's settings record (:data:`SETTINGS_ATTR`), the
number of sampled weights (:data:`NUMEL_ATTR`), what fast path ran
(:data:`FAST_PATH_ATTR`) and ``completed``. Chunks span one chain and as many
draws (steps) as fit in :data:`CHUNK_BYTES`; they are compressed with
Blosc-zstd and byte shuffle, then checksummed (crc32c;
:func:`gradsketch._store.array_options`); devinterp writes plain zstd, and
each library reads the other's stores.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import zarr

from gradsketch._settings import settings_record
from gradsketch._store import array_options
from gradsketch.sampling import Metrics
from gradsketch.slt._config import SamplerSettings
from gradsketch.slt._data import Observable

__all__ = [
    "CHUNK_BYTES",
    "FAST_PATH_ATTR",
    "FORMAT",
    "LAYOUT_NAMES",
    "LAYOUT_PREFIXES",
    "NUMEL_ATTR",
    "SETTINGS_ATTR",
    "SKETCH_COMPONENTS",
    "Arrays",
    "array",
    "create_layout",
    "layout_names",
    "open_tree",
]

#: Bytes of one stored chunk, at most (chunks span one chain and several draws).
CHUNK_BYTES = 32 << 20
#: Base64 of NaN as float64: xarray's encoding of a NaN fill value.
_NAN_FILL = "AAAAAAAA+H8="
FORMAT = "gradsketch.slt.sample/1"
#: Root attribute holding the settings record of a gradsketch sample store.
SETTINGS_ATTR = "gradsketch_settings"
#: Root attribute: the number of sampled weights ``d`` (the LLC lies in ``[0, d/2]``).
NUMEL_ATTR = "gradsketch_numel"
#: The root attribute listing which fast path ran (one entry per distinct record).
FAST_PATH_ATTR = "gradsketch_fast_path"
#: The update components a sketch is recorded of (``sketch_<component>``), in order.
SKETCH_COMPONENTS = ("scaled_grad", "unscaled_grad", "localization", "weight_decay", "noise")
#: Top-level arrays and groups of a sample store (the prefixes end in ``_``).
LAYOUT_NAMES = ("init_loss", "sampling_loss", "sampling_loss_micro", "sampling_input_ids_micro")
LAYOUT_PREFIXES = ("loss_", "input_ids_", "metrics_", "sketch_")


class Arrays:
    """Creates the store's arrays with devinterp's names, dimensions and fill values.

    Each array also carries ``record``, the settings record of the run that
    made it, under :data:`SETTINGS_ATTR`: a store whose root ``zarr.json`` is
    lost is still judged by the settings that made its samples
    (:func:`~gradsketch.slt._writing.check_existing`), never taken for empty.
    """

    def __init__(self, root: zarr.Group, record: dict[str, Any] | None = None) -> None:
        self.root = root
        self.record = record

    def create(self, name: str, dims: tuple[str, ...], shape: tuple[int, ...], dtype: str) -> None:
        if name in self.root:
            return
        np_dtype = np.dtype(dtype)
        chunks = list(shape)
        if len(shape) >= 2 and dims[0] == "chain":
            # One chain per chunk, as many draws (steps) as fit in CHUNK_BYTES.
            row = int(np.prod(shape[2:], dtype=np.int64)) * np_dtype.itemsize
            chunks[0] = 1
            chunks[1] = max(1, min(shape[1], CHUNK_BYTES // max(row, 1)))
        floating = np_dtype.kind == "f"
        self.root.create_array(
            name,
            shape=shape,
            dtype=np_dtype,
            chunks=tuple(chunks),
            dimension_names=dims,
            # Blosc-zstd with shuffle, crc32c checksums, NaN fill for floats.
            **array_options(np_dtype, compress=True),
            attributes={
                **({"_FillValue": _NAN_FILL} if floating else {}),
                **({SETTINGS_ATTR: self.record} if self.record is not None else {}),
            },
        )


def array(root: zarr.Group, name: str, *, write: bool = False) -> zarr.Array:
    """The array ``name`` of the store; with ``write``, one that writes every chunk.

    zarr skips writing a chunk that holds only the fill value (a failed
    chain's NaN draws): written anyway, every chunk of a sampled chain is on
    disk, so a missing one is damage (:func:`gradsketch._integrity.scan_array`).
    """
    node = root[name]
    if not isinstance(node, zarr.Array):
        raise TypeError(f"{name!r} in the sample store is a {type(node).__name__}, not an array.")
    return node.with_config({"write_empty_chunks": True}) if write else node


def open_tree(path: Path) -> Any:
    import xarray as xr

    return xr.open_datatree(str(path), engine="zarr", consolidated=False)


def layout_names(
    settings: SamplerSettings, obs_ids: Sequence[str], sketch_dim: int | None
) -> list[str]:
    """Every array :func:`create_layout` makes for these settings (the flags excepted)."""
    names = [*LAYOUT_NAMES]
    names += [f"{kind}_{obs}" for obs in obs_ids for kind in ("loss", "input_ids")]
    if settings.save_metrics:
        names += [f"metrics_{field}" for field in (*Metrics.NORM_FIELDS, *Metrics.DOT_FIELDS)]
    if sketch_dim is not None:
        names += [f"sketch_{q}" for q in SKETCH_COMPONENTS]
    return names


def create_layout(
    root: zarr.Group,
    path: Path,
    *,
    settings: SamplerSettings,
    ctx: int,
    observed: Sequence[Observable],
    record: dict[str, Any],
    numel: int,
    sketch_dim: int | None,
) -> None:
    """Create every array of the store at ``path`` (those that exist are kept), then the attributes.

    ``ctx`` is the predicted positions per sequence, ``observed`` the
    observables evaluated at each draw, ``record`` the settings record and
    ``numel`` the number of sampled weights. The root attributes are written
    once, after the arrays, so a store without them holds no sample.
    """
    s = settings
    stored = settings_record(record)
    arrays = Arrays(root, stored)
    micro = s.gradient_accumulation_steps * s.batch_size
    arrays.create("init_loss", ("chain", "token_pos"), (s.num_chains, ctx), "float32")
    arrays.create(
        "sampling_loss",
        ("chain", "draw", "batch", "token_pos"),
        (s.num_chains, s.num_draws, s.batch_size, ctx),
        "float32",
    )
    arrays.create(
        "sampling_loss_micro",
        ("chain", "step", "batch_sampling", "token_pos"),
        (s.num_chains, s.num_steps, micro, ctx),
        "float32",
    )
    arrays.create(
        "sampling_input_ids_micro",
        ("chain", "step", "batch_sampling", "token"),
        (s.num_chains, s.num_steps, micro, ctx + 1),
        "int64",
    )
    for o in observed:
        dim = f"batch_{o.obs_id}"
        arrays.create(
            f"loss_{o.obs_id}",
            ("chain", "draw", dim, "token_pos"),
            (s.num_chains, s.num_draws, o.n_samples, ctx),
            "float32",
        )
        arrays.create(f"input_ids_{o.obs_id}", (dim, "token"), (o.n_samples, ctx + 1), "int64")
    if s.save_metrics:
        for name in (*Metrics.NORM_FIELDS, *Metrics.DOT_FIELDS):
            arrays.create(
                f"metrics_{name}", ("chain", "step"), (s.num_chains, s.num_steps), "float32"
            )
    if sketch_dim is not None:
        for q in SKETCH_COMPONENTS:
            arrays.create(
                f"sketch_{q}",
                ("chain", "step", "sketch"),
                (s.num_chains, s.num_steps, sketch_dim),
                "float32",
            )
    progress = zarr.open_group(str(path / "progress"), mode="a")
    flags = Arrays(progress, stored)
    flags.create("init_done", ("chain",), (s.num_chains,), "uint8")
    flags.create("chain_done", ("chain",), (s.num_chains,), "uint8")
    attrs: dict[str, Any] = {
        "metadata": {
            "config": {
                "sampler": s.metadata(),
                "observables": [
                    {
                        "type": "ObserveDifferentDataset",
                        "obs_id": o.obs_id,
                        "batches_per_draw": o.batches_per_draw,
                    }
                    for o in observed
                ],
                "chain_buffer_size": min(50, s.num_draws),
                "shared_observable_dims": ["token", "token_pos"],
                "tokenizer_context_length": ctx + 1,
            }
        },
        SETTINGS_ATTR: stored,
    }
    attrs[NUMEL_ATTR] = numel
    if s.save_metrics:
        attrs["metrics_numel"] = numel
    if SETTINGS_ATTR not in root.attrs:
        root.update_attributes(attrs)
    for o in observed:
        array(root, f"input_ids_{o.obs_id}", write=True)[...] = o.input_ids.numpy()
