"""devinterp 2.0's language-model layer on gradsketch's samplers.

Call-compatible with ``devinterp.slt`` (2.0.1): :func:`sample` runs SGMCMC
chains (:class:`gradsketch.sampling.SGMCMC`, every preconditioner, masks,
metrics and sketches) from a Hugging Face language model's weights and
records the per-token losses of every observable at every draw in a zarr
store with devinterp's layout; :func:`compute_llc`, :func:`compute_bif` and
:func:`compute_susceptibilities` turn a store (gradsketch's or devinterp's)
into estimates, and :func:`llc`, :func:`bif`, :func:`susceptibilities` do
both. :func:`bayesian_influence` (with :func:`sample_loss_draws` and
:func:`bif_from_draws`) gives Kreer et al.'s influence of training examples
on queries for any model with a per-example loss. Weight restrictions
(:func:`create_param_masks`) are :class:`gradsketch.masked.ParamMask`
objects, so the same restriction also restricts sketches and attribution.

Needs the ``hf`` extra (transformers, datasets, xarray).
"""

from gradsketch._processes import shutdown_workers
from gradsketch.errors import OutputPathMismatchError, UnsupportedModelError
from gradsketch.slt._bif_draws import (
    LossDraws,
    bayesian_influence,
    bif_from_draws,
    sample_loss_draws,
)
from gradsketch.slt._cache import SamplingCache
from gradsketch.slt._config import SAMPLING_METHODS, SamplerSettings
from gradsketch.slt._data import LossFn, NonFiniteLossError, as_token_tensor, per_token_loss
from gradsketch.slt._estimates import (
    FewChainsWarning,
    bif,
    compute_bif,
    compute_llc,
    compute_susceptibilities,
    llc,
    susceptibilities,
)
from gradsketch.slt._fast import FAST_PATHS
from gradsketch.slt._restrictions import (
    PROJECTIONS,
    STRUCTURES,
    HeadParam,
    Structure,
    create_param_masks,
    param_masks_dict,
    preview_weight_restriction,
    register_projection,
    register_structure,
    to_param_mask,
)
from gradsketch.slt._sample import UnsavedSamplesWarning, sample
from gradsketch.slt._schema import FAST_PATH_ATTR

__all__ = [
    # sampling
    "sample",
    "shutdown_workers",
    "SamplerSettings",
    "SamplingCache",
    "SAMPLING_METHODS",
    "FAST_PATHS",
    "FAST_PATH_ATTR",
    "OutputPathMismatchError",
    "UnsupportedModelError",
    "UnsavedSamplesWarning",
    "NonFiniteLossError",
    "LossFn",
    "per_token_loss",
    "as_token_tensor",
    # estimates
    "llc",
    "compute_llc",
    "FewChainsWarning",
    "bif",
    "compute_bif",
    "susceptibilities",
    "compute_susceptibilities",
    # Bayesian influence of any model from per-example losses at SGLD draws
    "bayesian_influence",
    "sample_loss_draws",
    "bif_from_draws",
    "LossDraws",
    # weight restrictions
    "create_param_masks",
    "preview_weight_restriction",
    "param_masks_dict",
    "to_param_mask",
    "Structure",
    "HeadParam",
    "STRUCTURES",
    "register_structure",
    "PROJECTIONS",
    "register_projection",
]
