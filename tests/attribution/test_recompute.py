"""``TRAKer(rows="recompute")``: exact scores without storing the training rows.

Every test compares recompute mode with stored mode on the same problem, in
float64 where the method takes it. Tolerances:

* Per-layer methods (identity, K-FAC, EK-FAC) store float64 rows; both modes
  compute every feature with the same float64 kernels and the scores are
  the same float64 sums, in the same order for each score entry, rounded
  once to the float32 result. Two float64 values a few ulps apart round to
  the same float32 or to neighbours, so ``|a - b| <= 2^-23 |a|`` (``RTOL_F32``)
  bounds the difference; where the float64 sums are ordered differently
  (EK-FAC's correction: one GEMM over rank-one rows in stored mode, a
  rotation of the dense rows here) their float64 difference, ~1e-13 of the
  scale, adds nothing visible at float32's 1e-7.
* TRAK stores float32 features. Both modes read the same float32-rounded
  rows, but stored mode sums XᵀX in float32 tiles while recompute mode sums
  it in float64 from each batch: the two XᵀX differ by at most
  ``γ_n |X|ᵀ|X|`` with ``γ_n = n u / (1 - n u)``, ``u = 2^-24`` (Higham,
  §3.5). Through the inverse that is a relative change of the scores of at
  most ``κ(XᵀX) γ_n`` (first order), with ``κ < 250`` on this problem (n = 24
  rows of k = 8 tanh-MLP features, checked below) and ``n = 24``:
  ``250 * 24 * 2^-24 ≈ 3.6e-4``, plus the float32 rounding of the GEMMs
  (``k u`` of the scale). ``RTOL_TRAK = 5e-4`` of the largest score.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gradsketch.attribution import ModelIDException, TRAKer, _plan
from gradsketch.attribution import _layout as layout
from gradsketch.attribution import _traker_recompute as recompute_module
from gradsketch.errors import MemoryBudgetError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers.hf_families import tiny_gpt2
from helpers.launch import one_thread, torchrun

N, M, D_IN, HIDDEN, CLASSES, BATCH = 24, 3, 4, 5, 3, 5
RTOL_F32 = 2.0**-23
RTOL_TRAK = 5e-4
LOGGER = "gradsketch.attribution.TRAKer"
METHODS = ["identity", "kfac", "ekfac", "trak"]
#: Features per row: the MLP's per-layer ``vec(G)`` widths, or TRAK's ``proj_dim``.
WIDTH = {"layers": (D_IN + 1) * HIDDEN + (HIDDEN + 1) * CLASSES, "trak": 8}
#: Arrays that hold one row per training document (stored mode's rows).
ROW_ARRAYS = ("grads", "rank_one", "token_factors", "fisher_grads", "features")


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, CLASSES))
    return net.double()


def _data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N + M, D_IN, generator=g, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (N + M,), generator=g)
    return x[:N], y[:N], x[N:], y[N:]


def _loader(kind: str, x: torch.Tensor, y: torch.Tensor):
    if kind == "dataloader":
        return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)
    return [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, N, BATCH)]


def _traker(path: Path, method: str, rows: str, **kwargs) -> TRAKer:
    extra = {} if method == "trak" else {"dtype": torch.float64}
    return TRAKer(
        _model(),
        "image_classification",
        N,
        save_dir=path,
        device="cpu",
        proj_dim=8,
        progress=False,
        method=method,
        rows=rows,
        chunk_rows=4,
        **{"logging_level": logging.WARNING, **extra, **kwargs},
    )


def _featurized(path: Path, method: str, rows: str, *, loader: str = "list", **kwargs):
    """Two checkpoints featurized, finalized, and the targets of experiment ``q`` scored."""
    x, y, xq, yq = _data()
    traker = _traker(path, method, rows, **kwargs)
    states = [_model(seed).state_dict() for seed in (0, 1)]
    for model_id, state in enumerate(states):
        traker.load_checkpoint(state, model_id=model_id)
        traker.featurize_loader(_loader(loader, x, y))
    traker.finalize_features()
    for model_id, state in enumerate(states):
        traker.start_scoring_checkpoint("q", state, model_id=model_id, num_targets=M)
        traker.score_loader([(xq, yq)])
    return traker


def _budget(method: str, rows_per_block: int) -> int:
    """A ``memory_budget`` giving scoring blocks of ``rows_per_block`` training rows.

    Recompute mode holds two checkpoints' ``[M, k]`` right-hand sides and, per
    training row, ``2 k + M`` numbers (rows, weighted rows, scores) in its work
    dtype (float64 for float64 stores, float32 for TRAK).
    """
    k = WIDTH["trak" if method == "trak" else "layers"]
    item = 4 if method == "trak" else 8
    return 2 * M * k * item + rows_per_block * item * (2 * k + M)


def _assert_equal_scores(method: str, stored: np.ndarray, recomputed: np.ndarray) -> None:
    stored, recomputed = np.asarray(stored), np.asarray(recomputed)
    assert stored.shape == recomputed.shape
    scale = float(np.abs(stored).max())
    assert scale > 0
    if method == "trak":
        np.testing.assert_allclose(recomputed, stored, rtol=0, atol=RTOL_TRAK * scale)
    else:
        np.testing.assert_allclose(recomputed, stored, rtol=RTOL_F32, atol=RTOL_F32 * scale)


@pytest.mark.parametrize("method", METHODS)
def test_recomputed_scores_equal_stored_scores(tmp_path, method):
    stored = _featurized(tmp_path / "stored", method, "stored")
    recomputed = _featurized(tmp_path / "recompute", method, "recompute")
    _assert_equal_scores(method, stored.finalize_scores("q"), recomputed.finalize_scores("q"))
    if method == "trak":  # the conditioning the tolerance assumed
        xtx = stored.preconditioner(0).xtx.double()
        assert float(torch.linalg.cond(xtx)) < 250
    # The rows themselves, read through the same accessor.
    rows = np.asarray(recomputed.stored_features(1)[0:N])
    np.testing.assert_allclose(rows, np.asarray(stored.stored_features(1)[0:N]), rtol=1e-6)


def test_sampled_fisher_rows_are_recomputed_under_their_drawn_labels(tmp_path):
    """EK-FAC with ``curvature="sampled"``: the correction reads the rows under labels drawn
    per training row (seeded by the row), recomputed with the rows' global indices."""
    stored = _featurized(tmp_path / "stored", "ekfac", "stored", curvature="sampled")
    recomputed = _featurized(tmp_path / "recompute", "ekfac", "recompute", curvature="sampled")
    _assert_equal_scores("ekfac", stored.finalize_scores("q"), recomputed.finalize_scores("q"))


def test_map_style_loader_reads_each_block_by_its_rows(tmp_path):
    """A DataLoader is read at the rows asked for (shard_loader), not from the start."""
    stored = _featurized(tmp_path / "stored", "ekfac", "stored")
    recomputed = _featurized(tmp_path / "recompute", "ekfac", "recompute", loader="dataloader")
    _assert_equal_scores("ekfac", stored.finalize_scores("q"), recomputed.finalize_scores("q"))


@pytest.mark.parametrize("method", ["ekfac", "trak"])
def test_store_holds_no_training_rows(tmp_path, method):
    traker = _featurized(tmp_path / "r", method, "recompute")
    traker.finalize_scores("q")
    for model_id in (0, 1):
        for name in ROW_ARRAYS:
            assert not traker.store.has(layout.checkpoint_array(model_id, name)), name
        # Q and the done flags: 9 bytes per document; the rest is the curvature.
        q = traker.store.array(layout.checkpoint_array(model_id, "out_to_loss"))
        assert q.shape == (N, 1)
    assert traker.settings.record()["rows"] == "recompute"
    # Disk grows with the factors: the finalized state's size does not depend on n.
    state = traker.records.checkpoint(0)["state"]
    sizes = {k: traker.store.array(layout.checkpoint_state(0, k)).nbytes for k in state}
    k = traker.proj_dim
    if method == "trak":
        assert sizes == {"xtx": 4 * k * k}
    else:
        widths = [(x.k_in, x.k_out) for x in traker.layers]
        assert sum(sizes.values()) == sum(8 * (a * a + g * g + a * g) for a, g in widths)


def test_resume_after_a_kill_mid_scoring_equals_an_uninterrupted_run(tmp_path, monkeypatch, caplog):
    budget = _budget("ekfac", 4)  # four training rows per block: six blocks
    whole = _featurized(tmp_path / "whole", "ekfac", "recompute", memory_budget=budget)
    expected = np.asarray(whole.finalize_scores("q"))
    traker = _featurized(tmp_path / "killed", "ekfac", "recompute", memory_budget=budget)
    real = recompute_module.Recompute._score_block
    calls = []

    def dies_after_one(self, *args):
        if calls:
            raise KeyboardInterrupt("killed")
        calls.append(args[3])
        return real(self, *args)

    monkeypatch.setattr(recompute_module.Recompute, "_score_block", dies_after_one)
    with pytest.raises(KeyboardInterrupt):
        traker.finalize_scores("q")
    monkeypatch.setattr(recompute_module.Recompute, "_score_block", real)
    done = traker.store.done_rows(layout.scores_done("q"))
    assert done.sum() == 4 and done[:4].all()  # the first block was written and flagged
    scored = []

    def counted(self, *args):
        scored.append(args[3])
        return real(self, *args)

    monkeypatch.setattr(recompute_module.Recompute, "_score_block", counted)
    traker.logger.setLevel(logging.INFO)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        resumed = np.asarray(traker.finalize_scores("q"))
    assert scored == [4, 8, 12, 16, 20]  # the first missing block onwards
    assert any("resuming, 5 of 6 training blocks left" in r.getMessage() for r in caplog.records)
    np.testing.assert_array_equal(resumed, expected)
    # Finished: a third call scores nothing and reads the stored scores.
    scored.clear()
    np.testing.assert_array_equal(np.asarray(traker.finalize_scores("q")), expected)
    assert scored == []


def test_featurizing_resumes_in_a_new_process_without_adding_rows_twice(tmp_path):
    """A run stopped after two batches (its statistics saved with the rows they cover)
    and a second TRAKer featurizing every batch give the uninterrupted run's scores."""
    x, y, xq, yq = _data()
    state = _model().state_dict()
    first = _traker(tmp_path / "r", "kfac", "recompute")
    first.load_checkpoint(state, model_id=0)
    first.featurize_loader(_loader("list", x, y)[:2])
    assert int(first._method.done.sum()) == 2 * BATCH
    first._method.pause()  # what exiting does: the statistics are saved, the lock freed
    traker = _traker(tmp_path / "r", "kfac", "recompute")
    traker.load_checkpoint(state, model_id=0)
    traker.featurize_loader(_loader("list", x, y))
    traker.finalize_features()
    traker.start_scoring_checkpoint("q", state, model_id=0, num_targets=M)
    traker.score_loader([(xq, yq)])
    resumed = traker.finalize_scores("q")
    whole = _featurized(tmp_path / "whole", "kfac", "recompute")
    _assert_equal_scores("kfac", whole.finalize_scores("q", model_ids=[0]), resumed)


def test_targets_beyond_the_memory_budget_are_refused(tmp_path):
    traker = _featurized(tmp_path / "r", "kfac", "recompute", memory_budget=_budget("kfac", 0))
    with pytest.raises(MemoryBudgetError, match=r"holds every target's preconditioned features"):
        traker.finalize_scores("q")


def test_new_targets_score_every_block_again(tmp_path):
    traker = _featurized(tmp_path / "r", "kfac", "recompute")
    first = np.asarray(traker.finalize_scores("q"))
    only_first = np.asarray(traker.finalize_scores("q", model_ids=[0]))
    assert not np.allclose(first, only_first)  # another ensemble: not the finished blocks
    stored = _featurized(tmp_path / "s", "kfac", "stored")
    _assert_equal_scores("kfac", stored.finalize_scores("q", model_ids=[0]), only_first)


@pytest.mark.parametrize("method", ["kfac", "trak"])
def test_topk_equals_stored_topk(tmp_path, method):
    stored = _featurized(tmp_path / "stored", method, "stored").topk("q", k=5)
    recomputed = _featurized(tmp_path / "recompute", method, "recompute").topk("q", k=5)
    torch.testing.assert_close(recomputed.proponents, stored.proponents)
    torch.testing.assert_close(recomputed.opponents, stored.opponents)
    atol = (RTOL_TRAK if method == "trak" else RTOL_F32) * float(
        stored.proponent_scores.abs().max()
    )
    torch.testing.assert_close(
        recomputed.proponent_scores, stored.proponent_scores, rtol=0, atol=atol
    )


# -- a tiny causal language model: per-token scores --------------------------------------
T, VOCAB, N_LM, M_LM = 5, 11, 8, 2


def _gpt2() -> nn.Module:
    pytest.importorskip("transformers")
    return tiny_gpt2(VOCAB, T)


@pytest.mark.parametrize("method", ["ekfac", "identity"])
def test_language_model_scores_and_per_token_scores_equal_stored(tmp_path, method):
    ids = torch.randint(0, VOCAB, (N_LM + M_LM, T), generator=torch.Generator().manual_seed(1))
    results = {}
    for rows in ("stored", "recompute"):
        model = _gpt2()
        traker = TRAKer(
            model,
            "language_modeling",
            N_LM,
            save_dir=tmp_path / rows,
            device="cpu",
            method=method,
            rows=rows,
            dtype=torch.float64,
            progress=False,
            logging_level=logging.WARNING,
        )
        state = model.state_dict()
        traker.load_checkpoint(state, model_id=0)
        traker.featurize_loader(
            [{"input_ids": ids[i : min(i + 3, N_LM)]} for i in range(0, N_LM, 3)]
        )
        traker.finalize_features()
        traker.start_scoring_checkpoint("q", state, model_id=0, num_targets=M_LM, per_token=True)
        traker.score_loader([{"input_ids": ids[N_LM:]}])
        results[rows] = (traker.finalize_scores("q"), traker.finalize_scores("q", per_token=True))
    (stored, stored_tokens), (recomputed, recomputed_tokens) = (
        results["stored"],
        results["recompute"],
    )
    _assert_equal_scores(method, stored, recomputed)
    assert recomputed_tokens.shape == (N_LM, M_LM, T)
    _assert_equal_scores(method, stored_tokens, recomputed_tokens)


# -- rows="auto" ---------------------------------------------------------------------------
def test_auto_stores_rows_that_fit_the_disk(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger=LOGGER):
        traker = _traker(tmp_path / "a", "ekfac", "auto", logging_level=logging.INFO)
    assert traker.rows == "stored"
    assert "rows" not in traker.settings.record()  # stores made before the option match
    assert any("rows='auto': 'stored'" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("how", ["environment", "monkeypatch"])
def test_auto_recomputes_rows_that_do_not_fit_the_disk(tmp_path, caplog, monkeypatch, how):
    if how == "environment":
        monkeypatch.setenv("GRADSKETCH_AVAILABLE_DISK", "100")
    else:
        monkeypatch.setattr(_plan, "free_disk", lambda path: 100)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        traker = _traker(tmp_path / "a", "kfac", "auto", logging_level=logging.INFO)
    assert traker.rows == "recompute"
    messages = [r.getMessage() for r in caplog.records]
    assert any(
        m.startswith("rows='auto': 'recompute'") and "on disk but 0.1 kB is free" in m
        for m in messages
    )
    # A store keeps its mode: reopened with "auto" where the disk is free again.
    monkeypatch.delenv("GRADSKETCH_AVAILABLE_DISK", raising=False)
    monkeypatch.setattr(_plan, "free_disk", lambda path: 10**15)
    assert _traker(tmp_path / "a", "kfac", "auto").rows == "recompute"


def test_reopening_a_store_in_the_other_mode_is_refused(tmp_path):
    from gradsketch.errors import SettingsMismatchError

    _traker(tmp_path / "s", "kfac", "recompute")
    with pytest.raises(SettingsMismatchError, match="rows"):
        _traker(tmp_path / "s", "kfac", "stored")


# -- errors ----------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["disk", None, 1])
def test_rows_must_be_a_known_mode(tmp_path, bad):
    with pytest.raises(
        ValueError, match=r"`rows` must be one of \['stored', 'recompute', 'auto'\]"
    ):
        _traker(tmp_path / "e", "kfac", bad)


def test_replay_refuses_rows(tmp_path):
    with pytest.raises(ValueError, match=r"`rows`='recompute' does not apply to method='replay'"):
        TRAKer(
            nn.Linear(2, 2), "image_classification", 4, tmp_path, method="replay", rows="recompute"
        )


def test_one_shot_iterator_is_refused(tmp_path):
    x, y, _, _ = _data()
    traker = _traker(tmp_path / "e", "kfac", "recompute")
    traker.load_checkpoint(_model().state_dict(), model_id=0)
    with pytest.raises(ValueError, match=r"one-shot iterator \(generator\).*list\(loader\)"):
        traker.featurize_loader(b for b in _loader("list", x, y))


def test_score_computer_and_del_grads_are_refused(tmp_path):
    from gradsketch.attribution import BasicScoreComputer

    with pytest.raises(ValueError, match="`score_computer` multiplies stored rows"):
        _traker(tmp_path / "a", "trak", "recompute", score_computer=BasicScoreComputer)
    traker = _traker(tmp_path / "b", "trak", "recompute")
    with pytest.raises(ValueError, match=r"`del_grads`=True deletes stored rows"):
        traker.finalize_features(del_grads=True)


def test_rows_featurized_without_a_loader_are_refused_at_scoring(tmp_path):
    x, y, _, _ = _data()
    traker = _traker(tmp_path / "e", "ekfac", "recompute")
    state = _model().state_dict()
    traker.load_checkpoint(state, model_id=0)
    traker.featurize((x, y), num_samples=N)
    with pytest.raises(ModelIDException, match=r"featurize_loader\(loader\)"):
        traker.finalize_features()  # EK-FAC's correction reads the rows again


def test_weights_changed_in_place_are_refused(tmp_path):
    x, y, xq, yq = _data()
    traker = _traker(tmp_path / "e", "kfac", "recompute")
    model = _model()
    live = model.state_dict()  # shares memory with the model
    traker.load_checkpoint(live, model_id=0)
    traker.featurize_loader(_loader("list", x, y))
    traker.finalize_features()
    traker.start_scoring_checkpoint("q", live, model_id=0, num_targets=M)
    traker.score_loader([(xq, yq)])
    traker.load_checkpoint(_model(1).state_dict(), model_id=1)  # model 0's weights unloaded
    with torch.no_grad():
        model[0].weight.add_(1.0)
    with pytest.raises(ModelIDException, match=r"weights kept for model id 0 changed.*clone"):
        traker.finalize_scores("q", model_ids=[0])


# -- torch.distributed ------------------------------------------------------------------------
_WORKER = """
import sys, numpy as np, torch
sys.path.insert(0, sys.argv[2])
import torch.distributed as dist
from test_recompute import _featurized
import gradsketch.attribution._traker_recompute as R
real, starts = R.Recompute._score_block, []
def counted(self, *args):
    starts.append(args[3])
    return real(self, *args)
R.Recompute._score_block = counted
dist.init_process_group("gloo")
torch.set_num_threads(1)
from pathlib import Path
traker = _featurized(
    Path(sys.argv[1]) / "store", sys.argv[3], "recompute", memory_budget=int(sys.argv[4])
)
scores = np.asarray(traker.finalize_scores("q"))
np.save(Path(sys.argv[1]) / f"rank{dist.get_rank()}.npy", scores)
np.save(Path(sys.argv[1]) / f"starts{dist.get_rank()}.npy", np.array(starts))
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ekfac", "trak"])
def test_ranks_split_the_training_blocks_and_equal_one_process(tmp_path, method):
    """Two gloo ranks each recompute their chunk shard of the blocks; rows write disjoint chunks.

    Each score row is computed by one rank exactly as one process computes it
    (the same rows, batches and right-hand sides; EK-FAC's correction and TRAK's
    XᵀX are summed over the ranks' halves, which changes float64 sums in the
    last bits), so the scores agree to the tolerances of the module docstring.
    """
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    budget = _budget(method, 4)  # six blocks of four rows: three per rank
    here = str(Path(__file__).parent)
    torchrun(script, str(tmp_path), here, method, str(budget), nproc=2, timeout=300)
    with one_thread():
        single = _featurized(tmp_path / "single", method, "recompute", memory_budget=budget)
        single = np.asarray(single.finalize_scores("q"))
    ranks = [np.load(tmp_path / f"rank{r}.npy") for r in range(2)]
    # Each rank scored its chunk shard of the blocks (EK-FAC's finalize pass reads rows
    # through the same blocks' loader, not through _score_block).
    assert np.load(tmp_path / "starts0.npy").tolist() == [0, 4, 8]
    assert np.load(tmp_path / "starts1.npy").tolist() == [12, 16, 20]
    np.testing.assert_array_equal(ranks[0], ranks[1])
    _assert_equal_scores(method, single, ranks[0])
