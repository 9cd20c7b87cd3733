"""``gradsketch factorize CONFIG.py``: factorize a user's model from a Python config file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradsketch._config import load_config
from gradsketch.cli._paths import check_folder
from gradsketch.errors import ConfigError
from gradsketch.factorize import FactorizationReport, apply_factorization

__all__ = ["CONFIG_SETTINGS", "REPORT_FILE", "STATE_DICT_FILE", "factorize_command"]

CONFIG_SETTINGS: tuple[str, ...] = (
    "factorize_convs",
    "factorize_linears",
    "min_channels",
    "latent_channels",
    "min_features",
    "latent_features",
    "n_iters",
    "seed",
)
"""Optional names a config file may define; they are passed to :func:`apply_factorization`."""

STATE_DICT_FILE = "factorized_state_dict.pt"
REPORT_FILE = "factorization_report.json"


def _model_from(config: dict[str, Any], config_path: Path) -> nn.Module:
    if "model" in config:
        model = config["model"]
    elif callable(config.get("build_model")):
        model = config["build_model"]()
    else:
        raise ConfigError(
            f"config {str(config_path)!r} defines neither `model` nor `build_model()`; "
            "add one of them."
        )
    if not isinstance(model, nn.Module):
        raise ConfigError(f"config `model` must be a torch.nn.Module; got {type(model).__name__}.")
    return model


def factorize_command(
    config_path: str | Path, out_dir: str | Path, *, progress: bool = False
) -> FactorizationReport:
    r"""Load a config, factorize its model, save the state_dict and the report.

    The config is a Python file defining ``model`` (or ``build_model()``),
    ``calibration_data`` (one batch; ``None`` or absent to factorize from the
    weights alone) and optionally any of :data:`CONFIG_SETTINGS`. Writes
    ``out_dir/factorized_state_dict.pt`` and
    ``out_dir/factorization_report.json``. To load the checkpoint later,
    build the model, call :func:`apply_factorization` with the settings
    recorded in the report, then ``load_state_dict``.

    Args:
        config_path: path of the config file.
        out_dir: output directory (created if needed).
        progress: show a progress bar over the layers.

    Returns:
        The :class:`FactorizationReport`.

    Raises:
        ConfigFileError: if ``config_path`` is not an existing ``.py`` file
            (a ``FileNotFoundError``).
        ConfigError: if the config defines no model (a ``ValueError``).

    Example:
        >>> import tempfile, pathlib
        >>> tmp = pathlib.Path(tempfile.mkdtemp())
        >>> _ = (tmp / "cfg.py").write_text(
        ...     "import torch\nmodel = torch.nn.Sequential(torch.nn.Linear(64, 64))\n"
        ...     "calibration_data = torch.randn(128, 64)\nmin_features = 32\n"
        ... )
        >>> report = factorize_command(tmp / "cfg.py", tmp / "out")
        >>> report.replaced[0].rank, sorted(p.name for p in (tmp / "out").iterdir())
        (16, ['factorization_report.json', 'factorized_state_dict.pt'])
    """
    config_path = Path(config_path)
    out = check_folder(out_dir)  # before the factorization's cost
    config = vars(load_config(config_path, template="examples/factorize_config.py"))
    model = _model_from(config, config_path)
    settings = {k: config[k] for k in CONFIG_SETTINGS if k in config}
    report = apply_factorization(model, calibration_data=config.get("calibration_data"), **settings)
    report.settings["config"] = str(config_path)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), out / STATE_DICT_FILE)
    report.to_json(out / REPORT_FILE)
    return report
