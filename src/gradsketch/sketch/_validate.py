"""Tensor checks shared by every sketch (integer arguments: :mod:`gradsketch._checks`)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from gradsketch._checks import nonnegative_int

#: Input dtypes every sketch accepts.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_float_tensor(name: str, value: object) -> torch.Tensor:
    """A floating tensor of a supported dtype."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"`{name}` must be a torch.Tensor, got {type(value).__name__}; "
            "convert with torch.as_tensor(...)."
        )
    if value.dtype not in FLOAT_DTYPES:
        allowed = ", ".join(str(d) for d in FLOAT_DTYPES)
        raise TypeError(
            f"`{name}` has dtype {value.dtype}; sketches accept {allowed}. "
            f"Cast it with `{name}.float()`."
        )
    return value


def check_block(block: object) -> torch.Tensor:
    """A floating ``[batch, n]`` block of coordinates (what every kernel streams)."""
    tensor = check_float_tensor("block", block)
    if tensor.dim() != 2:
        raise ValueError(
            f"`block` must be 2-D [batch, n], got shape {tuple(tensor.shape)}; reshape with "
            "block.reshape(batch, -1)."
        )
    return tensor


def check_device(name: str, tensor: torch.Tensor, device: torch.device) -> None:
    """Refuse a tensor on another device than the sketch (no silent copies)."""
    if tensor.device.type != device.type or (
        device.index is not None and tensor.device.index != device.index
    ):
        raise ValueError(
            f"`{name}` is on {tensor.device} but the sketch lives on {device}; "
            f"move one of them, e.g. `{name}.to({str(device)!r})` or "
            f"`sketch.to({str(tensor.device)!r})`."
        )


def check_range(offset: int, length: int, input_dim: int) -> None:
    """``offset + length`` must not run past ``input_dim``."""
    nonnegative_int("offset", offset, fix="pass the index of the block's first coordinate")
    if offset + length > input_dim:
        raise ValueError(
            f"coordinate range [offset, offset + length) = [{offset}, {offset + length}) runs past "
            f"input_dim={input_dim} (offset={offset}, length={length}). Check the offsets of the "
            "blocks you stream, or create the sketch with the total number of coordinates."
        )


def output_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 for float64 input, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def batch_blocks(
    grads: torch.Tensor | Mapping[str, torch.Tensor], name: str = "grads"
) -> tuple[int, list[torch.Tensor]]:
    """Split projector input into ``[batch, n_i]`` blocks, in order.

    A 2-D tensor is one block; a mapping of per-parameter ``[batch, ...]``
    tensors gives one flattened block per entry, in the mapping's order.

    Returns:
        ``(total_coordinates, blocks)``.
    """
    if isinstance(grads, Mapping):
        if not grads:
            raise ValueError(f"`{name}` is an empty mapping; pass at least one gradient tensor.")
        blocks = []
        batch = None
        for key, g in grads.items():
            check_float_tensor(f"{name}[{key!r}]", g)
            if g.dim() < 1:
                raise ValueError(
                    f"`{name}[{key!r}]` is a scalar; per-parameter gradients need a leading "
                    "batch dimension [batch, ...]."
                )
            if batch is None:
                batch = g.shape[0]
            elif g.shape[0] != batch:
                raise ValueError(
                    f"`{name}[{key!r}]` has batch size {g.shape[0]} but earlier entries have "
                    f"{batch}; every entry needs the same leading batch dimension."
                )
            blocks.append(g.reshape(g.shape[0], -1))
        return sum(b.shape[1] for b in blocks), blocks
    g = check_float_tensor(name, grads)
    if g.dim() != 2:
        raise ValueError(
            f"`{name}` must be 2-D [batch, grad_dim], got shape {tuple(g.shape)}; "
            f"flatten per-example gradients with `{name}.reshape(batch, -1)`."
        )
    return g.shape[1], [g]
