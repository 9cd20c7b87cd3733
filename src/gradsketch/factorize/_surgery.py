"""Model surgery: swap wide Linear / Conv2d layers for factorized ones, with a report."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from tqdm.auto import tqdm

from gradsketch._checks import nonnegative_int
from gradsketch._inputs import check_model_inputs
from gradsketch.factorize._modules import (
    _FactorizedModule,
    clean_latent_size,
    lookup_factorized_class,
    max_rank_with_possible_speedup,
)

__all__ = [
    "DIRECT_WEIGHT_USERS",
    "FactorizationReport",
    "ReplacedModule",
    "SkippedModule",
    "apply_factorization",
]

DIRECT_WEIGHT_USERS: tuple[type[nn.Module], ...] = (
    nn.MultiheadAttention,
    nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer,
)
"""Parents whose ``forward`` reads a child layer's ``.weight`` directly (fused paths).

Their Linear children are skipped: a factorized module has no ``.weight``.
"""


@dataclasses.dataclass
class ReplacedModule:
    """One layer that was factorized.

    ``macs_*`` count multiply-adds per output position (per sample for a
    Linear, per output pixel for a Conv2d). ``nmse`` is measured on the
    calibration inputs when given; otherwise it is the relative squared
    Frobenius error of the weight (the nmse on white inputs).
    """

    name: str
    kind: str
    in_size: int
    out_size: int
    rank: int
    max_rank: int
    nmse: float
    nmse_on: str
    params_before: int
    params_after: int
    macs_before: int
    macs_after: int


@dataclasses.dataclass
class SkippedModule:
    """One candidate layer left as it was, and why."""

    name: str
    kind: str
    reason: str


@dataclasses.dataclass
class FactorizationReport:
    """What :func:`apply_factorization` did: replaced layers, skipped layers, settings."""

    replaced: list[ReplacedModule] = dataclasses.field(default_factory=list)
    skipped: list[SkippedModule] = dataclasses.field(default_factory=list)
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def params_saved(self) -> int:
        """Parameters removed by the replaced layers."""
        return sum(r.params_before - r.params_after for r in self.replaced)

    @property
    def macs_saved(self) -> int:
        """Multiply-adds saved per output position, summed over replaced layers."""
        return sum(r.macs_before - r.macs_after for r in self.replaced)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dictionary, totals included."""
        return {
            "settings": self.settings,
            "replaced": [dataclasses.asdict(r) for r in self.replaced],
            "skipped": [dataclasses.asdict(s) for s in self.skipped],
            "params_saved": self.params_saved,
            "macs_saved": self.macs_saved,
        }

    def to_json(self, path: str | Path | None = None) -> str:
        """The report as JSON text, also written to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text

    def __str__(self) -> str:
        lines = [
            f"factorized {len(self.replaced)} layer(s), skipped {len(self.skipped)}; "
            f"{self.params_saved} parameters and {self.macs_saved} MACs/position saved"
        ]
        lines += [
            f"  + {r.name}: {r.kind} {r.in_size}->{r.rank}->{r.out_size} nmse={r.nmse:.4g}"
            for r in self.replaced
        ]
        lines += [f"  - {s.name}: {s.reason}" for s in self.skipped]
        return "\n".join(lines)


def _param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def _swap_in_optimizers(optimizers: Sequence[Optimizer], old: nn.Module, new: nn.Module) -> None:
    old_ids = {id(p) for p in old.parameters()}
    for opt in optimizers:
        for group in opt.param_groups:
            params = group["params"]
            if not any(id(p) in old_ids for p in params):
                continue
            for p in params:
                if id(p) in old_ids:
                    opt.state.pop(p, None)
            group["params"] = [p for p in params if id(p) not in old_ids] + list(new.parameters())


def _as_optimizer_list(optimizers: Optimizer | Sequence[Optimizer] | None) -> list[Optimizer]:
    if optimizers is None:
        return []
    if isinstance(optimizers, Optimizer):
        return [optimizers]
    opts = list(optimizers)
    for o in opts:
        if not isinstance(o, Optimizer):
            raise TypeError(
                f"`optimizers` must be an Optimizer or a sequence of them; got an element "
                f"of type {type(o).__name__}."
            )
    return opts


def _run_model(model: nn.Module, data: Any) -> None:
    # A batch the model cannot take is named here, not by torch deep in the forward.
    if isinstance(data, Tensor):
        check_model_inputs(model, data, argument="calibration_data")
        model(data)
    elif isinstance(data, Mapping):
        model(**data)
    elif isinstance(data, (tuple, list)):
        if data:
            check_model_inputs(model, data[0], argument="calibration_data[0]")
        model(*data)
    else:
        raise TypeError(
            "`calibration_data` must be a Tensor (one positional input), a tuple/list of "
            f"positional inputs or a dict of keyword inputs; got {type(data).__name__}."
        )


def _capture_inputs(model: nn.Module, names: Iterable[str], data: Any) -> dict[str, Tensor]:
    """Inputs each named layer receives in one eval-mode forward pass over ``data``."""
    captured: dict[str, Tensor] = {}
    handles = []

    def make_hook(name: str) -> Any:
        def hook(_module: nn.Module, args: tuple[Any, ...]) -> None:
            if args and isinstance(args[0], Tensor):
                captured[name] = args[0].detach()

        return hook

    was_training = model.training
    try:
        for name in names:
            handles.append(model.get_submodule(name).register_forward_pre_hook(make_hook(name)))
        model.eval()
        with torch.no_grad():
            _run_model(model, data)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return captured


def _check_settings(
    min_channels: int,
    min_features: int,
    latent_channels: int | float,
    latent_features: int | float,
) -> None:
    for name, v in (("min_channels", min_channels), ("min_features", min_features)):
        nonnegative_int(name, v, fix=f"pass e.g. {name}=0 to consider every layer")
    for name, lat in (("latent_channels", latent_channels), ("latent_features", latent_features)):
        clean_latent_size(lat, 1 << 20, 1 << 20, name)


def apply_factorization(
    model: nn.Module,
    factorize_convs: bool = True,
    factorize_linears: bool = True,
    min_channels: int = 512,
    latent_channels: int | float = 0.25,
    min_features: int = 512,
    latent_features: int | float = 0.25,
    optimizers: Optimizer | Sequence[Optimizer] | None = None,
    calibration_data: Any = None,
    *,
    n_iters: int = 3,
    seed: int = 0,
    progress: bool = False,
) -> FactorizationReport:
    """Replace wide ``nn.Linear`` / ``nn.Conv2d`` layers of ``model`` in place by factorized ones.

    Each replacement starts from the trained layer: the truncated SVD of its
    weight, or, with ``calibration_data``, the output-error optimum on the
    inputs the layer sees on that batch (captured in eval mode with forward
    pre-hooks, all layers in one pass). Layers are matched through the
    :data:`FACTORIZED_MODULES` registry. Layers that cannot be replaced safely
    are skipped with a reason, never broken: grouped convolutions, layers whose
    parent reads ``.weight`` directly (:data:`DIRECT_WEIGHT_USERS`, e.g.
    ``nn.MultiheadAttention.out_proj``), subclasses of the registered types,
    layers with tied weights or registered under several names, layers
    narrower than ``min_channels`` / ``min_features``, and layers for which the
    latent size would not save multiply-adds.

    Args:
        model: the model to modify in place.
        factorize_convs: whether to consider ``nn.Conv2d`` layers.
        factorize_linears: whether to consider ``nn.Linear`` layers.
        min_channels: skip convolutions with ``min(in, out)`` channels below this.
        latent_channels: latent channels, int or fraction of ``min(in, out)``.
        min_features: skip linears with ``min(in, out)`` features below this.
        latent_features: latent features, int or fraction of ``min(in, out)``.
        optimizers: optimizers already holding ``model.parameters()``; their
            param groups are updated (state of replaced parameters dropped).
        calibration_data: one batch to call ``model`` on: a Tensor, a tuple
            of positional inputs or a dict of keyword inputs; ``None`` to
            factorize from the weights alone.
        n_iters: alternating least-squares sweeps per layer.
        seed: seed of the randomized SVDs.
        progress: show a tqdm progress bar over the layers being factorized.

    Returns:
        A :class:`FactorizationReport`.

    Raises:
        ValueError: for a wrapped (DataParallel / DDP) model or bad settings.
        TypeError: for a bad ``calibration_data`` or ``optimizers``.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
        >>> report = apply_factorization(model, min_features=32, latent_features=8)
        >>> [r.name for r in report.replaced], model(torch.randn(2, 64)).shape
        (['0'], torch.Size([2, 8]))
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"`model` must be a torch.nn.Module; got {type(model).__name__}.")
    if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        raise ValueError(
            f"`model` is wrapped in {type(model).__name__}; apply factorization to "
            "`model.module` before wrapping it."
        )
    _check_settings(min_channels, min_features, latent_channels, latent_features)
    opts = _as_optimizer_list(optimizers)
    settings: dict[str, Any] = {
        "factorize_convs": factorize_convs,
        "factorize_linears": factorize_linears,
        "min_channels": min_channels,
        "latent_channels": latent_channels,
        "min_features": min_features,
        "latent_features": latent_features,
        "calibrated": calibration_data is not None,
        "n_iters": n_iters,
        "seed": seed,
    }
    per_kind = {
        "linear": (
            factorize_linears,
            "factorize_linears",
            min_features,
            "min_features",
            latent_features,
        ),
        "conv2d": (
            factorize_convs,
            "factorize_convs",
            min_channels,
            "min_channels",
            latent_channels,
        ),
    }
    report = FactorizationReport(settings=settings)

    all_names: dict[int, list[str]] = {}
    for name, mod in model.named_modules(remove_duplicate=False):
        all_names.setdefault(id(mod), []).append(name)
    param_owners: dict[int, list[str]] = {}
    for name, mod in model.named_modules():
        for p in mod.parameters(recurse=False):
            param_owners.setdefault(id(p), []).append(name)
    modules = dict(model.named_modules())

    plan: list[tuple[str, nn.Module, type[_FactorizedModule], int | float]] = []
    inside_factorized: list[str] = []
    for name, mod in modules.items():
        if any(name.startswith(prefix + ".") for prefix in inside_factorized):
            continue
        if isinstance(mod, _FactorizedModule):
            inside_factorized.append(name)
            continue
        cls = lookup_factorized_class(type(mod))
        if cls is None or not name:
            continue
        enabled, flag, min_size, min_name, latent = per_kind.get(cls.kind, (True, "", 0, "", 0.25))
        parent = modules[name.rpartition(".")[0]]
        reason: str | None = None
        n_in, n_out, kernel = cls.sizes_of(mod)
        if not enabled:
            reason = f"`{flag}` is False"
        elif isinstance(parent, DIRECT_WEIGHT_USERS):
            reason = (
                f"its parent {type(parent).__name__} reads `.weight` directly in forward; "
                "replacing it would break the model"
            )
        elif type(mod) is not cls.replaces:
            reason = (
                f"{type(mod).__name__} subclasses {cls.replaces.__name__} and may rely on "
                "`.weight`; only exact types are replaced"
            )
        elif (why := cls.unsupported_reason(mod)) is not None:
            reason = why
        elif len(all_names[id(mod)]) > 1:
            reason = f"the module is registered under several names {all_names[id(mod)]}"
        elif any(len(param_owners[id(p)]) > 1 for p in mod.parameters(recurse=False)):
            reason = "its parameters are shared (tied) with another module"
        elif min(n_in, n_out) < min_size:
            reason = f"min(in, out)={min(n_in, n_out)} is below `{min_name}`={min_size}"
        else:
            k = clean_latent_size(latent, n_in, n_out, "latent")
            limit = max_rank_with_possible_speedup(n_in, n_out, kernel or None)
            if k > limit:
                reason = f"latent size {k} would not save multiply-adds (needs <= {limit})"
        if reason is not None:
            report.skipped.append(SkippedModule(name, cls.kind, reason))
        else:
            plan.append((name, mod, cls, latent))

    inputs: dict[str, Tensor] = {}
    if calibration_data is not None and plan:
        inputs = _capture_inputs(model, [p[0] for p in plan], calibration_data)

    for name, mod, cls, latent in tqdm(plan, desc="factorize", disable=not progress):
        calib = inputs.get(name)
        if calibration_data is not None and calib is None:
            report.skipped.append(SkippedModule(name, cls.kind, "not called on `calibration_data`"))
            continue
        new, sol = cls.factorize_module(mod, latent, calib, n_iters=n_iters, seed=seed)
        n_in, n_out, kernel = cls.sizes_of(mod)
        fan_in = new.fan_in
        k = new.latent_size
        report.replaced.append(
            ReplacedModule(
                name=name,
                kind=cls.kind,
                in_size=n_in,
                out_size=n_out,
                rank=k,
                max_rank=max_rank_with_possible_speedup(n_in, n_out, kernel or None),
                nmse=float(sol.nmse),
                nmse_on="calibration_data" if calib is not None else "weights",
                params_before=_param_count(mod),
                params_after=_param_count(new),
                macs_before=fan_in * n_out,
                macs_after=k * (fan_in + n_out),
            )
        )
        _set_submodule(model, name, new)
        _swap_in_optimizers(opts, mod, new)
    return report
