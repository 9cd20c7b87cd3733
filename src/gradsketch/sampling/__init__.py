"""SGMCMC sampling with exact per-step metrics and sketches, and LLC estimation.

The samplers split every step into its components (scaled and unscaled
gradient, localization, weight decay, noise), record their norms and inner
products exactly and their count-sketches from :mod:`gradsketch.sketch`, and
drive the local learning coefficient estimator (Lau et al. 2023). The
optimizer layer is call-compatible with devinterp 2.0's ``SGMCMC`` / ``SGLD``.
"""

from gradsketch.errors import DistributedMismatchError
from gradsketch.sampling._calibrate import (
    StepSizeCalibration,
    StepSizeDiagnostic,
    calibrate_step_size,
    calibrated_lr,
    estimate_learning_coeff_calibrated,
)
from gradsketch.sampling._chain import DrawSchedule, run_chain
from gradsketch.sampling._distributed import estimate_learning_coeff_distributed
from gradsketch.sampling._divergence import (
    ChainDivergenceWarning,
    divergence_report,
    warn_if_diverged,
)
from gradsketch.sampling._llc import (
    default_nbeta,
    estimate_learning_coeff,
    estimate_learning_coeff_with_summary,
    evaluate_ce,
)
from gradsketch.sampling._metrics import Metrics
from gradsketch.sampling._plot import plot_trace
from gradsketch.sampling._preconditioners import (
    PRECONDITIONERS,
    AdamPreconditioner,
    IdentityPreconditioner,
    NoseHooverThermostat,
    Preconditioner,
    PreconditionerCoefs,
    RMSpropPreconditioner,
    register_preconditioner,
)
from gradsketch.sampling._recording import LLCRecordSettings, SettingsMismatchError, open_draw_store
from gradsketch.sampling._sgmcmc import SGLD, SGMCMC, DevinterpSGNHTNoise
from gradsketch.sampling._truth import (
    deep_linear_learning_coefficient,
    normal_crossing_learning_coefficient,
    reduced_rank_learning_coefficient,
)

__all__ = [
    # samplers
    "SGMCMC",
    "SGLD",
    # per-step records
    "Metrics",
    # preconditioners (registry keyed by name)
    "PRECONDITIONERS",
    "Preconditioner",
    "PreconditionerCoefs",
    "IdentityPreconditioner",
    "RMSpropPreconditioner",
    "AdamPreconditioner",
    "NoseHooverThermostat",
    "DevinterpSGNHTNoise",
    "register_preconditioner",
    # the one chain loop every sampler runs
    "run_chain",
    "DrawSchedule",
    # local learning coefficient
    "estimate_learning_coeff_with_summary",
    "estimate_learning_coeff",
    "estimate_learning_coeff_distributed",
    "DistributedMismatchError",
    "default_nbeta",
    "evaluate_ce",
    # a diverged chain, named from its loss trace
    "ChainDivergenceWarning",
    "divergence_report",
    "warn_if_diverged",
    # recording and plots
    "LLCRecordSettings",
    "SettingsMismatchError",
    "open_draw_store",
    "plot_trace",
    # closed-form learning coefficients (ground truth for the estimator)
    "deep_linear_learning_coefficient",
    "reduced_rank_learning_coefficient",
    "normal_crossing_learning_coefficient",
    # step-size calibration from the chain's discretization-bias diagnostic
    "calibrate_step_size",
    "calibrated_lr",
    "StepSizeCalibration",
    "StepSizeDiagnostic",
    "estimate_learning_coeff_calibrated",
]
