"""Factorized drop-in replacements for ``nn.Linear`` and ``nn.Conv2d``.

Each module is two children run back to back, ``module0`` (input -> latent,
no bias) and ``module1`` (latent -> output, carries the bias), and is built
from the trained layer (truncated SVD of its weight, or the least-squares
solution on calibration inputs), never from random factors.

Per-layer behaviour lives in a registry keyed by the module type being
replaced (:data:`FACTORIZED_MODULES`); :func:`register_factorized_module`
adds more.
"""

from __future__ import annotations

import abc
import math
import operator
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import torch
from torch import Tensor, nn

from gradsketch._checks import positive_int
from gradsketch.factorize._core import (
    LowRankSolution,
    conv_inputs_to_matrix,
    factorize_conv2d,
    factorize_matrix,
    resolve_rank,
)
from gradsketch.factorize._linalg import truncated_svd

__all__ = [
    "FACTORIZED_MODULES",
    "FactorizedConv2d",
    "FactorizedLinear",
    "factorizing_could_speedup",
    "max_rank_with_possible_speedup",
    "register_factorized_module",
]

_M = TypeVar("_M", bound="_FactorizedModule")


def max_rank_with_possible_speedup(
    in_size: int, out_size: int, kernel_size: int | tuple[int, ...] | None = None
) -> int:
    """Largest latent size for which the factorized pair needs fewer multiply-adds.

    One output position costs ``fan_in * out`` multiply-adds unfactorized and
    ``k * (fan_in + out)`` factorized, so the break-even rank is
    ``ceil(fan_in * out / (fan_in + out) - 1)`` with ``fan_in = in * kh * kw``.

    Example:
        >>> max_rank_with_possible_speedup(512, 512), max_rank_with_possible_speedup(64, 64, 3)
        (255, 57)
    """
    fan_in = in_size * math.prod(_as_pair(kernel_size)) if kernel_size is not None else in_size
    return math.ceil(fan_in * out_size / (fan_in + out_size) - 1)


def _as_pair(v: int | tuple[int, ...]) -> tuple[int, ...]:
    return (v, v) if isinstance(v, int) else tuple(v)


def _tensor(module: nn.Module, name: str) -> Tensor:
    t = getattr(module, name)
    assert isinstance(t, Tensor), f"{type(module).__name__}.{name} is not a tensor"
    return t


def _maybe_tensor(module: nn.Module, name: str) -> Tensor | None:
    t = getattr(module, name, None)
    return t if isinstance(t, Tensor) else None


def clean_latent_size(latent: int | float, in_size: int, out_size: int, name: str) -> int:
    """An int, or a fraction in (0, 1) of ``min(in_size, out_size)`` (at least 1)."""
    smaller = min(in_size, out_size)
    return resolve_rank(latent, smaller, smaller, name=name)


def _alias(attribute: str, doc: str) -> Any:
    """A read-only property giving ``self.<attribute>`` under torch's name for it."""
    return property(operator.attrgetter(attribute), doc=doc)


class _FactorizedModule(nn.Module, abc.ABC):
    """Shared machinery: ``module1(module0(x))`` with a resizable latent size.

    Subclasses name their sizes (``in_features`` / ``in_channels``) and
    implement :meth:`_build_children`, :meth:`solution_for_rank`,
    :meth:`_write_solution` and the two class-level hooks used by the surgery.
    """

    latent_name: ClassVar[str] = "latent_size"
    replaces: ClassVar[type[nn.Module]]
    kind: ClassVar[str]

    module0: nn.Module
    module1: nn.Module

    def __init__(
        self, in_size: int, out_size: int, latent_size: int | float, kernel: tuple[int, ...]
    ) -> None:
        super().__init__()
        for name, v in (("in_size", in_size), ("out_size", out_size)):
            positive_int(name, v)
        self.in_size = in_size
        self.out_size = out_size
        self.kernel = kernel
        self.latent_size = clean_latent_size(latent_size, in_size, out_size, self.latent_name)
        limit = self.max_rank_before_factorizing()
        if self.latent_size > limit:
            raise ValueError(
                f"`{self.latent_name}`={latent_size!r} (resolved to {self.latent_size}) is too "
                f"large for factorizing to save multiply-adds; it must be <= {limit}. Use "
                f"`{type(self).__name__}.max_allowed_{self.latent_name}(...)` or a smaller value."
            )

    def _build(self, device: torch.device | str | None, dtype: torch.dtype | None) -> None:
        """Make the two children at the latent size, on ``device`` in ``dtype``."""
        self.module0, self.module1 = self._build_children(self.latent_size)
        self.to(device=device, dtype=dtype)

    @property
    def fan_in(self) -> int:
        """Inputs per output position: ``in_size * kh * kw``."""
        return self.in_size * math.prod(self.kernel)

    def max_rank_before_factorizing(self) -> int:
        """Break-even latent size of the unfactorized layer."""
        return max_rank_with_possible_speedup(self.in_size, self.out_size, self.kernel)

    def forward(self, input: Tensor) -> Tensor:
        """``module1(module0(input))``."""
        return self.module1(self.module0(input))

    def reset_parameters(self) -> None:
        """Re-initialise both children the way torch initialises them."""
        for child in (self.module0, self.module1):
            child.reset_parameters()  # type: ignore[operator]

    def should_factorize(self, proposed_rank: int | float) -> bool:
        """Whether moving to ``proposed_rank`` lowers the multiply-adds (any decrease does)."""
        rank = clean_latent_size(proposed_rank, self.in_size, self.out_size, "proposed_rank")
        return rank <= self.latent_size - 1

    def _resolve(self, rank: int | float) -> int:
        return clean_latent_size(rank, self.in_size, self.out_size, "rank")

    def set_rank(self, input: Tensor, rank: int | float) -> None:
        """Lower the latent size to ``rank``, refitting on ``input``.

        Args:
            input: a batch the module can be called on.
            rank: new latent size, at most the current one.

        Raises:
            ValueError: if ``rank`` exceeds the current latent size.
        """
        k = self._resolve(rank)
        if k > self.latent_size:
            raise ValueError(
                f"`rank`={rank!r} exceeds the current {self.latent_name}={self.latent_size}; "
                "a factorized module can only lower its rank."
            )
        if k == self.latent_size:
            return
        self.apply_solution(self.solution_for_rank(input, k))

    @abc.abstractmethod
    def solution_for_rank(self, input: Tensor, rank: int | float) -> LowRankSolution:
        """A rank-``rank`` solution fitted to this module's outputs on ``input``.

        Separate from :meth:`set_rank` so that several ranks can be compared
        before one is applied with :meth:`apply_solution`.
        """

    @abc.abstractmethod
    def _build_children(self, rank: int) -> tuple[nn.Module, nn.Module]:
        """Fresh ``(module0, module1)`` at latent size ``rank``."""

    @abc.abstractmethod
    def _write_solution(self, wa: Tensor, wb: Tensor) -> None:
        """Copy the factors (in :class:`LowRankSolution` layout) into the children."""

    @staticmethod
    @abc.abstractmethod
    def _latent_of(solution: LowRankSolution) -> int:
        """Latent size of a solution's factors."""

    def _resize(self, rank: int) -> None:
        ref = _tensor(self.module1, "weight")
        m0, m1 = self._build_children(rank)
        self.module0 = m0.to(device=ref.device, dtype=ref.dtype)
        self.module1 = m1.to(device=ref.device, dtype=ref.dtype)
        self.latent_size = rank

    def apply_solution(self, solution: LowRankSolution) -> None:
        """Resize the children to the solution's rank and load its factors.

        Always applies, without checking that the solution is worthwhile. The
        children are rebuilt, so optimizers must be told about the new
        parameters (as :func:`apply_factorization` does).

        Raises:
            ValueError: if the solution is a single matrix, or carries a bias
                that this module (built with ``bias=False``) cannot hold.
        """
        if solution.Wa is None or solution.Wb is None:
            raise ValueError(
                f"`solution` must hold a pair (Wa, Wb); got rank={solution.rank} with "
                f"Wb={'None' if solution.Wb is None else 'set'}. A single-matrix solution "
                "means factorizing does not pay off at that rank; ask for a lower one."
            )
        rank = self._latent_of(solution)
        has_bias = getattr(self.module1, "bias", None) is not None
        if solution.bias is not None and not has_bias and bool(solution.bias.any()):
            raise ValueError(
                "`solution` has a bias but this module was built with bias=False; "
                "fit it with `fit_bias=False`."
            )
        self._resize(rank)
        with torch.no_grad():
            self._write_solution(solution.Wa, solution.Wb)
            bias = getattr(self.module1, "bias", None)
            if isinstance(bias, Tensor):
                if solution.bias is None:
                    bias.zero_()
                else:
                    bias.copy_(solution.bias)

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        # A checkpoint saved after `set_rank` holds factors of another latent
        # size; adopt it so that save / load round-trips at any rank.
        stored = state_dict.get(prefix + "module0.weight")
        if isinstance(stored, Tensor) and stored.shape[0] != self.latent_size:
            self._resize(int(stored.shape[0]))
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def extra_repr(self) -> str:
        return f"{self.in_size} -> {self.latent_size} -> {self.out_size}"

    # Hooks used by the surgery, keyed through FACTORIZED_MODULES.
    @classmethod
    @abc.abstractmethod
    def sizes_of(cls, module: nn.Module) -> tuple[int, int, tuple[int, ...]]:
        """``(in_size, out_size, kernel)`` of a module this class replaces."""

    @classmethod
    def unsupported_reason(cls, module: nn.Module) -> str | None:
        """Why ``module`` cannot be factorized at all, or ``None``."""
        return None

    @classmethod
    @abc.abstractmethod
    def regression_data(cls, module: nn.Module, input: Tensor) -> tuple[Tensor, Tensor]:
        """``(X [N, fan_in], Y [N, out])``: the rows the layer maps and its outputs."""

    @classmethod
    def factorize_module(
        cls: type[_M],
        module: nn.Module,
        latent: int | float,
        calibration_input: Tensor | None = None,
        *,
        n_iters: int = 3,
        seed: int = 0,
    ) -> tuple[_M, LowRankSolution]:
        """Build the factorized replacement of ``module`` and return its solution.

        Without ``calibration_input`` the factors come from the truncated SVD of the
        weight; with it, they minimise the output error on those inputs.
        """
        _check_instance(module, cls.replaces)
        fact = cls._empty_for(module, latent)
        k = fact.latent_size
        if calibration_input is None:
            sol = cls._svd_of(module, k, seed)
        else:
            sol = cls._fitted(module, calibration_input, k, n_iters=n_iters, seed=seed)
        fact.apply_solution(sol)
        return fact, sol

    @classmethod
    @abc.abstractmethod
    def _empty_for(cls: type[_M], module: nn.Module, latent: int | float) -> _M:
        """The replacement of ``module`` at ``latent``, on its device and dtype (no factors yet)."""

    @classmethod
    @abc.abstractmethod
    def _svd_of(cls, module: nn.Module, k: int, seed: int) -> LowRankSolution:
        """The rank-``k`` factors of ``module``'s weight by truncated SVD."""

    @classmethod
    @abc.abstractmethod
    def _fitted(
        cls, module: nn.Module, input: Tensor, k: int, *, n_iters: int, seed: int
    ) -> LowRankSolution:
        """The rank-``k`` factors fitted to ``module``'s outputs on ``input``."""


FACTORIZED_MODULES: dict[type[nn.Module], type[_FactorizedModule]] = {}
"""Registry: module type -> factorized replacement class."""

_F = TypeVar("_F", bound=type[_FactorizedModule])


def register_factorized_module(module_type: type[nn.Module]) -> Callable[[_F], _F]:
    """Class decorator registering a factorized replacement for ``module_type``.

    Example:
        >>> from torch import nn
        >>> FACTORIZED_MODULES[nn.Linear].__name__
        'FactorizedLinear'
    """

    def decorate(cls: _F) -> _F:
        FACTORIZED_MODULES[module_type] = cls
        cls.replaces = module_type
        return cls

    return decorate


def _check_instance(module: nn.Module, expected: type[nn.Module]) -> None:
    if not isinstance(module, expected):
        raise TypeError(
            f"`module` must be a {expected.__module__}.{expected.__name__}; "
            f"got {type(module).__name__}."
        )


def _svd_solution(w: Tensor, bias: Tensor | None, k: int, seed: int) -> LowRankSolution:
    """Truncated SVD of a ``[fan_in, out]`` weight, split ``U√S`` / ``√S Vᵀ``.

    Without data, ``nmse`` is the relative squared Frobenius error of the
    weight: the nmse the layer would show on white, zero-mean inputs.
    """
    w64 = w.detach().double()
    u, s, vh = truncated_svd(w64, k, seed=seed)
    wa, wb = u * s.sqrt(), s.sqrt()[:, None] * vh
    denom = float(w64.square().sum())
    err = float((w64 - wa @ wb).square().sum()) / denom if denom > 0 else 0.0
    dtype = w.dtype if w.dtype in (torch.float32, torch.float64) else torch.float32
    b = None if bias is None else bias.detach().to(dtype)
    return LowRankSolution(wa.to(dtype), wb.to(dtype), b, rank=k, nmse=err)


@register_factorized_module(nn.Linear)
class FactorizedLinear(_FactorizedModule):
    """Factorized replacement for :class:`torch.nn.Linear`: ``in -> latent -> out``.

    ``module0`` is ``Linear(in, latent, bias=False)``, ``module1`` is
    ``Linear(latent, out, bias=bias)``; no nonlinearity in between. Fewer
    multiply-adds than the original when ``latent <= in * out / (in + out) - 1``
    (about half of ``min(in, out)`` for a square layer).

    Args:
        in_features: size of each input sample.
        out_features: size of each output sample.
        bias: whether ``module1`` has a bias.
        latent_features: latent size, an int or a fraction in (0, 1) of
            ``min(in_features, out_features)`` (at least 1).
        device: device of the parameters.
        dtype: dtype of the parameters.

    Raises:
        ValueError: if ``latent_features`` is too large to save multiply-adds.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> dense = nn.Linear(64, 32)
        >>> fact = FactorizedLinear.from_linear(dense, latent_features=8)
        >>> fact(torch.randn(5, 64)).shape, fact.latent_features
        (torch.Size([5, 32]), 8)
    """

    latent_name = "latent_features"
    kind = "linear"

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        latent_features: int | float = 0.25,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, latent_features, kernel=())
        self.bias = bias
        self._build(device, dtype)

    in_features = _alias("in_size", "See :class:`torch.nn.Linear`.")
    out_features = _alias("out_size", "See :class:`torch.nn.Linear`.")
    latent_features = _alias("latent_size", "Size of the latent space between the two maps.")

    def _build_children(self, rank: int) -> tuple[nn.Module, nn.Module]:
        return (
            nn.Linear(self.in_size, rank, bias=False),
            nn.Linear(rank, self.out_size, bias=self.bias),
        )

    def _write_solution(self, wa: Tensor, wb: Tensor) -> None:
        _tensor(self.module0, "weight").copy_(wa.T)
        _tensor(self.module1, "weight").copy_(wb.T)

    @staticmethod
    def _latent_of(solution: LowRankSolution) -> int:
        assert solution.Wa is not None
        return int(solution.Wa.shape[1])

    def solution_for_rank(self, input: Tensor, rank: int | float) -> LowRankSolution:
        """Refit ``[in, rank] @ [rank, out]`` to this module's outputs on ``input [..., in]``."""
        x = input.detach().reshape(-1, self.in_size)
        with torch.no_grad():
            y = self(x)
        bias = _maybe_tensor(self.module1, "bias")
        return factorize_matrix(
            x,
            y,
            _tensor(self.module0, "weight").T,
            _tensor(self.module1, "weight").T,
            bias=bias,
            rank=self._resolve(rank),
            fit_bias=bias is not None,
        )

    @staticmethod
    def max_allowed_latent_features(in_features: int, out_features: int) -> int:
        """Largest latent size that still saves multiply-adds.

        Example:
            >>> FactorizedLinear.max_allowed_latent_features(1024, 1024)
            511
        """
        return max_rank_with_possible_speedup(in_features, out_features)

    # Composer's name for the same quantity, kept so that code moves over unchanged.
    max_allowed_latent_channels = max_allowed_latent_features

    @classmethod
    def sizes_of(cls, module: nn.Module) -> tuple[int, int, tuple[int, ...]]:
        """``(in_features, out_features, ())``."""
        _check_instance(module, nn.Linear)
        assert isinstance(module, nn.Linear)
        return module.in_features, module.out_features, ()

    @classmethod
    def regression_data(cls, module: nn.Module, input: Tensor) -> tuple[Tensor, Tensor]:
        """Rows ``[N, in]`` of ``input`` and the module's outputs ``[N, out]``."""
        _check_instance(module, nn.Linear)
        assert isinstance(module, nn.Linear)
        x = input.detach().reshape(-1, module.in_features)
        with torch.no_grad():
            y = module(x)
        return x, y

    @classmethod
    def _empty_for(cls, module: nn.Module, latent: int | float) -> FactorizedLinear:
        assert isinstance(module, nn.Linear)
        w = module.weight
        return cls(
            module.in_features,
            module.out_features,
            bias=module.bias is not None,
            latent_features=latent,
            device=w.device,
            dtype=w.dtype,
        )

    @classmethod
    def _svd_of(cls, module: nn.Module, k: int, seed: int) -> LowRankSolution:
        assert isinstance(module, nn.Linear)
        return _svd_solution(module.weight.T, module.bias, k, seed)

    @classmethod
    def _fitted(
        cls, module: nn.Module, input: Tensor, k: int, *, n_iters: int, seed: int
    ) -> LowRankSolution:
        assert isinstance(module, nn.Linear)
        x, y = cls.regression_data(module, input)
        return factorize_matrix(
            x,
            y,
            module.weight.T,
            bias=module.bias,
            rank=k,
            n_iters=n_iters,
            fit_bias=module.bias is not None,
            seed=seed,
        )

    @classmethod
    def from_linear(
        cls,
        module: nn.Linear,
        latent_features: int | float = 0.25,
        calibration_input: Tensor | None = None,
        *,
        n_iters: int = 3,
        seed: int = 0,
    ) -> FactorizedLinear:
        """Factorize a trained :class:`torch.nn.Linear`, keeping its function.

        Without ``calibration_input`` the factors are the truncated SVD of the
        weight (exact if the weight has rank <= ``latent_features``); with it,
        they minimise the output error on those inputs
        (:func:`factorize_matrix`). Unlike Composer, the trained weights are
        kept, never replaced by random factors.

        Args:
            module: the layer to factorize.
            latent_features: latent size (int or fraction of ``min(in, out)``).
            calibration_input: inputs ``[..., in_features]`` the layer sees.
            n_iters: alternating least-squares sweeps.
            seed: seed for the randomized SVD.

        Returns:
            A :class:`FactorizedLinear` on the layer's device and dtype.
        """
        fact, _ = cls.factorize_module(
            module, latent_features, calibration_input, n_iters=n_iters, seed=seed
        )
        return fact


_CONV_ARGS = ("stride", "padding", "dilation", "groups", "bias", "padding_mode", "device", "dtype")


@register_factorized_module(nn.Conv2d)
class FactorizedConv2d(_FactorizedModule):
    """Factorized replacement for :class:`torch.nn.Conv2d`.

    ``module0`` is a ``kh x kw`` convolution to ``latent_channels`` channels
    with the original stride, padding, dilation and padding mode (no bias);
    ``module1`` is a ``1 x 1`` convolution to ``out_channels`` carrying the
    bias. Strided convolutions are supported; grouped ones are not.

    Args:
        in_channels: channels of the input.
        out_channels: channels of the output.
        kernel_size: size of the kernel of ``module0``.
        latent_channels: latent channels, an int or a fraction in (0, 1) of
            ``min(in_channels, out_channels)`` (at least 1).
        **kwargs: ``stride``, ``padding``, ``dilation``, ``groups`` (must be
            1), ``bias`` (default ``True``), ``padding_mode``, ``device``,
            ``dtype``, as for :class:`torch.nn.Conv2d`.

    Raises:
        ValueError: if ``latent_channels`` is too large to save multiply-adds,
            or for an unknown keyword.
        NotImplementedError: if ``groups > 1``.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> conv = nn.Conv2d(16, 32, 3, stride=2, padding=1)
        >>> fact = FactorizedConv2d.from_conv2d(conv, latent_channels=8)
        >>> fact(torch.randn(2, 16, 9, 9)).shape
        torch.Size([2, 32, 5, 5])
    """

    latent_name = "latent_channels"
    kind = "conv2d"

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int],
        latent_channels: int | float = 0.25,
        **kwargs: Any,
    ) -> None:
        unknown = sorted(set(kwargs) - set(_CONV_ARGS))
        if unknown:
            raise ValueError(f"unknown keyword(s) {unknown}; allowed: {list(_CONV_ARGS)}.")
        groups = kwargs.pop("groups", 1)
        if groups != 1:
            raise NotImplementedError(
                f"`groups` must be 1; got groups={groups}. Grouped convolutions cannot be "
                "factorized; leave them as they are."
            )
        kernel = tuple(_as_pair(kernel_size))
        super().__init__(in_channels, out_channels, latent_channels, kernel=kernel)
        device, dtype = kwargs.pop("device", None), kwargs.pop("dtype", None)
        self.bias = bool(kwargs.pop("bias", True))
        self.conv_kwargs: dict[str, Any] = kwargs
        self._build(device, dtype)

    in_channels = _alias("in_size", "See :class:`torch.nn.Conv2d`.")
    out_channels = _alias("out_size", "See :class:`torch.nn.Conv2d`.")
    kernel_size = _alias("kernel", "See :class:`torch.nn.Conv2d`.")
    latent_channels = _alias("latent_size", "Channels between ``module0`` and ``module1``.")

    def _build_children(self, rank: int) -> tuple[nn.Module, nn.Module]:
        return (
            nn.Conv2d(
                self.in_size,
                rank,
                (self.kernel[0], self.kernel[1]),
                bias=False,
                **self.conv_kwargs,
            ),
            nn.Conv2d(rank, self.out_size, 1, bias=self.bias),
        )

    def _write_solution(self, wa: Tensor, wb: Tensor) -> None:
        _tensor(self.module0, "weight").copy_(wa)
        _tensor(self.module1, "weight").copy_(wb)

    @staticmethod
    def _latent_of(solution: LowRankSolution) -> int:
        assert solution.Wa is not None
        return int(solution.Wa.shape[0])

    def solution_for_rank(self, input: Tensor, rank: int | float) -> LowRankSolution:
        """Refit the pair at ``rank`` to this module's outputs on ``input [N, C, H, W]``."""
        conv = self.module0
        assert isinstance(conv, nn.Conv2d)
        bias = _maybe_tensor(self.module1, "bias")
        return factorize_conv2d(
            input,
            _tensor(self.module0, "weight"),
            _tensor(self.module1, "weight"),
            rank=self._resolve(rank),
            biasB=bias,
            fit_bias=bias is not None,
            **self._settings_of(conv),
        )

    @staticmethod
    def max_allowed_latent_channels(
        in_channels: int, out_channels: int, kernel_size: int | tuple[int, int]
    ) -> int:
        """Largest latent channel count that still saves multiply-adds.

        Example:
            >>> FactorizedConv2d.max_allowed_latent_channels(64, 64, 3)
            57
        """
        return max_rank_with_possible_speedup(in_channels, out_channels, kernel_size)

    # Composer's name for the same quantity.
    max_allowed_latent_features = max_allowed_latent_channels

    @classmethod
    def sizes_of(cls, module: nn.Module) -> tuple[int, int, tuple[int, ...]]:
        """``(in_channels, out_channels, kernel_size)``."""
        _check_instance(module, nn.Conv2d)
        assert isinstance(module, nn.Conv2d)
        return module.in_channels, module.out_channels, tuple(module.kernel_size)

    @classmethod
    def unsupported_reason(cls, module: nn.Module) -> str | None:
        """Grouped convolutions are not supported."""
        groups = getattr(module, "groups", 1)
        if groups != 1:
            return f"grouped convolution (groups={groups}) cannot be factorized"
        return None

    @staticmethod
    def _settings_of(module: nn.Conv2d) -> dict[str, Any]:
        return {
            "stride": module.stride,
            "padding": module.padding,
            "dilation": module.dilation,
            "padding_mode": module.padding_mode,
        }

    @classmethod
    def regression_data(cls, module: nn.Module, input: Tensor) -> tuple[Tensor, Tensor]:
        """Receptive fields ``[N * L, C * kh * kw]`` and outputs ``[N * L, out]``."""
        _check_instance(module, nn.Conv2d)
        assert isinstance(module, nn.Conv2d)
        x = conv_inputs_to_matrix(
            input.detach(), module.kernel_size, groups=module.groups, **cls._settings_of(module)
        )
        with torch.no_grad():
            y = x @ module.weight.reshape(module.out_channels, -1).T.to(x.dtype)
            if module.bias is not None:
                y = y + module.bias.to(x.dtype)
        return x, y

    @classmethod
    def _empty_for(cls, module: nn.Module, latent: int | float) -> FactorizedConv2d:
        assert isinstance(module, nn.Conv2d)
        w = module.weight
        return cls(
            module.in_channels,
            module.out_channels,
            tuple(module.kernel_size),  # type: ignore[arg-type]
            latent_channels=latent,
            groups=module.groups,
            bias=module.bias is not None,
            device=w.device,
            dtype=w.dtype,
            **cls._settings_of(module),
        )

    @classmethod
    def _svd_of(cls, module: nn.Module, k: int, seed: int) -> LowRankSolution:
        # The SVD of the [C * kh * kw, out] kernel matrix, reshaped into the two kernels.
        assert isinstance(module, nn.Conv2d)
        w = module.weight
        sol = _svd_solution(w.reshape(w.shape[0], -1).T, module.bias, k, seed)
        assert sol.Wa is not None and sol.Wb is not None
        sol.Wa = sol.Wa.T.reshape(k, *w.shape[1:]).contiguous()
        sol.Wb = sol.Wb.T.reshape(w.shape[0], k, 1, 1).contiguous()
        return sol

    @classmethod
    def _fitted(
        cls, module: nn.Module, input: Tensor, k: int, *, n_iters: int, seed: int
    ) -> LowRankSolution:
        assert isinstance(module, nn.Conv2d)
        return factorize_conv2d(
            input,
            module.weight,
            rank=k,
            biasA=module.bias,
            n_iters=n_iters,
            fit_bias=module.bias is not None,
            seed=seed,
            **cls._settings_of(module),
        )

    @classmethod
    def from_conv2d(
        cls,
        module: nn.Conv2d,
        latent_channels: int | float = 0.25,
        calibration_input: Tensor | None = None,
        *,
        n_iters: int = 3,
        seed: int = 0,
    ) -> FactorizedConv2d:
        """Factorize a trained :class:`torch.nn.Conv2d`, keeping its function.

        Without ``calibration_input`` the factors come from the truncated SVD
        of the ``[out, C * kh * kw]`` kernel matrix; with it, they minimise
        the output error on those inputs (:func:`factorize_conv2d`).

        Args:
            module: the convolution to factorize (``groups == 1``).
            latent_channels: latent channels (int or fraction of ``min(in, out)``).
            calibration_input: inputs ``[N, C, H, W]`` the layer sees.
            n_iters: alternating least-squares sweeps.
            seed: seed for the randomized SVD.

        Returns:
            A :class:`FactorizedConv2d` on the layer's device and dtype.
        """
        fact, _ = cls.factorize_module(
            module, latent_channels, calibration_input, n_iters=n_iters, seed=seed
        )
        return fact


def factorizing_could_speedup(module: nn.Module, latent_size: int | float) -> bool:
    """Whether factorizing ``module`` at ``latent_size`` could lower its multiply-adds.

    Registered module types are looked up in :data:`FACTORIZED_MODULES`;
    anything else (and grouped convolutions) gives ``False``.

    Example:
        >>> from torch import nn
        >>> factorizing_could_speedup(nn.Linear(512, 512), 0.25)
        True
        >>> factorizing_could_speedup(nn.ReLU(), 4)
        False
    """
    if isinstance(module, _FactorizedModule):
        return module.should_factorize(latent_size)
    cls = lookup_factorized_class(type(module))
    if cls is None or cls.unsupported_reason(module) is not None:
        return False
    n_in, n_out, kernel = cls.sizes_of(module)
    k = clean_latent_size(latent_size, n_in, n_out, "latent_size")
    return k <= max_rank_with_possible_speedup(n_in, n_out, kernel or None)


def lookup_factorized_class(module_type: type[nn.Module]) -> type[_FactorizedModule] | None:
    """Registered replacement for ``module_type`` or its nearest registered base."""
    for base in module_type.__mro__:
        if base in FACTORIZED_MODULES:
            return FACTORIZED_MODULES[base]
    return None
