"""Command line: ``gradsketch demo | sketch-demo | attribute | llc | factorize | bench``.

The commands as functions (each reads a Python config file and writes its
results to a folder) and the typer ``app`` that wraps them. Everything loads
on first use, so ``gradsketch --help`` is instant and importing this package
imports neither typer nor a capability. Needs typer:
``pip install gradsketch[cli]``.
"""

from __future__ import annotations

from gradsketch._lazy import lazy_getattr

__all__ = [
    # entry point and the typer app
    "main",
    "app",
    # `gradsketch attribute CONFIG.py`
    "attribute_command",
    "AttributeSettings",
    "load_config",
    "read_config",
    "batch_size",
    "REQUIRED_NAMES",
    "MODEL_NAMES",
    # `gradsketch llc CONFIG.py`
    "llc_command",
    "load_llc_config",
    # `gradsketch factorize CONFIG.py`
    "factorize_command",
    "CONFIG_SETTINGS",
    # errors
    "ConfigError",
    "ConfigFileError",
]

__getattr__ = lazy_getattr(
    __name__,
    {
        "app": "gradsketch.cli._app",
        "attribute_command": "gradsketch.cli._attribute",
        "AttributeSettings": "gradsketch.cli._attribute",
        "load_config": "gradsketch.cli._attribute",
        "read_config": "gradsketch.cli._attribute",
        "batch_size": "gradsketch.cli._attribute",
        "REQUIRED_NAMES": "gradsketch.cli._attribute",
        "MODEL_NAMES": "gradsketch.cli._attribute",
        "llc_command": "gradsketch.cli._llc",
        "load_llc_config": "gradsketch.cli._llc",
        "factorize_command": "gradsketch.cli._factorize",
        "CONFIG_SETTINGS": "gradsketch.cli._factorize",
        "ConfigError": "gradsketch.errors",
        "ConfigFileError": "gradsketch.errors",
    },
)


def main() -> None:
    """Console-script entry point (``gradsketch = "gradsketch.cli:main"``)."""
    try:
        from gradsketch.cli._app import run
    except ModuleNotFoundError as error:
        if error.name != "typer":
            raise
        raise SystemExit(
            "The gradsketch command line needs typer: pip install 'gradsketch[cli]'."
        ) from error
    run()
