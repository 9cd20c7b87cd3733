"""Which training digits made the model predict this? TRAK in 30 lines.

Run: python examples/attribution_quickstart.py   (about 15 s on 2 CPU cores)

The loop below is the `trak` package's API: a script written for `trak`
runs on gradsketch after changing the import.
"""

import logging
import tempfile

import numpy as np

from gradsketch.attribution import TRAKer
from gradsketch.demos import build_mlp, load_digits_split, train_digits_model

split = load_digits_split(seed=0)  # scikit-learn's bundled 8x8 digits, no download
x, y = split.x_train, split.y_train

# Three independently trained models; TRAK averages over them.
checkpoints = [train_digits_model(x, y, seed=s).state_dict() for s in range(3)]

traker = TRAKer(
    model=build_mlp(),
    task="image_classification",
    train_set_size=len(x),
    save_dir=tempfile.mkdtemp(),
    device="cpu",
    proj_dim=512,
    lambda_reg="auto",  # a small ridge term; lambda_reg=0.0 is traker's default
    logging_level=logging.WARNING,
)
for model_id, ckpt in enumerate(checkpoints):
    traker.load_checkpoint(ckpt, model_id=model_id)
    for i in range(0, len(x), 256):
        traker.featurize(batch=(x[i : i + 256], y[i : i + 256]), num_samples=len(x[i : i + 256]))
traker.finalize_features()

targets = (split.x_test[:10], split.y_test[:10])
for model_id, ckpt in enumerate(checkpoints):
    traker.start_scoring_checkpoint("quickstart", ckpt, model_id=model_id, num_targets=10)
    traker.score(batch=targets, num_samples=10)
scores = np.asarray(traker.finalize_scores("quickstart"))  # [n_train, 10]

for t in range(5):
    top = np.argsort(-scores[:, t])[:5]
    labels = ", ".join(str(int(y[i])) for i in top)
    print(f"test digit {int(targets[1][t])}: top-5 proponents are training digits {labels}")
