"""Helpers shared by the tests (``tests/`` is on ``sys.path``; import as ``helpers.X``).

- :mod:`helpers.attribution`: small logistic-regression problems with
  explicit float64 gradient references.
- :mod:`helpers.factorize`: low-rank problems and slow reference solvers.
- :mod:`helpers.numerics`: float32 rounding bounds for runs that sum in
  other orders, and where bit equality holds instead.
- :mod:`helpers.launch`: ``torchrun`` launches on free ports, one-thread runs.

Fixtures live in ``tests/conftest.py``.
"""
