"""Low-rank factorization of ``nn.Linear`` / ``nn.Conv2d`` layers (Composer-compatible).

A layer is replaced by a narrow pair chosen to keep its outputs on real
inputs: an SVD start in the X-weighted space plus alternating least squares,
solved in the R-factor space of the inputs so that every solve is
``D``-sized. The modules start from the trained weights, the surgery reports
what it replaced and skips (with a reason) what it cannot replace safely.
"""

from gradsketch._lazy import lazy_getattr
from gradsketch.factorize._core import (
    INITS,
    LowRankSolution,
    factorize_conv2d,
    factorize_matrix,
)
from gradsketch.factorize._modules import (
    FACTORIZED_MODULES,
    FactorizedConv2d,
    FactorizedLinear,
    factorizing_could_speedup,
    max_rank_with_possible_speedup,
    register_factorized_module,
)
from gradsketch.factorize._plot import RankCurve, plot_rank_curve
from gradsketch.factorize._surgery import (
    DIRECT_WEIGHT_USERS,
    FactorizationReport,
    ReplacedModule,
    SkippedModule,
    apply_factorization,
)

__all__ = [
    # core (Composer factorize_core API)
    "LowRankSolution",
    "factorize_matrix",
    "factorize_conv2d",
    "INITS",
    # modules and their registry
    "FactorizedLinear",
    "FactorizedConv2d",
    "FACTORIZED_MODULES",
    "register_factorized_module",
    "factorizing_could_speedup",
    "max_rank_with_possible_speedup",
    # model surgery
    "apply_factorization",
    "FactorizationReport",
    "ReplacedModule",
    "SkippedModule",
    "DIRECT_WEIGHT_USERS",
    # diagnostics
    "RankCurve",
    "plot_rank_curve",
]

# The command line moved to gradsketch.cli; its names still import from here.
__getattr__ = lazy_getattr(
    __name__, dict.fromkeys(("factorize_command", "CONFIG_SETTINGS"), "gradsketch.cli")
)
