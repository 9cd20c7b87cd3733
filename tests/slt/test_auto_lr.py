"""``lr="auto"`` in gradsketch.slt: the calibrated step, recorded, reused and shared."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _slt_helpers import count_calibrations, tiny_gpt2, token_data, trained_tiny_gpt2
from torch.utils.data import DataLoader, TensorDataset

import gradsketch.sampling
from gradsketch.slt import OutputPathMismatchError, SamplingCache, _schema, sample, susceptibilities
from gradsketch.slt._data import per_token_loss

# On the CPU, where the pilots by hand run (sample defaults to CUDA where there is one).
SETTINGS = dict(
    device="cpu", n_beta=10.0, localization=100.0, num_chains=1, num_draws=3, batch_size=16
)


def test_auto_records_the_calibrated_step(tmp_path: Path) -> None:
    ids = token_data(64)
    model = trained_tiny_gpt2(ids)
    tree = sample(model, ids, {"train": ids}, lr="auto", output_path=tmp_path / "s", **SETTINGS)
    stored = tree.attrs["metadata"]["config"]["sampler"]["lr"]
    # The same pilots by hand: same loader order, loss and seed (one process, same threads).
    loader = DataLoader(
        TensorDataset(ids),
        batch_size=16,
        shuffle=True,
        drop_last=True,
        generator=torch.Generator().manual_seed(100),
    )
    expected = gradsketch.sampling.calibrated_lr(
        trained_tiny_gpt2(ids).train(),
        loader,
        lambda m, b: per_token_loss(m, b[0]).mean(),
        nbeta=10.0,
        localization=100.0,
        seed=100,
    )
    assert stored == float(f"{expected:.2g}")
    assert 0 < stored < 1


def test_auto_store_is_reused_without_calibrating_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = token_data(64)
    model = trained_tiny_gpt2(ids)
    calls = count_calibrations(monkeypatch)
    first = sample(model, ids, {"train": ids}, lr="auto", output_path=tmp_path / "s", **SETTINGS)
    step = first.attrs["metadata"]["config"]["sampler"]["lr"]
    assert len(calls) == 1 and step == 2.3e-4
    again = sample(model, ids, {"train": ids}, lr="auto", output_path=tmp_path / "s", **SETTINGS)
    assert len(calls) == 1
    assert again.attrs["metadata"]["config"]["sampler"]["lr"] == step
    # A fixed step, even the same number, is another setting than "auto".
    with pytest.raises(OutputPathMismatchError, match="lr_auto"):
        sample(model, ids, {"train": ids}, lr=step, output_path=tmp_path / "s", **SETTINGS)


def test_susceptibilities_calibrate_once_for_every_restriction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gradsketch.slt import create_param_masks

    ids = token_data(64)
    model = trained_tiny_gpt2(ids)
    calls = count_calibrations(monkeypatch)
    susceptibilities(
        model,
        ids,
        {"train": ids, "probe": ids.flip(1)},
        {"full": None, "l0": create_param_masks(model, "l0")},
        sampling_task="train",
        lr="auto",
        output_path=tmp_path / "s.zarr",
        **SETTINGS,
    )
    assert len(calls) == 1
    steps = {
        _schema.open_tree(tmp_path / f"s_{name}.zarr").attrs["metadata"]["config"]["sampler"]["lr"]
        for name in ("full", "l0")
    }
    assert len(steps) == 1


def test_a_shared_cache_calibrates_once_and_a_fresh_call_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each call calibrates with a cache of its own; calls given one cache calibrate once,
    and a changed setting that decides the step (n_beta) calibrates again. The pilots are
    replaced by a counter (what is cached is under test, not the calibration)."""
    model, ids = tiny_gpt2(), token_data(64)
    calls: list[float] = []

    def pilots(*args: Any, nbeta: float, **kwargs: Any) -> float:
        calls.append(nbeta)
        return 1e-4 * len(calls)

    monkeypatch.setattr(gradsketch.sampling, "calibrated_lr", pilots)
    for name in ("a", "b"):
        sample(model, ids, {"train": ids}, lr="auto", output_path=tmp_path / name, **SETTINGS)
    assert len(calls) == 2
    cache = SamplingCache()
    for name in ("c", "d"):
        sample(
            model, ids, {"t": ids}, lr="auto", output_path=tmp_path / name, cache=cache, **SETTINGS
        )
    assert len(calls) == 3 and len(cache.auto_lrs) == 1
    hotter = {**SETTINGS, "n_beta": 20.0}
    sample(model, ids, {"t": ids}, lr="auto", output_path=tmp_path / "e", cache=cache, **hotter)
    assert calls == [10.0, 10.0, 10.0, 20.0] and len(cache.auto_lrs) == 2
    assert sorted(cache.auto_lrs.values()) == [3e-4, 4e-4]
    cache.clear()
    assert len(cache) == 0 and repr(cache) == "SamplingCache(0 initial losses, 0 lr='auto' steps)"


@pytest.mark.parametrize("bad", ["fast", "", "AUTO "])
def test_other_strings_are_refused(bad: str) -> None:
    ids = token_data(32)
    with pytest.raises(ValueError, match="`lr` must be a positive float or 'auto'"):
        sample(tiny_gpt2(), ids, {"train": ids}, lr=bad, **SETTINGS)
