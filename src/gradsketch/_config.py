"""The one way a command reads its Python config file.

A config is a plain ``.py`` file that defines names at module level. It is
imported under its own file name with its folder on ``sys.path``, so the
functions and classes it defines pickle by reference: spawned worker processes
(``cores > 1``) and ``torchrun`` ranks import the same file by that name.
Loading a file again re-executes it (a rerun after editing sees the edit).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

from gradsketch.errors import ConfigError, ConfigFileError

__all__ = ["load_config"]

# Set on every module this loader made, so that a later load of the same name
# replaces it instead of being refused as shadowing an imported module.
_MARK = "__gradsketch_config__"


def load_config(config_path: str | os.PathLike[str], *, template: str) -> ModuleType:
    """Execute a config file and return it as a module.

    Args:
        config_path: path of a ``.py`` file.
        template: the example config named in the error message (for example
            ``"examples/llc_config.py"``).

    Returns:
        The executed module, registered in ``sys.modules`` under the file's stem.

    Raises:
        ConfigFileError: ``config_path`` is not an existing ``.py`` file.
        ConfigError: the file's name is that of another imported module.

    Example:
        >>> import tempfile, pathlib
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> _ = (folder / "my_settings.py").write_text("proj_dim = 7")
        >>> load_config(folder / "my_settings.py", template="examples/x.py").proj_dim
        7
        >>> try:
        ...     load_config(folder / "absent.py", template="examples/x.py")
        ... except ConfigFileError as error:
        ...     print(str(error).split(",")[0])
        `config_path` must be an existing .py file
    """
    path = Path(config_path).resolve()
    if path.suffix != ".py" or not path.is_file():
        raise ConfigFileError(
            f"`config_path` must be an existing .py file, got {str(config_path)!r}; "
            f"see {template} for a template."
        )
    name = path.stem
    previous = sys.modules.get(name)
    if previous is not None and not getattr(previous, _MARK, False):
        raise ConfigError(
            f"config file {str(path)!r} has the name of the imported module {name!r}, which "
            "loading it would replace; rename the file (for example to "
            f"'{name}_config.py')."
        )
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"`config_path` {str(path)!r} cannot be imported as a Python module.")
    module = importlib.util.module_from_spec(spec)
    setattr(module, _MARK, True)
    # First on the path, so workers importing `name` find this file, not an
    # equally named config loaded earlier from another folder.
    if str(path.parent) in sys.path:
        sys.path.remove(str(path.parent))
    sys.path.insert(0, str(path.parent))
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module
