"""The replay benchmark's protocols and measurements (``benchmarks/bench_replay.py``).

A :class:`Protocol` (:func:`digits_protocol`, :func:`lm_protocol`, at the
:class:`Sizes` of :data:`SIZES`) holds the data, a replayable training run
and its retrains; :func:`run_lds`, :func:`run_ceiling`, :func:`run_cost`,
:func:`run_ops`, :func:`run_removal` and :func:`run_bergson` measure it, and
:func:`format_table` writes a run's closing table.
"""

from gradsketch.demos.protocols._replay import (
    OTHER_METHODS,
    PROTOCOLS,
    SIZES,
    Protocol,
    SequenceLogLikelihood,
    Sizes,
    digits_protocol,
    lds,
    lm_protocol,
    same_run_truth,
    subset_mask,
    timed,
)
from gradsketch.demos.protocols._replay_parts import (
    RIDGES,
    compare_with_best_other,
    format_table,
    held_out_fifth,
    ridge_datamodel,
    run_bergson,
    run_ceiling,
    run_cost,
    run_lds,
    run_ops,
    run_removal,
    seed_noise_bound,
)

__all__ = [
    # replay
    "OTHER_METHODS",
    "PROTOCOLS",
    "Protocol",
    "SIZES",
    "SequenceLogLikelihood",
    "Sizes",
    "digits_protocol",
    "lds",
    "lm_protocol",
    "same_run_truth",
    "subset_mask",
    "timed",
    # replay_parts
    "RIDGES",
    "compare_with_best_other",
    "format_table",
    "held_out_fifth",
    "ridge_datamodel",
    "run_bergson",
    "run_ceiling",
    "run_cost",
    "run_lds",
    "run_ops",
    "run_removal",
    "seed_noise_bound",
]
