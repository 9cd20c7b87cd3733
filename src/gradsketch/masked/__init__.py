"""Masked semantics: update, sample and sketch only the specified entries.

A sparse gradient in an optimizer is really a mask ("these entries are
specified"); writing it with sparse storage forces users to handle indices
and values. This subpackage gives masked semantics where they are needed:

- optimizers (:class:`MaskedAdagrad`, :class:`MaskedAdam`, :class:`MaskedSGD`)
  and their functional forms, which update parameters and state only at the
  specified entries of each step;
- :class:`ParamMask`, named boolean masks over a model's parameters that
  restrict optimizers, samplers, sketches and attribution to chosen weights.

This is the ground floor of gradsketch: it imports none of the other
capabilities, only the root helpers (hashing, checks, errors).
"""

from ._errors import MaskError
from ._functional import adagrad, adam, sgd
from ._optimizers import MaskedAdagrad, MaskedAdam, MaskedSGD
from ._parammask import ParamMask
from ._protocol import MaskLike

__all__ = [
    # optimizers
    "MaskedAdagrad",
    "MaskedAdam",
    "MaskedSGD",
    # functional forms
    "adagrad",
    "adam",
    "sgd",
    # parameter masks
    "ParamMask",
    "MaskLike",
    # errors
    "MaskError",
]
