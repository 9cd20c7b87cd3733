"""The settings of :func:`~gradsketch.slt.sample`: devinterp's ``SamplerConfig``, validated.

:class:`SamplerSettings` holds the sampler settings in devinterp 2.0.1's
order and checks them at construction; they are stored in a sample store's
root ``metadata`` exactly as devinterp stores them, and compared when an
``output_path`` is reused. :data:`SAMPLING_METHODS` maps each
``sampling_method`` to its :class:`~gradsketch.sampling.SGMCMC` factory, and
:func:`sampler_factory` turns the settings into that factory's keywords.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import torch

from gradsketch.sampling import SGMCMC

__all__ = ["SAMPLING_METHODS", "SamplerSettings", "sampler_factory"]

#: ``sampling_method`` names (devinterp's, plus gradsketch's other samplers) -> SGMCMC factory.
SAMPLING_METHODS: dict[str, Callable[..., SGMCMC]] = {
    "sgmcmc_sgld": SGMCMC.sgld,
    "rmsprop_sgld": SGMCMC.rmsprop_sgld,
    "adam_sgld": SGMCMC.adam_sgld,
    "sgnht": SGMCMC.sgnht,
}


@dataclasses.dataclass
class SamplerSettings:
    """The sampler settings of :func:`sample`, in devinterp's ``SamplerConfig`` order.

    They are stored in the store's root ``metadata`` exactly as devinterp
    stores them, and compared when an ``output_path`` is reused.
    """

    lr: float
    n_beta: float
    batch_size: int = 32
    num_chains: int = 4
    num_draws: int = 200
    num_burnin_steps: int = 0
    num_steps_bw_draws: int = 1
    gradient_accumulation_steps: int = 1
    num_init_loss_batches: int = 32
    init_seed: int = 100
    localization: float = 0.0
    noise_level: float = 1.0
    llc_weight_decay: float = 0.0
    bounding_box_size: float | None = None
    sampling_method: str = "sgmcmc_sgld"
    sampling_method_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    init_noise: float | None = None
    save_metrics: bool = False
    shuffle: bool = True
    epoch_mode: str = "cycle"
    match_sampling_input_ids_across_chains: bool = True

    def __post_init__(self) -> None:
        for name in ("lr", "n_beta", "localization", "noise_level", "llc_weight_decay"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"`{name}` must be a non-negative number, got {value!r}.")
            setattr(self, name, float(value))
        for name in ("lr", "n_beta"):
            if getattr(self, name) == 0:
                raise ValueError(f"`{name}` must be positive, got 0.")
        for name, low in (
            ("batch_size", 1),
            ("num_chains", 1),
            ("num_draws", 1),
            ("num_burnin_steps", 0),
            ("num_steps_bw_draws", 1),
            ("gradient_accumulation_steps", 1),
            ("num_init_loss_batches", 1),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                kind = "non-negative" if low == 0 else "positive"
                raise ValueError(f"`{name}` must be a {kind} int, got {value!r}.")
        if isinstance(self.init_seed, bool) or not isinstance(self.init_seed, int):
            raise TypeError(f"`init_seed` must be an int, got {self.init_seed!r}.")
        for name in ("bounding_box_size", "init_noise"):
            value = getattr(self, name)
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                    raise ValueError(
                        f"`{name}` must be None or a non-negative number, got {value!r}."
                    )
                setattr(self, name, float(value))
        if self.sampling_method not in SAMPLING_METHODS:
            raise ValueError(
                f"`sampling_method` must be one of {sorted(SAMPLING_METHODS)}, got "
                f"{self.sampling_method!r}."
            )
        if self.epoch_mode != "cycle":
            raise ValueError(f"`epoch_mode` must be 'cycle', got {self.epoch_mode!r}.")

    @property
    def num_steps(self) -> int:
        """Sampler steps per chain: ``num_draws * num_steps_bw_draws + num_burnin_steps``."""
        return self.num_draws * self.num_steps_bw_draws + self.num_burnin_steps

    def metadata(self) -> dict[str, Any]:
        """The ``config.sampler`` record devinterp 2.0.1 writes (with its legacy fields)."""
        return {
            **dataclasses.asdict(self),
            "scheduler_type": "constant",
            "scheduler_kwargs": None,
            "cores": 1,
            "online": False,
        }


def sampler_factory(
    settings: SamplerSettings, mask: list[torch.Tensor | None] | None, sketch_dim: int | None
) -> tuple[Callable[..., SGMCMC], dict[str, Any]]:
    """The SGMCMC factory of ``settings.sampling_method`` and its keywords.

    ``mask`` holds one entry per sampled parameter (None: all of it moves).

    Raises:
        ValueError: a setting the chosen sampler does not take (naming it and the samplers
            that do), or ``sampling_method_kwargs`` it does not know.
    """
    factory = SAMPLING_METHODS[settings.sampling_method]
    kwargs: dict[str, Any] = {
        "lr": settings.lr,
        "nbeta": settings.n_beta,
        "localization": settings.localization,
        "weight_decay": settings.llc_weight_decay,
        "bounding_box_size": settings.bounding_box_size,
        "save_metrics": settings.save_metrics,
        "noise_level": settings.noise_level,
        "mask": mask,
        "sketch_dim": sketch_dim,
    }
    accepted = set(inspect.signature(factory).parameters) - {"params"}
    for name in list(kwargs):
        if name in accepted:
            continue
        default = {"noise_level": 1.0, "mask": None}.get(name)
        if kwargs[name] != default:
            what = "a weight restriction" if name == "mask" else f"{name}={kwargs[name]!r}"
            raise ValueError(
                f"`sampling_method`={settings.sampling_method!r} does not take {what}; use "
                "'sgmcmc_sgld' or 'rmsprop_sgld' for it."
            )
        del kwargs[name]
    extra = dict(settings.sampling_method_kwargs)
    unknown = sorted(set(extra) - accepted)
    if unknown:
        raise ValueError(
            f"`sampling_method_kwargs` has {unknown}, which {settings.sampling_method!r} does not "
            f"take; it takes {sorted(accepted - set(kwargs))}."
        )
    return factory, {**kwargs, **extra}
