"""TRAKer(method="replay"): the TRAK loop's calls give ReplayAttributor's metagradients."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from gradsketch._settings import SettingsMismatchError
from gradsketch.attribution import (
    ModelIDException,
    ReplayAttributor,
    ReplaySettings,
    ReplayTRAKer,
    TRAKer,
)
from helpers.attribution import replay_data, replay_mlp

N, M = 12, 3
SETTINGS = ReplaySettings(optimizer="adam", lr=0.05, num_steps=8, batch_size=4, seed=3)


def _traker(model: torch.nn.Module, path, **kw) -> TRAKer:
    return TRAKer(
        model,
        "image_classification",
        N,
        save_dir=path,
        method="replay",
        replay=kw.pop("replay", SETTINGS),
        progress=False,
        logging_level=logging.WARNING,
        **kw,
    )


def _trak_loop(traker: TRAKer, init: dict, exp: str = "q") -> np.ndarray:
    """The TRAK loop as trak's README writes it, batch by batch."""
    x, y = replay_data(N)
    traker.load_checkpoint(init, model_id=0)
    for j in range(0, N, 5):
        traker.featurize((x[j : j + 5], y[j : j + 5]), num_samples=min(5, N - j))
    traker.finalize_features()
    traker.start_scoring_checkpoint(exp, init, model_id=0, num_targets=M)
    traker.score((x[:M], y[:M]), num_samples=M)
    return traker.finalize_scores(exp)


def test_scores_equal_the_attributor_bit_for_bit(tmp_path):
    model = replay_mlp()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    traker = _traker(model, tmp_path / "t")
    assert isinstance(traker, ReplayTRAKer)
    scores = _trak_loop(traker, init)
    x, y = replay_data(N)
    ref = ReplayAttributor(replay_mlp(), "image_classification", (x, y), SETTINGS, progress=False)
    ref.train()
    expected = ref.score((x[:M], y[:M])).numpy()
    assert scores.shape == (N, M) and scores.dtype == np.float64
    np.testing.assert_array_equal(scores, expected)
    # The trained run is the attributor's, bit for bit.
    for name, p in ref.final.items():
        assert torch.equal(traker.attributor.final[name], p)


def test_a_given_attributor_is_used_and_rows_checked(tmp_path):
    x, y = replay_data(N)
    model = replay_mlp()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    replay = ReplayAttributor(model, "image_classification", (x, y), SETTINGS, progress=False)
    traker = _traker(model, tmp_path / "t", replay=replay)
    ref = ReplayAttributor(replay_mlp(), "image_classification", (x, y), SETTINGS, progress=False)
    ref.train()
    np.testing.assert_array_equal(_trak_loop(traker, init), ref.score((x[:M], y[:M])).numpy())
    other = _traker(model, tmp_path / "u", replay=replay)
    other.load_checkpoint(init, model_id=0)
    with pytest.raises(ValueError, match="differs from the ReplayAttributor's training rows"):
        other.featurize((x[:2] + 1, y[:2]), num_samples=2)


def test_resume_reads_stored_queries_and_other_settings_are_refused(tmp_path, monkeypatch):
    model = replay_mlp()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    first = _trak_loop(_traker(model, tmp_path / "t"), init)
    # A rerun computes nothing: every query is read back from the store.
    calls = []
    original = ReplayAttributor.metagradients
    monkeypatch.setattr(
        ReplayAttributor,
        "metagradients",
        lambda self, *a, **k: calls.append(1) or original(self, *a, **k),
    )
    again = _trak_loop(_traker(replay_mlp(), tmp_path / "t"), init)
    np.testing.assert_array_equal(again, first)
    assert calls == []
    # Other training settings on the same store: refused with both values shown.
    other = ReplaySettings(optimizer="adam", lr=0.01, num_steps=8, batch_size=4, seed=3)
    with pytest.raises(SettingsMismatchError, match="lr"):
        _traker(replay_mlp(), tmp_path / "t", replay=other)
    # Another initialization for the same model id: refused.
    traker = _traker(replay_mlp(), tmp_path / "t")
    changed = {k: v + 1 if v.is_floating_point() else v for k, v in init.items()}
    with pytest.raises(SettingsMismatchError, match="fingerprint"):
        traker.load_checkpoint(changed, model_id=0)
    with pytest.raises(ModelIDException, match="one training run"):
        traker.load_checkpoint(init, model_id=1)
    # An experiment's size is fixed once started.
    traker.load_checkpoint(init, model_id=0)
    with pytest.raises(SettingsMismatchError, match="num_targets"):
        traker.start_scoring_checkpoint("q", init, model_id=0, num_targets=M + 1)


def test_topk_orders_the_scores(tmp_path):
    model = replay_mlp()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    traker = _traker(model, tmp_path / "t")
    scores = _trak_loop(traker, init)
    top = traker.topk("q", k=3)
    order = np.argsort(-scores, axis=0, kind="stable")[:3]
    np.testing.assert_array_equal(top.proponents.numpy(), order)
    np.testing.assert_array_equal(
        top.proponent_scores.numpy(), np.take_along_axis(scores, order, 0).astype(np.float32)
    )
    low = np.argsort(scores, axis=0, kind="stable")[:3]
    np.testing.assert_array_equal(top.opponents.numpy(), low)


REFUSED = [
    pytest.param({"proj_dim": 64}, "`proj_dim`=64 does not apply", id="proj_dim"),
    pytest.param({"lambda_reg": 0.1}, "`lambda_reg`=0.1 does not apply", id="lambda_reg"),
    pytest.param({"grad_wrt": ["0.weight"]}, "`grad_wrt`=.* every parameter", id="grad_wrt"),
    pytest.param({"curvature": "output"}, "`curvature`='output'", id="curvature"),
    pytest.param({"dtype": torch.float32}, "`dtype`=torch.float32", id="dtype"),
    pytest.param({"replay": None}, "needs `replay`", id="no-replay"),
    pytest.param({"device": "meta"}, "`device`='meta'", id="device"),
]


@pytest.mark.parametrize(("kwargs", "match"), REFUSED)
def test_arguments_that_cannot_apply_are_refused(tmp_path, kwargs, match):
    error = TypeError if kwargs.get("replay", 1) is None else ValueError
    with pytest.raises(error, match=match):
        _traker(replay_mlp(), tmp_path / "t", **kwargs)


def test_replay_misuse_is_refused(tmp_path):
    model = replay_mlp()
    init = model.state_dict()
    with pytest.raises(ValueError, match="`replay` is the replayable run of method='replay'"):
        TRAKer(model, "image_classification", N, save_dir=tmp_path / "a", replay=SETTINGS)
    traker = _traker(model, tmp_path / "t")
    with pytest.raises(ModelIDException, match="load_checkpoint"):
        traker.featurize(replay_data(N), num_samples=N)
    traker.load_checkpoint(init, model_id=0)
    x, y = replay_data(N)
    traker.featurize((x[:5], y[:5]), num_samples=5)
    with pytest.raises(ModelIDException, match="7 of 12 rows missing"):
        traker.finalize_features()
    with pytest.raises(ValueError, match="`del_grads`=True does not apply"):
        traker.finalize_features(del_grads=True)
    with pytest.raises(ValueError, match="needs a task with per-token outputs"):
        traker.start_scoring_checkpoint("q", init, model_id=0, num_targets=1, per_token=True)
    with pytest.raises(ValueError, match="fits no preconditioner"):
        traker.preconditioner(0)


@pytest.mark.slow
def test_per_token_scores_of_a_language_model_equal_the_attributor(tmp_path):
    """GPT-2 (eager): per-token scores through the TRAK loop equal ReplayAttributor's bit
    for bit, and the whole-target scores are their sum over tokens."""
    transformers = pytest.importorskip("transformers")

    def gpt2() -> torch.nn.Module:
        config = transformers.GPT2Config(
            n_layer=1,
            n_head=2,
            n_embd=8,
            vocab_size=16,
            n_positions=6,
            bos_token_id=0,
            eos_token_id=0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        config._attn_implementation = "eager"
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(config).double().eval()

    ids = torch.randint(0, 16, (6, 6), generator=torch.Generator().manual_seed(2))
    settings = ReplaySettings(optimizer="adam", lr=0.01, num_steps=4, batch_size=3)
    model = gpt2()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    traker = TRAKer(
        model,
        "language_modeling",
        6,
        save_dir=tmp_path / "t",
        method="replay",
        replay=settings,
        progress=False,
    )
    traker.load_checkpoint(init, model_id=0)
    traker.featurize({"input_ids": ids}, num_samples=6)
    traker.finalize_features()
    traker.start_scoring_checkpoint("tok", init, model_id=0, num_targets=2, per_token=True)
    traker.score({"input_ids": ids[:2]}, num_samples=2)
    per_token = traker.finalize_scores("tok", per_token=True)
    ref = ReplayAttributor(
        gpt2(), "language_modeling", {"input_ids": ids}, settings, progress=False
    )
    ref.train()
    expected = ref.score({"input_ids": ids[:2]}, per_token=True).numpy()
    assert per_token.shape == (6, 2, 6)
    np.testing.assert_array_equal(per_token, expected)
    np.testing.assert_array_equal(traker.finalize_scores("tok"), expected.sum(-1))


def test_the_replay_is_a_traker_on_the_shared_layout(tmp_path):
    """method="replay" is TRAKer itself (no subclass), and its rows sit where every
    method's do: the checkpoint record, the experiment's target rows and the scores."""
    model = replay_mlp()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    traker = _traker(model, tmp_path / "t")
    assert type(traker) is TRAKer
    scores = _trak_loop(traker, init)
    assert traker.store.has("experiments/q/0/grads")
    assert traker.store.done_rows("experiments/q/0/done").all()
    np.testing.assert_array_equal(
        np.asarray(traker.store.array("experiments/q/0/grads")[:]).T, scores
    )
    np.testing.assert_array_equal(np.asarray(traker.store.array("scores/q")[:]), scores)
    assert traker.model_ids == [0]
    assert traker.settings.method == "replay" and traker.settings.replay == SETTINGS.record()


REFUSED_BY_THE_TABLE = [
    pytest.param(
        "replay",
        {"proj_dim": 64},
        r"`proj_dim`=64 does not apply to method='replay' \(.*projected\); leave it at its "
        r"default \(2048\)",
        id="replay-proj_dim",
    ),
    pytest.param(
        "replay",
        {"lambda_reg": 0.1},
        r"`lambda_reg`=0\.1 does not apply to method='replay' \(.*damp\); leave it at its "
        r"default \(None\)",
        id="replay-lambda_reg",
    ),
    pytest.param(
        "trak",
        {"curvature": "output"},
        r"`curvature`='output' needs a per-layer method .* method='trak' .*; pass "
        r"method='ekfac'",
        id="trak-curvature",
    ),
    pytest.param(
        "identity",
        {"score_computer": object},
        r"`score_computer`=.* method='identity' .*; pass score_computer=None",
        id="identity-score_computer",
    ),
    pytest.param(
        "kfac",
        {"use_half_precision": True},
        r"`use_half_precision`=True is not supported by method='kfac'.*; pass "
        r"use_half_precision=False",
        id="kfac-half",
    ),
]


@pytest.mark.parametrize(("method", "kwargs", "match"), REFUSED_BY_THE_TABLE)
def test_one_table_refuses_what_a_method_cannot_use(tmp_path, method, kwargs, match):
    """Every method's refusals come from one table: the message names the argument and its
    value, the method, why, and the fix."""
    args = {"replay": SETTINGS} if method == "replay" else {}
    with pytest.raises(ValueError, match=match):
        TRAKer(
            replay_mlp(),
            "image_classification",
            N,
            save_dir=tmp_path / "t",
            method=method,
            progress=False,
            logging_level=logging.WARNING,
            **args,
            **kwargs,
        )


def test_a_store_in_the_former_replay_layout_is_refused_with_version_and_fix(tmp_path):
    """A store written before the replay joined TRAKer's layout (its own settings record,
    `replay_run.json`, scores under `replay/<exp_name>`) is refused, naming the version
    that wrote it and how to read its scores, and is left as it is."""
    from gradsketch._settings import read_record, write_record
    from gradsketch._store import RowStore
    from gradsketch.attribution._traker_records import model_fingerprint

    old = tmp_path / "old"
    model = replay_mlp()
    RowStore(
        old,
        {
            "method": "replay",
            "train_set_size": N,
            "model": model_fingerprint(model),
            "task": "ImageClassificationModelOutput",
            "replay": SETTINGS.record(),
        },
    )
    write_record(old / "replay_run.json", {"model_id": 0, "checkpoint": "0" * 16})
    before = read_record(old / "settings.json")
    match = r"written by gradsketch \d+\.\d+\.\d+ in the replay's former layout.*Fix: pass another"
    with pytest.raises(SettingsMismatchError, match=match) as info:
        _traker(model, old)
    assert "finalize_scores(exp_name)" in str(info.value)
    assert read_record(old / "settings.json") == before
