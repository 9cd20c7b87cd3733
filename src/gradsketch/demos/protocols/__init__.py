"""The benchmarks' attribution protocols, as the benchmarks and the tests run them.

Demo-level code, not library: each protocol fixes a model, its data, a
training run that can be retrained on subsets, and the ground truths the
linear datamodeling score compares attributions with. The scripts of
``benchmarks/`` measure them and print the figures of
``benchmarks/RESULTS.md``; the tests import them from here.

- :mod:`gradsketch.demos.protocols.replay`: the replay benchmark's protocols
  and measurements (``benchmarks/bench_replay.py``).
- :mod:`gradsketch.demos.protocols.influence`: the influence benchmarks'
  protocols, Kronfluence's side of them, and the five protocols that chose
  the per-layer methods' defaults (``benchmarks/bench_influence*.py``).
- One JSON line per figure, naming its machine: :func:`emit`,
  :func:`machine_info`, :func:`cpu_model`; :func:`setup_torch`,
  :func:`time_once`.
"""

from gradsketch.demos.protocols._records import (
    DEFAULT_THREADS,
    cpu_model,
    emit,
    machine_info,
    setup_torch,
    time_once,
)

__all__ = [
    "DEFAULT_THREADS",
    "cpu_model",
    "emit",
    "machine_info",
    "setup_torch",
    "time_once",
]
