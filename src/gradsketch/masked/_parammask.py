"""ParamMask: named boolean masks over a model's parameters."""

from __future__ import annotations

import fnmatch
import math
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from gradsketch._checks import check_int
from gradsketch._hash import MASK32, TensorDigest, name_key, random_bits

from ._errors import MaskError, describe, name_list

__all__ = ["ParamMask"]

_FORMAT = "gradsketch.ParamMask"
_VERSION = 1

Tensors = Mapping[str, Tensor] | nn.Module


def _named_tensors(source: Tensors, where: str) -> dict[str, Tensor]:
    if isinstance(source, nn.Module):
        return dict(source.named_parameters())
    if isinstance(source, Mapping):
        return dict(source)
    raise MaskError(
        f"{where} must be an nn.Module or a mapping name -> tensor; received {describe(source)}."
    )


def _named_parameters(model: nn.Module, where: str) -> dict[str, Tensor]:
    if not isinstance(model, nn.Module):
        raise MaskError(f"{where} must be an nn.Module; received {describe(model)}.")
    return dict(model.named_parameters())


class ParamMask:
    """Named boolean masks over a model's parameters: which weights are selected.

    A ParamMask maps parameter names (as in ``model.named_parameters()``) to
    boolean tensors of the parameters' shapes; ``True`` marks a selected
    entry. It restricts optimizers (:class:`~gradsketch.masked.MaskedAdagrad`
    and friends), samplers and sketches to the selected entries; the
    selected entries, concatenated in the mask's name order, are the
    coordinates a sketch sees, so ``input_dim == mask.numel``.

    **Parameters absent from the mask are fully unselected.** A mask names
    what it selects: :meth:`select` skips absent parameters, :meth:`scatter`
    does not produce them and :meth:`apply_` zeroes them. The constructors
    below record every parameter of the model (all-False where nothing is
    selected), so absence only arises for hand-built masks. A parameter whose
    mask is all-False is allowed.

    The masks are not copied; treat them as read-only.

    Args:
        masks: Mapping parameter name -> boolean tensor. Order is kept and
            defines the order of :meth:`select`.

    Raises:
        MaskError: A key is not a string or a value is not a boolean tensor.

    Example:
        >>> model = torch.nn.Linear(3, 2)
        >>> mask = ParamMask.from_patterns(model, include=["weight"])
        >>> mask.numel, mask.names
        (6, ('weight', 'bias'))
        >>> mask.select(model).shape
        torch.Size([6])
    """

    def __init__(self, masks: Mapping[str, Tensor]) -> None:
        if not isinstance(masks, Mapping):
            raise MaskError(
                f"`masks` must be a mapping name -> boolean tensor; received {describe(masks)}."
            )
        checked: dict[str, Tensor] = {}
        for name, mask in masks.items():
            if not isinstance(name, str):
                raise MaskError(
                    f"`masks` keys must be parameter names (str); received {describe(name)}. "
                    "Fix: key by `model.named_parameters()` names."
                )
            if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
                raise MaskError(
                    f"`masks[{name!r}]` must be a torch.bool tensor; received "
                    f"{describe(mask)}. Fix: convert with `mask != 0` or `mask.bool()`."
                )
            if mask.layout != torch.strided:
                raise MaskError(
                    f"`masks[{name!r}]` has layout {mask.layout}; expected a dense boolean "
                    "tensor. Fix: pass `mask.to_dense()`."
                )
            checked[name] = mask
        self._masks = checked
        self._index_cache: dict[str, tuple[int, Tensor]] = {}
        self._fingerprint_cache: tuple[tuple[int, ...], str] | None = None

    # ----------------------------------------------------------------- constructors

    @classmethod
    def from_patterns(
        cls,
        model: nn.Module,
        include: Iterable[str] = ("*",),
        exclude: Iterable[str] = (),
    ) -> ParamMask:
        """Select whole parameters by fnmatch-style name patterns.

        A parameter is selected when its name matches some ``include``
        pattern and no ``exclude`` pattern. Patterns are case-sensitive
        (:func:`fnmatch.fnmatchcase`); ``*`` also matches dots.

        Args:
            model: The model whose ``named_parameters()`` are masked.
            include: Patterns to select, e.g. ``["layer1.*", "*.bias"]``.
            exclude: Patterns to leave out, applied after ``include``.

        Raises:
            MaskError: A pattern matches no parameter (a typo, most likely).

        Example:
            >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
            >>> ParamMask.from_patterns(model, include=["*.weight"], exclude=["1.*"]).numel
            4
        """
        params = _named_parameters(model, "`model`")
        include = cls._patterns("include", include)
        exclude = cls._patterns("exclude", exclude)
        for kind, patterns in (("include", include), ("exclude", exclude)):
            for pattern in patterns:
                if not any(fnmatch.fnmatchcase(n, pattern) for n in params):
                    raise MaskError(
                        f"`{kind}` pattern {pattern!r} matches no parameter; the model has "
                        f"{name_list(params)}. Fix: correct the pattern (fnmatch syntax, "
                        "case-sensitive)."
                    )

        def chosen(name: str) -> bool:
            hit = any(fnmatch.fnmatchcase(name, p) for p in include)
            return hit and not any(fnmatch.fnmatchcase(name, p) for p in exclude)

        return cls({n: torch.full_like(p, chosen(n), dtype=torch.bool) for n, p in params.items()})

    @staticmethod
    def _patterns(kind: str, given: Iterable[str]) -> list[str]:
        patterns = [given] if isinstance(given, str) else list(given)
        if isinstance(given, str) or not all(isinstance(p, str) for p in patterns):
            raise MaskError(
                f"`{kind}` must be a list of name patterns, e.g. ['body.*']; received {given!r}."
            )
        return patterns

    @classmethod
    def from_module_types(
        cls, model: nn.Module, types: type[nn.Module] | tuple[type[nn.Module], ...]
    ) -> ParamMask:
        """Select every parameter owned directly by a module of the given types.

        Args:
            model: The model to mask.
            types: A module class or a tuple of them, e.g.
                ``(nn.Linear, nn.Conv2d)``; subclasses count.

        Raises:
            MaskError: ``types`` holds something that is not an ``nn.Module``
                subclass, or no module of the model has one of the types.

        Example:
            >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
            >>> ParamMask.from_module_types(model, torch.nn.Linear).numel
            6
        """
        kinds = types if isinstance(types, tuple) else (types,)
        bad = [t for t in kinds if not (isinstance(t, type) and issubclass(t, nn.Module))]
        if bad or not kinds:
            raise MaskError(
                f"`types` must be nn.Module subclasses, e.g. (nn.Linear, nn.Conv2d); "
                f"received {types!r}."
            )
        params = _named_parameters(model, "`model`")
        selected: set[str] = set()
        for prefix, module in model.named_modules():
            if isinstance(module, kinds):
                for name, _ in module.named_parameters(recurse=False):
                    selected.add(f"{prefix}.{name}" if prefix else name)
        if not selected & set(params):
            present = sorted({type(m).__name__ for m in model.modules()})
            raise MaskError(
                f"`types` {tuple(t.__name__ for t in kinds)} match no module that owns "
                f"parameters; the model has modules of types {present}."
            )
        return cls(
            {n: torch.full_like(p, n in selected, dtype=torch.bool) for n, p in params.items()}
        )

    @classmethod
    def random(cls, model: nn.Module, fraction: float, *, seed: int) -> ParamMask:
        """Select each entry independently with probability ``fraction``.

        Entry ``i`` of parameter ``name`` is selected when
        ``h(seed, name, i) < fraction * 2**32``, where ``h`` is a
        counter-based 32-bit integer hash. The mask therefore depends only
        on ``(seed, names, shapes, fraction)``: not on the device, dtype,
        torch's global RNG or the order of calls. The selected count is
        Binomial(``total``, ``fraction``): mean ``total * fraction``, standard
        deviation ``sqrt(total * fraction * (1 - fraction))``.

        Args:
            model: The model to mask (masks are built on each parameter's
                device).
            fraction: Selection probability in ``[0, 1]``.
            seed: Integer in ``[0, 2**64)``.

        Raises:
            MaskError: ``fraction`` or ``seed`` out of range.

        Example:
            >>> model = torch.nn.Linear(100, 100)
            >>> a = ParamMask.random(model, 0.1, seed=0)
            >>> a == ParamMask.random(model, 0.1, seed=0), a == ParamMask.random(model, 0.1, seed=1)
            (True, False)
        """
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
            raise MaskError(f"`fraction` must be a float in [0, 1]; received {fraction!r}.")
        if not 0.0 <= fraction <= 1.0:
            raise MaskError(f"`fraction` must be in [0, 1]; received {fraction!r}.")
        check_int("seed", seed, low=0, high=2**64, fix="reduce it modulo 2**64", error=MaskError)
        threshold = round(fraction * (MASK32 + 1))
        params = _named_parameters(model, "`model`")
        return cls(
            {
                name: random_bits(name_key(seed, name), p.numel(), threshold, p.device).view(
                    p.shape
                )
                for name, p in params.items()
            }
        )

    @classmethod
    def topk_magnitude(cls, model: nn.Module, k_or_fraction: int | float) -> ParamMask:
        """Select the ``k`` entries of largest ``|value|`` across all parameters.

        Ties are broken towards the earlier entry (model order, then flat
        index), so the result is deterministic. NaN values are never
        selected before finite ones.

        Args:
            model: The model to mask.
            k_or_fraction: An ``int`` count ``k`` in ``[0, total]``, or a
                ``float`` fraction in ``[0, 1]`` giving
                ``k = floor(fraction * total + 0.5)``. (``1`` is one entry,
                ``1.0`` is all of them.)

        Raises:
            MaskError: ``k_or_fraction`` has the wrong type or is out of range.

        Example:
            >>> model = torch.nn.Linear(2, 1)
            >>> with torch.no_grad():
            ...     _ = model.weight.copy_(torch.tensor([[3.0, -5.0]]))
            ...     _ = model.bias.fill_(1.0)
            >>> ParamMask.topk_magnitude(model, 2)["weight"]
            tensor([[True, True]])
        """
        params = _named_parameters(model, "`model`")
        total = sum(p.numel() for p in params.values())
        if isinstance(k_or_fraction, bool) or not isinstance(k_or_fraction, (int, float)):
            raise MaskError(
                f"`k_or_fraction` must be an int count or a float fraction; received "
                f"{k_or_fraction!r}."
            )
        if isinstance(k_or_fraction, int):
            if not 0 <= k_or_fraction <= total:
                raise MaskError(
                    f"`k_or_fraction` as a count must be in [0, {total}] (the model's "
                    f"entries); received {k_or_fraction}. Fix: pass a float for a fraction."
                )
            k = k_or_fraction
        else:
            if not 0.0 <= k_or_fraction <= 1.0:
                raise MaskError(
                    f"`k_or_fraction` as a fraction must be in [0, 1]; received {k_or_fraction}."
                )
            k = math.floor(k_or_fraction * total + 0.5)
        if not params:
            return cls({})
        device = next(iter(params.values())).device
        magnitude = torch.cat(
            [p.detach().abs().reshape(-1).to(device, torch.float64) for p in params.values()]
        )
        magnitude = torch.nan_to_num(magnitude, nan=-1.0)
        order = torch.sort(magnitude, descending=True, stable=True).indices[:k]
        flat = torch.zeros(total, dtype=torch.bool, device=device)
        flat[order] = True
        masks, offset = {}, 0
        for name, p in params.items():
            masks[name] = flat[offset : offset + p.numel()].view(p.shape).to(p.device).clone()
            offset += p.numel()
        return cls(masks)

    # ----------------------------------------------------------------- container

    @property
    def names(self) -> tuple[str, ...]:
        """Every parameter name the mask records, in order (all-False ones too)."""
        return tuple(self._masks)

    @property
    def numel(self) -> int:
        """Number of selected entries over all parameters."""
        return sum(self.counts().values())

    @property
    def total(self) -> int:
        """Number of entries over all recorded parameters, selected or not."""
        return sum(m.numel() for m in self._masks.values())

    def counts(self) -> dict[str, int]:
        """Selected entries per parameter name."""
        return {name: int(self._index(name).numel()) for name in self._masks}

    def __getitem__(self, name: str) -> Tensor:
        """The boolean mask of parameter ``name``."""
        try:
            return self._masks[name]
        except KeyError:
            raise MaskError(
                f"unknown parameter name {name!r}; the mask has {name_list(self._masks)}."
            ) from None

    def get(self, name: str, like: Tensor) -> Tensor:
        """The mask of ``name``, or an all-False mask shaped like ``like`` if absent."""
        mask = self._masks.get(name)
        return mask if mask is not None else torch.zeros_like(like, dtype=torch.bool)

    def __contains__(self, name: object) -> bool:
        return name in self._masks

    def __iter__(self) -> Iterator[str]:
        return iter(self._masks)

    def __len__(self) -> int:
        return len(self._masks)

    def items(self) -> Iterator[tuple[str, Tensor]]:
        """``(name, mask)`` pairs in order."""
        return iter(self._masks.items())

    def __repr__(self) -> str:
        return (
            f"ParamMask({len(self._masks)} parameters, {self.numel}/{self.total} selected, "
            f"fingerprint={self.fingerprint!r})"
        )

    # ----------------------------------------------------------------- select / scatter

    def _index(self, name: str) -> Tensor:
        """Flat indices of the selected entries of ``name`` (cached per mask version)."""
        mask = self._masks[name]
        cached = self._index_cache.get(name)
        if cached is not None and cached[0] == mask._version:
            return cached[1]
        index = mask.reshape(-1).nonzero().squeeze(1)
        self._index_cache[name] = (mask._version, index)
        return index

    def _check_tensor(self, name: str, tensor: Tensor, lead: int, where: str) -> None:
        mask = self._masks[name]
        if not isinstance(tensor, Tensor):
            raise MaskError(f"{where}[{name!r}] must be a tensor; received {describe(tensor)}.")
        if tuple(tensor.shape[lead:]) != tuple(mask.shape) or tensor.dim() != mask.dim() + lead:
            expected = ("[batch, " if lead else "[") + ", ".join(map(str, mask.shape)) + "]"
            raise MaskError(
                f"{where}[{name!r}] has shape {tuple(tensor.shape)}; expected {expected} "
                "to match the mask."
            )
        if tensor.device != mask.device:
            raise MaskError(
                f"{where}[{name!r}] is on {tensor.device} but the mask is on {mask.device}. "
                f"Fix: `mask.to({str(tensor.device)!r})`."
            )

    def _aligned(self, source: Tensors, where: str) -> list[tuple[str, Tensor | None]]:
        """Pair each recorded name with its tensor in ``source``; check unknown names."""
        tensors = _named_tensors(source, where)
        out: list[tuple[str, Tensor | None]] = []
        for name in self._masks:
            tensor = tensors.get(name)
            if tensor is None and self._index(name).numel():
                raise MaskError(
                    f"{where} has no tensor for {name!r}, which the mask selects entries of; "
                    f"{where} has {name_list(tensors)}. Fix: pass every selected parameter."
                )
            out.append((name, tensor))
        return out

    def select(self, source: Tensors | Tensor, name: str | None = None) -> Tensor:
        """The selected values, flattened and concatenated in the mask's order.

        Args:
            source: A model (its parameters), a mapping name -> tensor
                ``[*shape]`` (extra names are ignored: absent from the mask
                means unselected), or one tensor together with ``name``.
            name: The parameter name when ``source`` is a single tensor.

        Returns:
            ``[numel]`` (or ``[count(name)]`` for one tensor).

        Raises:
            MaskError: A selected parameter is missing, or a tensor's shape or
                device does not match its mask.

        Example:
            >>> mask = ParamMask({"w": torch.tensor([True, False, True])})
            >>> mask.select({"w": torch.tensor([1.0, 2.0, 3.0])})
            tensor([1., 3.])
        """
        if isinstance(source, Tensor):
            if name is None:
                raise MaskError(
                    "`select` got a single tensor but no `name`; pass `name=` or a mapping."
                )
            self[name]
            self._check_tensor(name, source, 0, "`source`")
            return source.reshape(-1)[self._index(name)]
        parts = []
        for key, tensor in self._aligned(source, "`source`"):
            if tensor is None:
                continue
            self._check_tensor(key, tensor, 0, "`source`")
            parts.append(tensor.reshape(-1)[self._index(key)])
        if not parts:
            return torch.zeros(0)
        return torch.cat(parts)

    def select_batched(self, source: Mapping[str, Tensor]) -> Tensor:
        """Selected values of per-example tensors, e.g. per-example gradients.

        Args:
            source: Mapping name -> ``[batch, *shape]``.

        Returns:
            ``[batch, numel]``, columns in the order of :meth:`select`.

        Example:
            >>> mask = ParamMask({"w": torch.tensor([True, False, True])})
            >>> mask.select_batched({"w": torch.arange(6.0).view(2, 3)})
            tensor([[0., 2.],
                    [3., 5.]])
        """
        parts = []
        batch: int | None = None
        for key, tensor in self._aligned(source, "`source`"):
            if tensor is None:
                continue
            self._check_tensor(key, tensor, 1, "`source`")
            if batch is not None and tensor.shape[0] != batch:
                raise MaskError(
                    f"`source`[{key!r}] has batch size {tensor.shape[0]}; the tensors "
                    f"before it have {batch}."
                )
            batch = tensor.shape[0]
            parts.append(tensor.reshape(tensor.shape[0], -1)[:, self._index(key)])
        if not parts:
            return torch.zeros(0, 0)
        return torch.cat(parts, dim=1)

    def scatter(self, flat: Tensor) -> dict[str, Tensor]:
        """Inverse of :meth:`select`: full tensors with zeros at unselected entries.

        Args:
            flat: ``[..., numel]``; leading dimensions are kept.

        Returns:
            Mapping name -> ``[..., *shape]`` for every recorded name, on
            ``flat``'s device and dtype.

        Example:
            >>> mask = ParamMask({"w": torch.tensor([True, False, True])})
            >>> mask.scatter(torch.tensor([1.0, 3.0]))
            {'w': tensor([1., 0., 3.])}
        """
        if not isinstance(flat, Tensor) or flat.dim() == 0 or flat.shape[-1] != self.numel:
            got = tuple(flat.shape) if isinstance(flat, Tensor) else describe(flat)
            raise MaskError(
                f"`flat` must have last dimension {self.numel} (the selected entries); "
                f"received shape {got}."
            )
        lead = tuple(flat.shape[:-1])
        out, offset = {}, 0
        for name, mask in self._masks.items():
            index = self._index(name).to(flat.device)
            full = flat.new_zeros((*lead, mask.numel()))
            full.index_copy_(-1, index, flat[..., offset : offset + index.numel()])
            out[name] = full.view(*lead, *mask.shape)
            offset += index.numel()
        return out

    def apply_(self, target: Tensors) -> None:
        """Zero every unselected entry of ``target`` in place.

        Parameters of ``target`` that the mask does not record are absent,
        hence unselected, and are zeroed entirely.

        Args:
            target: A model (its parameters) or a mapping name -> tensor.

        Raises:
            MaskError: A recorded name is missing from ``target`` while it
                selects entries, or a shape or device does not match.

        Example:
            >>> mask = ParamMask({"w": torch.tensor([True, False])})
            >>> t = {"w": torch.tensor([5.0, 6.0]), "b": torch.tensor([1.0])}
            >>> mask.apply_(t)
            >>> t
            {'w': tensor([5., 0.]), 'b': tensor([0.])}
        """
        tensors = _named_tensors(target, "`target`")
        self._aligned(tensors, "`target`")
        with torch.no_grad():
            for name, tensor in tensors.items():
                if name not in self._masks:
                    tensor.zero_()
                    continue
                self._check_tensor(name, tensor, 0, "`target`")
                tensor.masked_fill_(~self._masks[name], 0)

    def by_parameter(self, model: nn.Module) -> dict[Tensor, Tensor]:
        """Masks keyed by the model's parameter tensors, for ``step(masks=...)``.

        Every parameter of ``model`` gets a mask (all-False when absent).

        Raises:
            MaskError: The mask records names the model does not have, or a
                shape or device does not match.
        """
        params = _named_parameters(model, "`model`")
        unknown = [n for n in self._masks if n not in params]
        if unknown:
            raise MaskError(
                f"the mask records parameters the model does not have: {name_list(unknown)}; "
                f"the model has {name_list(params)}."
            )
        for name, p in params.items():
            if name in self._masks:
                self._check_tensor(name, p, 0, "`model`")
        return {p: self.get(name, p) for name, p in params.items()}

    # ----------------------------------------------------------------- algebra

    def _combine(self, other: ParamMask, op: Any) -> ParamMask:
        if not isinstance(other, ParamMask):
            return NotImplemented
        names = list(self._masks) + [n for n in other._masks if n not in self._masks]
        out = {}
        for name in names:
            a, b = self._masks.get(name), other._masks.get(name)
            if a is not None and b is not None and a.shape != b.shape:
                raise MaskError(
                    f"cannot combine masks: {name!r} has shape {tuple(a.shape)} in one and "
                    f"{tuple(b.shape)} in the other."
                )
            ref = a if a is not None else b
            assert ref is not None
            out[name] = op(self.get(name, ref), other.get(name, ref).to(ref.device))
        return ParamMask(out)

    def __and__(self, other: ParamMask) -> ParamMask:
        """Entries selected by both masks."""
        return self._combine(other, torch.logical_and)

    def __or__(self, other: ParamMask) -> ParamMask:
        """Entries selected by either mask."""
        return self._combine(other, torch.logical_or)

    # ----------------------------------------------------------------- identity

    def to(self, device: torch.device | str) -> ParamMask:
        """A copy with every mask on ``device``."""
        return ParamMask({n: m.to(device) for n, m in self._masks.items()})

    @property
    def fingerprint(self) -> str:
        """A 16-hex-digit digest of the names, shapes and mask bits, in order.

        Device-independent and stable across sessions and torch versions;
        sketches made under masks with different fingerprints are
        incompatible.
        """
        versions = tuple(m._version for m in self._masks.values())
        ids = tuple(id(m) for m in self._masks.values())
        key = versions + ids
        if self._fingerprint_cache is not None and self._fingerprint_cache[0] == key:
            return self._fingerprint_cache[1]
        digest = TensorDigest(f"{_FORMAT}/v{_VERSION}")
        for name, mask in self._masks.items():
            digest.text(name + "\0").text(repr(tuple(mask.shape)) + "\0").bits(mask)
        value = digest.hexdigest()
        self._fingerprint_cache = (key, value)
        return value

    def __eq__(self, other: object) -> bool:
        """Equal names (in order), shapes and bits; devices may differ."""
        if not isinstance(other, ParamMask):
            return NotImplemented
        if list(self._masks) != list(other._masks):
            return False
        for name, mask in self._masks.items():
            theirs = other._masks[name]
            if mask.shape != theirs.shape or not torch.equal(mask.cpu(), theirs.cpu()):
                return False
        return True

    __hash__ = None  # type: ignore[assignment]

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the mask to ``path`` (a torch file of packed bits).

        Example:
            >>> import tempfile, pathlib
            >>> mask = ParamMask({"w": torch.tensor([True, False, True])})
            >>> with tempfile.TemporaryDirectory() as d:
            ...     mask.save(pathlib.Path(d) / "mask.pt")
            ...     ParamMask.load(pathlib.Path(d) / "mask.pt") == mask
            True
        """
        payload = {
            "format": _FORMAT,
            "version": _VERSION,
            "fingerprint": self.fingerprint,
            "names": list(self._masks),
            "shapes": [list(m.shape) for m in self._masks.values()],
            "bits": [
                torch.from_numpy(np.packbits(m.detach().cpu().reshape(-1).numpy()))
                for m in self._masks.values()
            ],
        }
        torch.save(payload, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, device: torch.device | str = "cpu") -> ParamMask:
        """Read a mask written by :meth:`save`.

        Args:
            path: The file.
            device: Where to put the masks.

        Raises:
            MaskError: The file is not a ParamMask, has an unknown version, or
                its contents do not match its stored fingerprint.
        """
        payload = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(payload, dict) or payload.get("format") != _FORMAT:
            raise MaskError(
                f"{os.fspath(path)!r} is not a ParamMask file (expected format {_FORMAT!r}). "
                "Fix: write it with `ParamMask.save`."
            )
        if payload.get("version") != _VERSION:
            raise MaskError(
                f"{os.fspath(path)!r} has ParamMask format version {payload.get('version')!r}; "
                f"this gradsketch reads version {_VERSION}."
            )
        masks = {}
        for name, shape, bits in zip(payload["names"], payload["shapes"], payload["bits"]):
            numel = math.prod(shape)
            flat = np.unpackbits(bits.numpy(), count=numel).astype(bool)
            masks[name] = torch.from_numpy(flat).view(shape).to(device)
        mask = cls(masks)
        if mask.fingerprint != payload["fingerprint"]:
            raise MaskError(
                f"{os.fspath(path)!r} is corrupt: its contents hash to {mask.fingerprint} "
                f"but it records fingerprint {payload['fingerprint']}."
            )
        return mask
