"""Config for `gradsketch attribute examples/attribute_config.py --out attribute_out`.

A config is plain Python: it defines the model, its checkpoints, the loaders
and the task (see `gradsketch.cli.attribute_command` for every name). This one
trains two small digits MLPs on the spot (about a second each) so it runs
anywhere; in your own config, point `checkpoints` at saved state dicts:

    checkpoints = ["runs/seed0/model.pt", "runs/seed1/model.pt"]
"""

from gradsketch.demos import (
    build_mlp,
    load_digits_split,
    make_loader,
    train_digits_model,
)

_split = load_digits_split(seed=0)
_x, _y = _split.x_train[:600], _split.y_train[:600]

# The architecture the checkpoints belong to.
model = build_mlp(seed=0)

# Independently trained models; TRAK averages its scores over them.
checkpoints = [train_digits_model(_x, _y, seed=seed).state_dict() for seed in (0, 1)]

# Row order matters: scores[i, j] refers to the i-th training row and the
# j-th target row as these loaders yield them, so they must not shuffle.
train_loader = make_loader(_x, _y, batch_size=200)
target_loader = make_loader(_split.x_test[:50], _split.y_test[:50], batch_size=50)

task = "image_classification"
proj_dim = 256  # below the 600 training rows, so lambda_reg = 0 is well posed
lambda_reg = 0.0
# gradients = "hooks"  # per-example gradients from one hooked forward and backward
# method = "ekfac"  # or "trak" (default), "identity", "kfac"
# Or replay a training run (MAGIC): drop checkpoints, proj_dim and lambda_reg, set
# method = "replay"
# replay = dict(optimizer="sgd", lr=0.05, momentum=0.9, num_steps=100, batch_size=64, seed=0)
