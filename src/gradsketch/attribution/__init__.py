"""TRAK data attribution: which training examples made the model predict this.

A TRAK-compatible front end (:class:`TRAKer`, score computers, gradient
computers, model outputs: a script written for ``trak`` runs after changing
the import), the scoring kernel :func:`trak_scores` for projected gradients
held in memory, memmaps or zarr arrays, and the linear datamodeling score.
Park et al., "TRAK: Attributing Model Behavior at Scale", ICML 2023.
"""

import warnings as _warnings

from gradsketch._lazy import lazy_getattr
from gradsketch.attribution._distributed import (
    ChunkShardSampler,
    DistributedMismatchError,
    chunk_shard,
    column_shard,
)
from gradsketch.attribution._fisher import (
    INFLUENCE_OUTPUTS,
    SAMPLED_LOSSES,
    register_influence_output,
    register_sampled_loss,
)
from gradsketch.attribution._gradient_computers import (
    AbstractGradientComputer,
    FunctionalGradientComputer,
    IterativeGradientComputer,
    VmapTraceError,
)
from gradsketch.attribution._hook_computer import HookGradientComputer, WrappedModelError
from gradsketch.attribution._influence import (
    CURVATURES,
    INFLUENCE_METHODS,
    InfluenceComputer,
    InfluenceSettings,
)
from gradsketch.attribution._integrity import NonFiniteFeaturesError
from gradsketch.attribution._layers import (
    HookComputationError,
    register_grad_sampler,
    register_layer_factors,
    register_row_sparse_sampler,
    register_whole_module,
)
from gradsketch.attribution._lds import (
    LDSGroundTruth,
    LDSInterval,
    lds_ground_truth,
    linear_datamodeling_interval,
    linear_datamodeling_score,
)
from gradsketch.attribution._lm import (
    BatchFormatError,
    LanguageModelingModelOutput,
    Seq2SeqLMModelOutput,
    SequenceClassificationModelOutput,
)
from gradsketch.attribution._lm_params import select_parameters
from gradsketch.attribution._modelout import (
    LOSS_GRAD_FROM_OUTPUT,
    TASK_TO_MODELOUT,
    AbstractModelOutput,
    ImageClassificationModelOutput,
    IterativeImageClassificationModelOutput,
    TextClassificationModelOutput,
    UnknownTaskError,
    register_batch_output,
    register_loss_grad_from_output,
    register_task,
)
from gradsketch.attribution._plan import AttributionPlan
from gradsketch.attribution._preconditioners import (
    CURVATURE_PRECONDITIONERS,
    CurvaturePreconditioner,
    FeatureBatch,
    PreconditionerSpec,
    TrainRows,
    register_curvature_preconditioner,
)
from gradsketch.attribution._replay import (
    AUTO_CANDIDATES,
    REPLAY_OPTIMIZERS,
    TRAINING_LOSSES,
    AutoLinearization,
    LinearizationChoice,
    MemoryEstimate,
    ReplayAttributor,
    ReplaySettings,
    batch_order,
    register_training_loss,
)
from gradsketch.attribution._replay_hf import ReplayCallback
from gradsketch.attribution._score_computers import (
    AbstractScoreComputer,
    BasicScoreComputer,
    BasicSingleBlockScoreComputer,
)
from gradsketch.attribution._scores import MemoryBudgetError, trak_scores
from gradsketch.attribution._topk import TopK, trak_topk
from gradsketch.attribution._traker import ModelIDException, ReplayTRAKer, TRAKer, TRAKSettings
from gradsketch.attribution._traker_arguments import ARGUMENT_REFUSALS, REPLAY_UNUSED_ARGUMENTS
from gradsketch.attribution._vocab_layers import VOCABULARY_FACTOR_LIMIT
from gradsketch.errors import UnsupportedModelError

__all__ = [
    # front end
    "TRAKer",
    "TRAKSettings",
    "AttributionPlan",
    "VOCABULARY_FACTOR_LIMIT",
    "ARGUMENT_REFUSALS",
    "REPLAY_UNUSED_ARGUMENTS",
    # scoring
    "trak_scores",
    "trak_topk",
    "TopK",
    "AbstractScoreComputer",
    "BasicSingleBlockScoreComputer",
    "BasicScoreComputer",
    # torch.distributed (torchrun): chunk-aligned shards
    "chunk_shard",
    "column_shard",
    "ChunkShardSampler",
    # per-example gradients
    "AbstractGradientComputer",
    "FunctionalGradientComputer",
    "IterativeGradientComputer",
    "HookGradientComputer",
    "register_grad_sampler",
    "register_layer_factors",
    "register_row_sparse_sampler",
    "register_whole_module",
    "register_batch_output",
    "register_loss_grad_from_output",
    "LOSS_GRAD_FROM_OUTPUT",
    # model outputs
    "AbstractModelOutput",
    "ImageClassificationModelOutput",
    "IterativeImageClassificationModelOutput",
    "TextClassificationModelOutput",
    "SequenceClassificationModelOutput",
    "LanguageModelingModelOutput",
    "Seq2SeqLMModelOutput",
    "select_parameters",
    "TASK_TO_MODELOUT",
    "register_task",
    # metagradients through training (MAGIC): replay a run, reverse its optimizer
    "ReplayAttributor",
    "ReplaySettings",
    "AutoLinearization",
    "LinearizationChoice",
    "AUTO_CANDIDATES",
    "ReplayCallback",
    "ReplayTRAKer",
    "MemoryEstimate",
    "REPLAY_OPTIMIZERS",
    "TRAINING_LOSSES",
    "register_training_loss",
    "batch_order",
    # evaluation
    "linear_datamodeling_score",
    "linear_datamodeling_interval",
    "LDSInterval",
    "lds_ground_truth",
    "LDSGroundTruth",
    # errors
    "ModelIDException",
    "NonFiniteFeaturesError",
    "WrappedModelError",
    "HookComputationError",
    "MemoryBudgetError",
    "UnknownTaskError",
    "UnsupportedModelError",
    "BatchFormatError",
    "VmapTraceError",
    "DistributedMismatchError",
    # preconditioners: TRAKer(method=name) for every registered one
    "CurvaturePreconditioner",
    "PreconditionerSpec",
    "FeatureBatch",
    "TrainRows",
    "CURVATURE_PRECONDITIONERS",
    "register_curvature_preconditioner",
    # curvature-aware influence (K-FAC / EK-FAC / identity; TRAKer(method=...))
    "InfluenceComputer",
    "InfluenceSettings",
    "INFLUENCE_METHODS",
    "CURVATURES",
    "SAMPLED_LOSSES",
    "register_sampled_loss",
    "INFLUENCE_OUTPUTS",
    "register_influence_output",
]

# The demo, its bundled data and the command line moved to gradsketch.demos and
# gradsketch.cli; their names still import from here, loaded on first use (so
# importing this package imports neither typer, matplotlib nor scikit-learn).
_lazy_getattr = lazy_getattr(
    __name__,
    {
        **dict.fromkeys(
            (
                "DemoSettings",
                "DemoSettingsError",
                "run_demo",
                "load_digits_split",
                "build_mlp",
                "build_cnn",
                "train_digits_model",
                "TrainSettings",
                "TransformerClassifier",
                "TransformerBlock",
            ),
            "gradsketch.demos",
        ),
        **dict.fromkeys(("AttributeSettings", "attribute_command"), "gradsketch.cli"),
        "ConfigError": "gradsketch.errors",
    },
)

#: Old names of the curvature-preconditioner family, kept for one release: they
#: clashed with gradsketch.sampling's (SGMCMC) Preconditioner names.
_DEPRECATED = {
    "Preconditioner": "CurvaturePreconditioner",
    "PRECONDITIONERS": "CURVATURE_PRECONDITIONERS",
    "register_preconditioner": "register_curvature_preconditioner",
}


def __getattr__(name: str) -> object:
    new = _DEPRECATED.get(name)
    if new is not None:
        _warnings.warn(
            f"gradsketch.attribution.{name} is deprecated and will be removed in the next "
            f"release; use gradsketch.attribution.{new} (gradsketch.sampling.{name} is the "
            "SGMCMC preconditioner family, another thing).",
            DeprecationWarning,
            stacklevel=2,
        )
        return globals()[new]
    return _lazy_getattr(name)
