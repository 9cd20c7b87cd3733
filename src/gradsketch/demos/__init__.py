"""Demos and the bundled data they run on (not part of the library proper).

``gradsketch demo`` (TRAK on scikit-learn's bundled digits, with the linear
datamodeling score and a gallery) and ``gradsketch sketch-demo`` (inner-product
error against sketch size) run from here, and so do the examples, tests and
benchmarks that need real models trained in seconds without downloads: the
digits split, a small MLP and CNN, a deterministic trainer and a small
transformer classifier. Needs scikit-learn (``load_digits``) and matplotlib
(the gallery and plots): ``pip install gradsketch[demo]``.
"""

from gradsketch.demos._attribution import (
    DemoSettings,
    DemoSettingsError,
    attribute_digits,
    digits_lds_ground_truth,
    format_report,
    gallery_rows,
    run_demo,
    to_numpy,
    top_share_same_label,
    train_checkpoints,
    write_gallery,
)
from gradsketch.demos._digits import (
    ARCHITECTURES,
    NUM_CLASSES,
    NUM_FEATURES,
    DigitsSettingsError,
    DigitsSplit,
    TrainSettings,
    accuracy,
    build_cnn,
    build_mlp,
    build_model,
    load_digits_split,
    make_loader,
    margins,
    train_digits_model,
    train_model,
)
from gradsketch.demos._sketch import format_sketch_table, run_sketch_demo
from gradsketch.demos._transformer import TransformerBlock, TransformerClassifier

__all__ = [
    # bundled digits data and models
    "DigitsSplit",
    "load_digits_split",
    "make_loader",
    "NUM_FEATURES",
    "NUM_CLASSES",
    "build_mlp",
    "build_cnn",
    "build_model",
    "ARCHITECTURES",
    "TransformerClassifier",
    "TransformerBlock",
    # deterministic training and evaluation
    "TrainSettings",
    "train_model",
    "train_digits_model",
    "accuracy",
    "margins",
    # `gradsketch demo`: TRAK on digits
    "DemoSettings",
    "run_demo",
    "train_checkpoints",
    "attribute_digits",
    "digits_lds_ground_truth",
    "write_gallery",
    "gallery_rows",
    "format_report",
    "to_numpy",
    "top_share_same_label",
    # `gradsketch sketch-demo`
    "run_sketch_demo",
    "format_sketch_table",
    # errors
    "DemoSettingsError",
    "DigitsSettingsError",
]
