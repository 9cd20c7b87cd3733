"""Bundled digits data, two small models and a deterministic CPU trainer.

Everything the demo, the examples, the tests and the benchmark need to train
real models in seconds without downloading anything: scikit-learn's bundled
8x8 digits (1,797 images, 10 classes), standardised with the training split's
statistics, a 64-256-256-10 MLP (85,002 parameters) and a small CNN. Both
models take flat ``[batch, 64]`` inputs so one loader serves either.

Training is seeded end to end (initialisation, shuffling) and never touches
torch's global generator, so a given ``seed`` gives the same weights on every
run of the same build.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from gradsketch._checks import check_number, integer, positive_int
from gradsketch._threads import torch_threads
from gradsketch.demos._errors import DigitsSettingsError

#: Pixels per digit image (8 x 8) and number of classes.
NUM_FEATURES = 64
NUM_CLASSES = 10


def _allowed(names: Sequence[str]) -> str:
    return ", ".join(repr(n) for n in names)


@dataclass(frozen=True)
class DigitsSplit:
    """Standardised digits, split once into train and test.

    Attributes:
        x_train: ``[n_train, 64]`` float32 pixels, zero mean / unit variance
            per pixel over the training split (constant pixels stay 0).
        y_train: ``[n_train]`` int64 labels in ``0..9``.
        x_test: ``[n_test, 64]`` float32, standardised with the training
            statistics (no test information leaks into the scaling).
        y_test: ``[n_test]`` int64 labels.
        images_test: ``[n_test, 8, 8]`` raw test images (0..16) for plotting.
        images_train: ``[n_train, 8, 8]`` raw training images for plotting.
        seed: the seed of the split.
    """

    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor
    images_train: np.ndarray
    images_test: np.ndarray
    seed: int

    @property
    def n_train(self) -> int:
        """Number of training examples."""
        return int(self.x_train.shape[0])

    @property
    def n_test(self) -> int:
        """Number of test examples."""
        return int(self.x_test.shape[0])


def load_digits_split(*, test_fraction: float = 0.2, seed: int = 0) -> DigitsSplit:
    """Load scikit-learn's bundled digits and split them with a fixed seed.

    Args:
        test_fraction: share of the 1,797 images held out, in ``(0, 1)``.
        seed: seed of the permutation that splits train and test.

    Returns:
        A :class:`DigitsSplit`; with the defaults, 1,438 training and 359 test
        images.

    Raises:
        DigitsSettingsError: if ``test_fraction`` is outside ``(0, 1)``.

    Example:
        >>> split = load_digits_split(seed=0)
        >>> split.x_train.shape, split.x_test.shape
        (torch.Size([1438, 64]), torch.Size([359, 64]))
    """
    if not isinstance(test_fraction, float | int) or not 0.0 < float(test_fraction) < 1.0:
        raise DigitsSettingsError(
            f"`test_fraction` must be a number strictly between 0 and 1, got {test_fraction!r}; "
            "pass e.g. test_fraction=0.2."
        )
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = np.asarray(bunch.images, dtype=np.float32)
    labels = np.asarray(bunch.target, dtype=np.int64)
    n = images.shape[0]
    order = np.random.default_rng(seed).permutation(n)
    n_test = round(n * float(test_fraction))
    test_idx, train_idx = np.sort(order[:n_test]), np.sort(order[n_test:])
    # Statistics in float64: a few pixels have tiny spreads, and float32
    # rounding would be amplified by dividing by them.
    flat = images.reshape(n, NUM_FEATURES).astype(np.float64)
    mean = flat[train_idx].mean(axis=0)
    std = flat[train_idx].std(axis=0)
    # Border pixels are (almost) always 0: dividing by their ~0 spread would
    # blow up noise, so they are only centred.
    std = np.where(std < 1e-6, 1.0, std)
    scaled = ((flat - mean) / std).astype(np.float32)
    return DigitsSplit(
        x_train=torch.from_numpy(scaled[train_idx].copy()),
        y_train=torch.from_numpy(labels[train_idx].copy()),
        x_test=torch.from_numpy(scaled[test_idx].copy()),
        y_test=torch.from_numpy(labels[test_idx].copy()),
        images_train=images[train_idx],
        images_test=images[test_idx],
        seed=seed,
    )


def build_mlp(*, hidden: int = 256, seed: int = 0) -> nn.Sequential:
    """The digits MLP ``64 -> hidden -> hidden -> 10`` with ReLUs.

    With ``hidden=256`` it has 85,002 parameters, the size the TRAK
    featurization benchmark uses.

    Args:
        hidden: width of both hidden layers.
        seed: seed of the initialisation (torch's default Kaiming-uniform).

    Returns:
        An ``nn.Sequential`` taking ``[batch, 64]`` and returning ``[batch, 10]``
        logits.

    Example:
        >>> sum(p.numel() for p in build_mlp(seed=0).parameters())
        85002
    """
    _check_positive_int("hidden", hidden)
    with _seeded(seed):
        return nn.Sequential(
            nn.Linear(NUM_FEATURES, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, NUM_CLASSES),
        )


def build_cnn(*, channels: int = 16, seed: int = 0) -> nn.Sequential:
    """A small CNN for 8x8 digits: two 3x3 convolutions, 2x2 pooling, a linear head.

    Takes flat ``[batch, 64]`` inputs (reshaped to ``[batch, 1, 8, 8]`` by its
    first layer) so it shares loaders with :func:`build_mlp`.

    Args:
        channels: channels of the first convolution (the second has twice as many).
        seed: seed of the initialisation.

    Returns:
        An ``nn.Sequential`` mapping ``[batch, 64]`` to ``[batch, 10]`` logits.

    Example:
        >>> build_cnn(seed=0)(torch.zeros(2, 64)).shape
        torch.Size([2, 10])
    """
    _check_positive_int("channels", channels)
    with _seeded(seed):
        return nn.Sequential(
            nn.Unflatten(1, (1, 8, 8)),
            nn.Conv2d(1, channels, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(2 * channels * 4 * 4, NUM_CLASSES),
        )


#: Architectures by name; the error for an unknown name lists these keys.
ARCHITECTURES: dict[str, Callable[..., nn.Module]] = {"mlp": build_mlp, "cnn": build_cnn}


def build_model(arch: str = "mlp", *, seed: int = 0) -> nn.Module:
    """Build a digits model by name (see :data:`ARCHITECTURES`).

    Args:
        arch: ``"mlp"`` or ``"cnn"``.
        seed: initialisation seed.

    Returns:
        The freshly initialised model.

    Raises:
        DigitsSettingsError: for an unknown ``arch``.

    Example:
        >>> type(build_model("cnn", seed=1)).__name__
        'Sequential'
    """
    if arch not in ARCHITECTURES:
        raise DigitsSettingsError(
            f"`arch` must be one of {_allowed(sorted(ARCHITECTURES))}, got {arch!r}; "
            "register a builder in ARCHITECTURES or pick one of those."
        )
    return ARCHITECTURES[arch](seed=seed)


@dataclass(frozen=True)
class TrainSettings:
    """How a digits model is trained (SGD with momentum and weight decay).

    Attributes:
        epochs: passes over the training rows.
        batch_size: rows per step.
        lr: learning rate (cosine-annealed to 0 over the run).
        momentum: heavy-ball momentum in ``[0, 1)``.
        weight_decay: L2 penalty; a little keeps the margins of retrained
            models smooth functions of the training subset, which LDS needs.
    """

    epochs: int = 20
    batch_size: int = 64
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 5e-4

    def __post_init__(self) -> None:
        _check_positive_int("epochs", self.epochs)
        _check_positive_int("batch_size", self.batch_size)
        for name in ("lr", "weight_decay"):
            check_number(
                name,
                getattr(self, name),
                low=0,
                strict=name == "lr",
                fix=f"the default is {getattr(TrainSettings, name)!r}",
                error=DigitsSettingsError,
            )
        if not isinstance(self.momentum, float | int) or not 0.0 <= self.momentum < 1.0:
            raise DigitsSettingsError(
                f"`momentum` must be in [0, 1), got {self.momentum!r}; the default is "
                f"{TrainSettings.momentum!r}."
            )

    def to_dict(self) -> dict[str, float | int]:
        """Plain dict for JSON summaries."""
        return dataclasses.asdict(self)


def train_model(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    *,
    settings: TrainSettings | None = None,
    seed: int = 0,
) -> nn.Module:
    """Train ``model`` in place on ``(x, y)`` with cross-entropy, deterministically.

    Shuffling uses a private ``torch.Generator`` seeded with ``seed``; torch's
    global generator is left untouched. Runs on one intra-op thread, so the
    weights do not depend on the caller's ``torch.set_num_threads``.

    Args:
        model: a classifier mapping ``[batch, 64]`` to ``[batch, 10]``.
        x: ``[n, 64]`` float32 inputs.
        y: ``[n]`` int64 labels.
        settings: optimiser settings; defaults to :class:`TrainSettings()`.
        seed: shuffling seed.

    Returns:
        The trained model, in eval mode.

    Raises:
        DigitsSettingsError: if ``x`` and ``y`` disagree in length or are empty.

    Example:
        >>> split = load_digits_split()
        >>> model = train_model(build_mlp(seed=0), split.x_train, split.y_train, seed=0)
        >>> accuracy(model, split.x_test, split.y_test) > 0.9
        True
    """
    settings = TrainSettings() if settings is None else settings
    if x.shape[0] != y.shape[0] or x.shape[0] == 0:
        raise DigitsSettingsError(
            f"`x` and `y` must hold the same, non-zero number of rows, got x: {tuple(x.shape)} "
            f"and y: {tuple(y.shape)}; pass matching inputs and labels."
        )
    n = x.shape[0]
    generator = torch.Generator().manual_seed(seed)
    steps_per_epoch = math.ceil(n / settings.batch_size)
    total = settings.epochs * steps_per_epoch
    optimizer = torch.optim.SGD(
        model.parameters(),
        lr=settings.lr,
        momentum=settings.momentum,
        weight_decay=settings.weight_decay,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.5 * (1.0 + math.cos(math.pi * step / total))
    )
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    with _one_thread():
        for _ in range(settings.epochs):
            order = torch.randperm(n, generator=generator)
            for start in range(0, n, settings.batch_size):
                idx = order[start : start + settings.batch_size]
                optimizer.zero_grad(set_to_none=True)
                loss_fn(model(x[idx]), y[idx]).backward()
                optimizer.step()
                scheduler.step()
    return model.eval()


def replay_settings(n_train: int, settings: TrainSettings | None = None, *, seed: int = 0) -> Any:
    """:func:`train_model`'s loop as a :class:`~gradsketch.attribution.ReplaySettings`.

    Same optimizer (SGD, momentum, L2 weight decay), the cosine rate of each
    step, and the batch order: ``seed`` draws one ``randperm`` per epoch from
    a fresh ``torch.Generator``, as :func:`train_model` does. With a model
    from ``build_model(arch, seed=seed)`` the replay trains the model that
    ``train_digits_model(..., seed=seed)`` returns.

    Example:
        >>> s = replay_settings(1438, TrainSettings(epochs=2), seed=3)
        >>> (s.optimizer, s.num_steps, s.batch_size, s.seed, s.lr[0])
        ('sgd', 46, 64, 3, 0.05)
    """
    from gradsketch.attribution import ReplaySettings

    settings = TrainSettings() if settings is None else settings
    total = settings.epochs * math.ceil(n_train / settings.batch_size)
    lr = [settings.lr * 0.5 * (1.0 + math.cos(math.pi * t / total)) for t in range(total)]
    return ReplaySettings(
        optimizer="sgd",
        lr=lr,
        momentum=settings.momentum,
        weight_decay=settings.weight_decay,
        num_steps=total,
        batch_size=settings.batch_size,
        seed=seed,
    )


@contextmanager
def _one_thread() -> Iterator[None]:
    """Train on one intra-op thread, then restore the caller's setting.

    The matrices here are at most 256 x 256: thread synchronisation costs more
    than it saves (and on a shared machine it stalls), and a single thread
    makes the trained weights independent of the caller's thread count.
    """
    with torch_threads(1):
        yield


def train_digits_model(
    x: Tensor,
    y: Tensor,
    *,
    arch: str = "mlp",
    seed: int = 0,
    settings: TrainSettings | None = None,
) -> nn.Module:
    """Build a digits model with ``seed`` and train it with the same ``seed``.

    The function the demo's checkpoints and the LDS retraining both use.

    Args:
        x: ``[n, 64]`` inputs.
        y: ``[n]`` labels.
        arch: ``"mlp"`` or ``"cnn"``.
        seed: seeds both the initialisation and the shuffling.
        settings: optimiser settings.

    Returns:
        The trained model in eval mode.

    Example:
        >>> split = load_digits_split()
        >>> a = train_digits_model(split.x_train[:200], split.y_train[:200], seed=3)
        >>> b = train_digits_model(split.x_train[:200], split.y_train[:200], seed=3)
        >>> all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
        True
    """
    model = build_model(arch, seed=seed)
    return train_model(model, x, y, settings=settings, seed=seed)


@torch.no_grad()
def accuracy(model: nn.Module, x: Tensor, y: Tensor) -> float:
    """Share of rows whose arg-max logit equals the label.

    Example:
        >>> accuracy(nn.Identity(), torch.eye(4), torch.tensor([0, 1, 2, 0]))
        0.75
    """
    return float((model(x).argmax(dim=1) == y).float().mean())


@torch.no_grad()
def margins(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """TRAK's classification output: correct logit minus logsumexp of the others.

    ``f(z) = log(p / (1 - p))`` for the softmax probability ``p`` of the label.

    Args:
        model: classifier.
        x: ``[n, 64]`` inputs.
        y: ``[n]`` labels.

    Returns:
        ``[n]`` float32 margins.

    Example:
        >>> margins(nn.Linear(64, 10), torch.zeros(3, 64), torch.zeros(3, dtype=torch.long)).shape
        torch.Size([3])
    """
    logits = model(x)
    correct = logits.gather(1, y[:, None]).squeeze(1)
    others = logits.scatter(1, y[:, None], float("-inf"))
    return correct - torch.logsumexp(others, dim=1)


def make_loader(x: Tensor, y: Tensor, *, batch_size: int = 256) -> DataLoader:
    """A non-shuffling loader of ``(x, y)`` batches, in row order.

    TRAKer featurizes and scores rows in loader order, so attribution loaders
    must not shuffle.

    Example:
        >>> loader = make_loader(torch.zeros(5, 64), torch.zeros(5, dtype=torch.long), batch_size=2)
        >>> [len(b[0]) for b in loader]
        [2, 2, 1]
    """
    _check_positive_int("batch_size", batch_size)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


@contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Run a block under a fixed torch seed, then restore the global generator."""
    integer("seed", seed, error=DigitsSettingsError, type_error=DigitsSettingsError)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _check_positive_int(name: str, value: object) -> None:
    positive_int(name, value, fix=f"pass e.g. {name}=16", error=DigitsSettingsError)
