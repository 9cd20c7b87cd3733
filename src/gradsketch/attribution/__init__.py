"""TRAK data attribution: which training examples made the model predict this.

A TRAK-compatible front end (:class:`TRAKer`, score computers, gradient
computers, model outputs: a script written for ``trak`` runs after changing
the import), the scoring kernel :func:`trak_scores` for projected gradients
held in memory, memmaps or zarr arrays, and the linear datamodeling score.
Park et al., "TRAK: Attributing Model Behavior at Scale", ICML 2023.
"""

from gradsketch.attribution._cli import AttributeSettings, ConfigError, attribute_command
from gradsketch.attribution._demo import DemoSettings, DemoSettingsError, run_demo
from gradsketch.attribution._digits import (
    TrainSettings,
    build_cnn,
    build_mlp,
    load_digits_split,
    train_digits_model,
)
from gradsketch.attribution._distributed import (
    ChunkShardSampler,
    DistributedMismatchError,
    chunk_shard,
    column_shard,
)
from gradsketch.attribution._gradient_computers import (
    AbstractGradientComputer,
    FunctionalGradientComputer,
)
from gradsketch.attribution._hook_computer import HookGradientComputer, WrappedModelError
from gradsketch.attribution._layers import (
    register_grad_sampler,
    register_layer_factors,
    register_row_sparse_sampler,
)
from gradsketch.attribution._lds import LDSGroundTruth, lds_ground_truth, linear_datamodeling_score
from gradsketch.attribution._lm import (
    BatchFormatError,
    LanguageModelingModelOutput,
    SequenceClassificationModelOutput,
)
from gradsketch.attribution._lm_params import select_parameters
from gradsketch.attribution._modelout import (
    LOSS_GRAD_FROM_OUTPUT,
    TASK_TO_MODELOUT,
    AbstractModelOutput,
    ImageClassificationModelOutput,
    TextClassificationModelOutput,
    UnknownTaskError,
    register_batch_output,
    register_loss_grad_from_output,
    register_task,
)
from gradsketch.attribution._score_computers import (
    AbstractScoreComputer,
    BasicScoreComputer,
    BasicSingleBlockScoreComputer,
)
from gradsketch.attribution._scores import MemoryBudgetError, trak_scores
from gradsketch.attribution._topk import TopK, trak_topk
from gradsketch.attribution._traker import ModelIDException, TRAKer, TRAKSettings
from gradsketch.attribution._transformer import TransformerBlock, TransformerClassifier

__all__ = [
    # front end
    "TRAKer",
    "TRAKSettings",
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
    "HookGradientComputer",
    "register_grad_sampler",
    "register_layer_factors",
    "register_row_sparse_sampler",
    "register_batch_output",
    "register_loss_grad_from_output",
    "LOSS_GRAD_FROM_OUTPUT",
    # model outputs
    "AbstractModelOutput",
    "ImageClassificationModelOutput",
    "TextClassificationModelOutput",
    "SequenceClassificationModelOutput",
    "LanguageModelingModelOutput",
    "select_parameters",
    "TASK_TO_MODELOUT",
    "register_task",
    # evaluation
    "linear_datamodeling_score",
    "lds_ground_truth",
    "LDSGroundTruth",
    # demo and command line (`gradsketch demo`, `gradsketch attribute CONFIG.py`)
    "DemoSettings",
    "run_demo",
    "load_digits_split",
    "build_mlp",
    "build_cnn",
    "TransformerClassifier",
    "TransformerBlock",
    "train_digits_model",
    "TrainSettings",
    "AttributeSettings",
    "attribute_command",
    # errors
    "ModelIDException",
    "WrappedModelError",
    "MemoryBudgetError",
    "UnknownTaskError",
    "BatchFormatError",
    "DemoSettingsError",
    "ConfigError",
    "DistributedMismatchError",
]
