"""``gradsketch llc CONFIG.py``: an LLC estimate from a small Python config file.

The config file is plain Python that defines, at module level:

* ``model``: the trained ``torch.nn.Module``;
* ``loader``: an iterable of batches (usually a DataLoader);
* optionally ``evaluate(model, batch)`` (default: cross-entropy on ``(x, y)``);
* optionally ``settings``: a dict of keyword arguments for
  :func:`~gradsketch.sampling.estimate_learning_coeff_with_summary`
  (``num_chains``, ``num_draws``, ``optimizer_kwargs``, ``seed``, ``cores``,
  ``store`` ...).

The config's directory is put on ``sys.path`` and the file imported under its
own name, so its functions pickle and ``cores > 1`` works.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from gradsketch._config import load_config
from gradsketch._distributed import is_distributed, rank
from gradsketch._json import jsonable
from gradsketch.cli._paths import check_folder
from gradsketch.errors import ConfigError
from gradsketch.sampling import (
    estimate_learning_coeff_distributed,
    estimate_learning_coeff_with_summary,
    plot_trace,
)

__all__ = ["PLOT_FILE", "SUMMARY_FILE", "llc_command", "load_llc_config"]

SUMMARY_FILE = "llc_summary.json"
PLOT_FILE = "llc_trace.png"
_REQUIRED = ("model", "loader")
_SETTINGS_ALLOWED = (
    "sampling_method",
    "optimizer_kwargs",
    "num_draws",
    "num_chains",
    "num_burnin_steps",
    "num_steps_bw_draws",
    "init_loss",
    "grad_accum_steps",
    "cores",
    "seed",
    "device",
    "online",
    "verbose",
    "store",
)


def load_llc_config(config_path: str | os.PathLike[str]) -> dict[str, Any]:
    """Import a config file and return ``{model, loader, evaluate, settings}``.

    Raises:
        ConfigFileError: ``config_path`` is not an existing ``.py`` file.
        ConfigError: the config lacks ``model`` or ``loader``, or its
            ``settings`` hold keys the estimator does not take.
    """
    module = load_config(config_path, template="examples/llc_config.py")
    name = Path(config_path).name
    missing = [key for key in _REQUIRED if not hasattr(module, key)]
    if missing:
        raise ConfigError(
            f"config {name} does not define {missing}; it must define {list(_REQUIRED)} "
            "and may define `evaluate` and `settings`."
        )
    settings = dict(getattr(module, "settings", {}) or {})
    unknown = sorted(set(settings) - set(_SETTINGS_ALLOWED))
    if unknown:
        raise ConfigError(
            f"config {name}: unknown keys {unknown} in `settings`; allowed: "
            f"{list(_SETTINGS_ALLOWED)}."
        )
    return {
        "model": module.model,
        "loader": module.loader,
        "evaluate": getattr(module, "evaluate", None),
        "settings": settings,
    }


def llc_command(config_path: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> Path:
    """Run the estimate a config file describes; write the summary JSON and the trace plot.

    Args:
        config_path: The config ``.py`` file (see the module docstring).
        out_dir: Output directory (created): ``llc_summary.json`` and ``llc_trace.png``.

    Under ``torchrun`` (a process group is initialised), chains are spread
    over ranks with :func:`estimate_learning_coeff_distributed` (``cores`` is
    ignored) and only rank 0 writes.

    Returns:
        Path of the summary JSON. Its ``llc/mean`` is also printed by the CLI.
    """
    out = check_folder(out_dir)  # before the sampling's cost
    config = load_llc_config(config_path)
    if is_distributed():
        # Under torchrun the chains spread over ranks; every rank gets the same
        # summary and rank 0 alone writes the files.
        settings = {k: v for k, v in config["settings"].items() if k != "cores"}
        results = estimate_learning_coeff_distributed(
            config["model"], config["loader"], evaluate=config["evaluate"], **settings
        )
        if rank() != 0:
            return out / SUMMARY_FILE
    else:
        results = estimate_learning_coeff_with_summary(
            config["model"], config["loader"], evaluate=config["evaluate"], **config["settings"]
        )
    out.mkdir(parents=True, exist_ok=True)
    plot_trace(results, out / PLOT_FILE)
    summary = {key: jsonable(value) for key, value in results.items()}
    summary["config"] = str(Path(config_path).resolve())
    path = out / SUMMARY_FILE
    path.write_text(json.dumps(summary, indent=2, sort_keys=True, allow_nan=False))
    return path
