"""The TRAKer's plan (store bytes, peak memory, time), its refusal, the vocabulary default
and the per-layer "auto" damping's fraction."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from gradsketch.attribution import (  # noqa: E402
    AttributionPlan,
    TRAKer,
    _plan,
)
from gradsketch.attribution import _layout as layout  # noqa: E402
from gradsketch.attribution._kfac import (  # noqa: E402
    LAYER_AUTO_DAMPING_FRACTION,
    resolve_damping,
)
from gradsketch.attribution._preconditioners import (  # noqa: E402
    KFACPreconditioner,
    PreconditionerSpec,
)
from gradsketch.errors import MemoryBudgetError  # noqa: E402
from helpers.hf_families import tiny_gpt2  # noqa: E402

N, T, VOCAB = 8, 6, 13

#: The plan's store and curvature estimates against what is allocated: within this factor.
FACTOR = 1.5


def _gpt2(vocab: int = VOCAB, *, tie: bool = True) -> nn.Module:
    return tiny_gpt2(vocab, T, tie=tie, dtype=torch.float32)


def _traker(model: nn.Module, tmp_path, method: str, **kwargs) -> TRAKer:
    return TRAKer(
        model,
        "language_modeling",
        N,
        save_dir=tmp_path / method,
        device="cpu",
        method=method,
        progress=False,
        logging_level=logging.WARNING,
        **kwargs,
    )


def _ids(vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (N, T), generator=torch.Generator().manual_seed(1))


def _featurize(traker: TRAKer, model: nn.Module, ids: torch.Tensor) -> None:
    traker.load_checkpoint(model.state_dict(), model_id=0)
    traker.featurize_loader([{"input_ids": ids[:4]}, {"input_ids": ids[4:]}], batch_size=4)


def _stored_bytes(traker: TRAKer, names: list[str]) -> int:
    total = 0
    for name in names:
        path = layout.checkpoint_array(0, name)
        if traker.store.has(path):
            total += int(traker.store.array(path).nbytes)
    return total


@pytest.mark.parametrize("method", ["trak", "ekfac"])
def test_plan_estimates_match_what_is_stored_and_allocated(tmp_path, method):
    model = _gpt2()
    traker = _traker(model, tmp_path, method, proj_dim=64)
    before = traker.plan
    assert isinstance(before, AttributionPlan) and before.batch_rows is None
    assert before.store_bytes_per_row == 0 and before.parameter_bytes > 0
    _featurize(traker, model, _ids())
    plan = traker.plan
    assert (plan.batch_rows, plan.tokens, plan.rows_left) == (4, T, N)
    assert plan.seconds_per_row is not None and plan.seconds_per_row > 0
    assert plan.cpu_seconds_per_row is not None and plan.cpu_seconds_per_row > 0
    assert "CPU s" in str(plan)
    # The process's peak counts what was resident when planned (the interpreter, torch...).
    resident = _plan.resident_memory()
    assert resident / FACTOR <= plan.baseline_bytes <= resident * FACTOR
    for stage in ("featurize", "finalize"):
        assert plan.process_bytes(stage) == plan.baseline_bytes + plan.stage_bytes(stage)
    assert "resident at the featurize peak" in str(plan)
    assert plan.store_bytes == N * plan.store_bytes_per_row
    kept = "grads" if method == "trak" else "token_factors"
    stored = _stored_bytes(traker, [kept, "out_to_loss"])
    assert stored / FACTOR <= plan.store_bytes <= stored * FACTOR
    assert "attribution plan" in str(plan) and "per document" in str(plan)
    with pytest.raises(AttributeError):
        plan.method = "x"  # type: ignore[misc]  # read-only
    if method == "ekfac":
        traker.finalize_features()
        precond = traker.preconditioner(0)
        eig = [t for basis in precond.eigen for t in basis]
        # The statistics' sums (A, S; EK-FAC's squares) are as large as the bases and values.
        allocated = 2 * sum(t.numel() * t.element_size() for t in eig)
        assert allocated / FACTOR <= plan.curvature_bytes <= allocated * FACTOR


def test_plan_is_logged_before_featurizing(tmp_path, caplog):
    model = _gpt2()
    traker = _traker(model, tmp_path, "ekfac")
    traker.logger.setLevel(logging.INFO)
    with caplog.at_level(logging.INFO, logger="gradsketch.attribution.TRAKer"):
        _featurize(traker, model, _ids())
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("attribution plan") and "peak memory" in m for m in messages)
    assert any("s per document on the first batch" in m for m in messages)


def test_refuses_at_construction_when_memory_is_short(tmp_path, monkeypatch):
    monkeypatch.setattr(_plan, "available_memory", lambda: 1000)
    with pytest.raises(MemoryBudgetError, match=r"peak memory ~.* but 1\.0 kB is available") as e:
        _traker(_gpt2(), tmp_path, "ekfac")
    for fix in ("`projection=", "`grad_wrt`", "`memory_budget`", "fewer tokens"):
        assert fix in str(e.value)
    with pytest.raises(MemoryBudgetError, match=r"Fixes: a smaller `proj_dim`"):
        _traker(_gpt2(), tmp_path, "trak")
    # Refused before the store is made: rerunning with a fix into the same folder works.
    assert not (tmp_path / "ekfac").exists()


def test_trak_gram_is_refused_at_finalize_not_at_construction(tmp_path, monkeypatch, caplog):
    """trak builds the TRAKer and featurizes with a Gram that will not fit (its NoOpProjector
    on a ResNet); so does the drop-in, with a warning, and refuses at finalize_features."""
    model = _gpt2()
    free = 100 * 2**20  # the 64 MiB working blocks fit, beside them 2 x 8 x 2048² (67 MB) not
    monkeypatch.setattr(_plan, "available_memory", lambda: free)
    with caplog.at_level(logging.WARNING, logger="gradsketch.attribution.TRAKer"):
        traker = _traker(model, tmp_path, "trak", proj_dim=2048)
    assert traker.plan.curvature_at_finalize
    assert traker.plan.stage_bytes("featurize") < free < traker.plan.stage_bytes("finalize")
    assert any("finalize_features will be refused" in r.getMessage() for r in caplog.records)
    _featurize(traker, model, _ids())
    assert traker._method.done.all()
    with pytest.raises(MemoryBudgetError, match=r"finalize_features needs ~.* but .* available"):
        traker.finalize_features()
    with pytest.raises(ValueError, match=r"`stage` must be one of \['featurize', 'finalize'"):
        traker.plan.problems("scoring")


def test_refuses_before_the_first_batch_when_disk_is_short(tmp_path, monkeypatch):
    model = _gpt2()
    traker = _traker(model, tmp_path, "ekfac")
    traker.load_checkpoint(model.state_dict(), model_id=0)
    monkeypatch.setattr(_plan, "free_disk", lambda path: 10)
    with pytest.raises(MemoryBudgetError, match=r"the store needs ~.* on disk but 0\.0 kB is free"):
        traker.featurize({"input_ids": _ids()[:4]}, inds=range(4))
    assert not traker._method.done.any()  # nothing was computed


def test_resident_baseline_is_in_the_process_peak_not_in_the_fit():
    """The available memory already excludes what is resident: only the stages are checked."""
    plan = AttributionPlan(
        method="trak",
        train_set_size=10,
        parameter_bytes=1_000,
        working_bytes=1_000,
        baseline_bytes=10**12,
        available_memory=2_000,
    )
    assert plan.problems() == [] and plan.stage_bytes() == 2_000
    assert plan.process_bytes() == 10**12 + 2_000
    short = AttributionPlan(
        method="trak", train_set_size=10, working_bytes=2_001, available_memory=2_000
    )
    assert short.problems() and short.process_bytes() == 2_001  # no baseline: unknown


def test_first_batch_time_is_wall_and_cpu(caplog):
    """A sleeping first batch takes wall seconds, not CPU seconds (``process_time``)."""
    import time

    logger = logging.getLogger("test.plan.first_batch")
    first = _plan.FirstBatch(AttributionPlan(method="trak", train_set_size=4), 2, logger)
    time.sleep(0.2)
    with caplog.at_level(logging.INFO, logger=logger.name):
        plan = first.done()
    assert plan.seconds_per_row is not None and plan.seconds_per_row >= 0.1
    assert plan.cpu_seconds_per_row is not None
    assert 0 <= plan.cpu_seconds_per_row < plan.seconds_per_row / 2
    assert any("CPU s" in r.getMessage() for r in caplog.records)


def test_memory_override_by_environment(monkeypatch):
    monkeypatch.setenv("GRADSKETCH_AVAILABLE_MEMORY", "12345")
    assert _plan.available_memory() == 12345
    monkeypatch.delenv("GRADSKETCH_AVAILABLE_MEMORY")
    assert (_plan.available_memory() or 1) > 0


def test_large_vocabulary_head_left_out_and_construction_cheap(tmp_path):
    vocab = 20000
    model = _gpt2(vocab)
    traker = _traker(model, tmp_path, "ekfac")
    names = [x.name for x in traker.layers]
    assert "lm_head" not in names and len(names) == 4
    # Nothing is accumulated at construction; the plan's curvature is the blocks' only.
    assert traker._method.accumulated.precond is None
    assert traker.plan.curvature_bytes < 10**6
    _featurize(traker, model, _ids(vocab))
    traker.finalize_features()
    traker.start_scoring_checkpoint("q", model.state_dict(), model_id=0, num_targets=2)
    traker.score_loader([{"input_ids": _ids(vocab)[:2]}])
    assert np.isfinite(traker.finalize_scores("q")).all()


def test_grad_wrt_keeps_an_untied_vocabulary_head(tmp_path, monkeypatch):
    vocab = 20000
    model = _gpt2(vocab, tie=False)
    assert "lm_head" not in [x.name for x in _traker(model, tmp_path, "kfac").layers]
    traker = _traker(model, tmp_path / "b", "kfac", grad_wrt="lm_head.weight|transformer.h.*")
    assert "lm_head" in [x.name for x in traker.layers]
    # Planned, not allocated: 2 x 20000² float64 factors and bases (~6.4 GB) at construction.
    assert traker.plan.curvature_bytes > 6e9
    assert traker._method.accumulated.precond is None
    monkeypatch.setattr(_plan, "available_memory", lambda: 2 * 10**9)
    with pytest.raises(MemoryBudgetError, match=r"curvature 6\.4\d GB"):
        _traker(model, tmp_path / "c", "kfac", grad_wrt="lm_head.weight|transformer.h.*")


def test_kfac_factors_are_allocated_lazily():
    layer = _traker_layers()
    precond = KFACPreconditioner(
        PreconditionerSpec(feature_dim=1, damping="auto", device=torch.device("cpu"), layers=layer)
    )
    assert precond._factors is None
    assert precond.factors[0].a_sum.shape == (layer[0].k_in, layer[0].k_in)


def _traker_layers():
    from gradsketch.attribution._layer_capture import find_layers

    return find_layers(nn.Sequential(nn.Linear(3, 2)), None, None)


def test_damping_fraction_default_is_the_old_constant(tmp_path):
    lam = torch.tensor([1.0, 2.0, 6.0])
    assert LAYER_AUTO_DAMPING_FRACTION == 0.3
    assert resolve_damping("auto", lam) == pytest.approx(0.9)
    assert resolve_damping("auto", lam, fraction=0.1) == pytest.approx(0.3)
    model = _gpt2()
    ids = _ids()
    scores = {}
    for name, kwargs in {
        "default": {},
        "0.3": {"damping_fraction": 0.3},
        "0.1": {"damping_fraction": 0.1},
    }.items():
        traker = _traker(model, tmp_path / name, "ekfac", dtype=torch.float64, **kwargs)
        _featurize(traker, model, ids)
        traker.finalize_features()
        traker.start_scoring_checkpoint("q", model.state_dict(), model_id=0, num_targets=2)
        traker.score_loader([{"input_ids": ids[:2]}])
        scores[name] = np.asarray(traker.finalize_scores("q"))
        record = json.loads((traker.save_dir / layout.scores_record("q")).read_text())
        assert record.get("damping_fraction") == (0.1 if name == "0.1" else None)
    np.testing.assert_array_equal(scores["default"], scores["0.3"])
    assert not np.allclose(scores["default"], scores["0.1"])


@pytest.mark.parametrize("bad", [0, -0.1, float("nan"), float("inf"), "0.1", True, None])
def test_damping_fraction_refuses_bad_values(tmp_path, bad):
    with pytest.raises(ValueError, match=r"`damping_fraction` must be a finite number > 0"):
        _traker(_gpt2(), tmp_path, "ekfac", damping_fraction=bad)


def test_damping_fraction_refused_where_it_does_not_apply(tmp_path):
    with pytest.raises(ValueError, match=r"`damping_fraction`=0\.1 .*method='trak'"):
        _traker(_gpt2(), tmp_path / "a", "trak", damping_fraction=0.1)
    with pytest.raises(ValueError, match=r"`damping_fraction`=0\.1 .*identity"):
        _traker(_gpt2(), tmp_path / "b", "identity", damping_fraction=0.1)
    with pytest.raises(ValueError, match=r"but lambda_reg=0\.5; pass lambda_reg='auto'"):
        _traker(_gpt2(), tmp_path / "c", "ekfac", damping_fraction=0.1, lambda_reg=0.5)


def test_replay_plans_from_its_memory_estimate_and_refuses_what_does_not_fit(monkeypatch):
    from gradsketch.attribution import ReplayAttributor
    from helpers.attribution import REPLAY_BATCH, REPLAY_N, REPLAY_STEPS, replay_data, replay_mlp

    x, y = replay_data(REPLAY_N)
    r = ReplayAttributor(
        replay_mlp(),
        "image_classification",
        (x, y),
        num_steps=REPLAY_STEPS,
        batch_size=REPLAY_BATCH,
        progress=False,
    )
    r.train()
    state = torch.get_rng_state()
    plan = r.plan(2)
    assert torch.equal(state, torch.get_rng_state())  # measuring leaves the random state alone
    assert plan.method == "replay" and plan.working_bytes == r.memory_estimate(2).total
    assert "reverse pass over 2 queries" in str(plan)
    monkeypatch.setattr(_plan, "available_memory", lambda: 100)
    with pytest.raises(MemoryBudgetError, match=r"peak memory ~.* but 0\.1 kB is available.*"):
        r.metagradients((x[:2], y[:2]))


def test_disk_override_by_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("GRADSKETCH_AVAILABLE_DISK", "4321")
    assert _plan.free_disk(tmp_path) == 4321
    monkeypatch.delenv("GRADSKETCH_AVAILABLE_DISK")
    assert (_plan.free_disk(tmp_path) or 1) > 0


def test_recompute_plan_stores_q_only_and_fits_where_rows_do_not(tmp_path, monkeypatch):
    """rows="recompute" stores Q (float64) and a done flag per document: 9 bytes.

    The disk given (1 kB) holds those (N * 9 = 72 bytes) but not the rows
    (the stored plan refuses, as in the test above).
    """
    model = _gpt2()
    traker = _traker(model, tmp_path, "ekfac", rows="recompute")
    monkeypatch.setattr(_plan, "free_disk", lambda path: 1000)
    _featurize(traker, model, _ids())
    plan = traker.plan
    assert plan.store_bytes_per_row == 9 and plan.store_bytes == 9 * N
    assert any("rows='recompute'" in note for note in plan.notes)
    stored = _traker(model, tmp_path / "stored", "ekfac", rows="stored")
    stored.load_checkpoint(model.state_dict(), model_id=0)
    with pytest.raises(MemoryBudgetError, match="the store needs"):
        stored.featurize({"input_ids": _ids()[:4]}, inds=range(4))


def test_choose_rows_reads_the_mode_of_an_existing_store(tmp_path, caplog):
    model = _gpt2()
    _traker(model, tmp_path, "kfac", rows="recompute")
    logger = logging.getLogger("gradsketch.attribution.TRAKer")
    plan = _plan.AttributionPlan(method="kfac", train_set_size=N, free_disk=10**15)
    with caplog.at_level(logging.INFO, logger=logger.name):
        rows = _plan.choose_rows("auto", plan, 100, tmp_path / "kfac", logger)
    assert rows == "recompute"
    assert any("as the store at" in r.getMessage() for r in caplog.records)
    assert _plan.choose_rows("auto", plan, 100, tmp_path / "new", logger) == "stored"
    assert _plan.choose_rows("stored", plan, 10**20, tmp_path / "new", logger) == "stored"


def _activation_bytes(model: nn.Module, rows: int, tokens: int) -> int:
    """Every Linear / Conv1D's inputs and outputs and their gradients: ``2·4 R T Σ(d_in+d_out)``.

    Counted from the modules here (Conv1D's weight is ``[d_in, d_out]``, a
    Linear's ``[d_out, d_in]``; the bias column adds one input), not by the plan's code.
    """
    total = 0
    for module in model.modules():
        if isinstance(module, nn.Linear):
            d_out, d_in = module.weight.shape
        elif type(module).__name__ == "Conv1D":
            d_in, d_out = module.weight.shape
        else:
            continue
        total += d_in + d_out + (getattr(module, "bias", None) is not None)
    return 2 * 4 * rows * tokens * total


@pytest.mark.parametrize("queries", [2, 13])
def test_per_token_scoring_is_planned_as_its_expanded_rows(tmp_path, queries):
    """Per-token scoring of B targets of T tokens runs passes of R = T·max(1, B // T) rows.

    The pass's estimate is a derived count: the streamed projection's largest
    formed gradient (one 64 MiB chunk plus the largest parameter that is not
    a factored weight or an embedding, here a LayerNorm's or the position
    table's, times R), the R × k projected rows, the activations of every
    linear layer (:func:`_activation_bytes`) and the log-odds' one ``[R, T,
    V]`` float32 tensor. B = 2 < T gives R = T; B = 13 gives two targets a
    pass, R = 2 T.
    """
    model = _gpt2()
    ids = torch.randint(0, VOCAB, (queries, T), generator=torch.Generator().manual_seed(2))
    traker = _traker(model, tmp_path, "trak", proj_dim=64)
    _featurize(traker, model, _ids())
    traker.finalize_features()
    before = traker.plan
    assert before.scoring_rows is None and before.scoring_bytes == 0
    traker.start_scoring_checkpoint(
        "q", model.state_dict(), model_id=0, num_targets=queries, per_token=True
    )
    traker.score_loader([{"input_ids": ids}], batch_size=queries)
    plan = traker.plan
    rows = T * max(1, queries // T)
    assert plan.scoring_rows == rows
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    factored = {
        id(m.weight)
        for m in model.modules()
        if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"
    }
    largest = max(p.numel() for p in model.parameters() if id(p) not in embeddings | factored)
    held = min(4 * rows * traker.grad_dim, (64 << 20) + 4 * rows * largest)
    derived = held + 4 * rows * 64 + _activation_bytes(model, rows, T) + 4 * rows * T * VOCAB
    assert plan.scoring_bytes == derived
    assert plan.stage_bytes("score") == (
        plan.parameter_bytes + plan.projection_bytes + plan.working_bytes + derived
    )
    assert f"{rows} rows a pass" in str(plan)
    scores = traker.finalize_scores("q", per_token=True)
    assert scores.shape == (N, queries, T) and np.isfinite(scores).all()


def test_per_token_scoring_refused_before_its_rows_are_made(tmp_path, monkeypatch):
    """Memory that holds featurizing (4 rows) but not a per-token pass (T² positions)."""
    model = _gpt2()
    traker = _traker(model, tmp_path, "trak", proj_dim=64)
    _featurize(traker, model, _ids())
    traker.finalize_features()
    traker.start_scoring_checkpoint("q", model.state_dict(), model_id=0, num_targets=2)
    traker.score_loader([{"input_ids": _ids()[:2]}])  # not per token: not planned
    assert traker.plan.scoring_rows is None
    traker.start_scoring_checkpoint(
        "t", model.state_dict(), model_id=0, num_targets=2, per_token=True
    )
    featurize = traker.plan.stage_bytes("featurize")
    rows, _ = _plan.per_token_rows(traker.task, (_ids()[:2],))
    assert rows == T
    monkeypatch.setattr(_plan, "available_memory", lambda: featurize + 1)
    with pytest.raises(
        MemoryBudgetError, match=r"per-token scoring \(6 rows a pass\) needs ~.* available"
    ) as e:
        traker.score_loader([{"input_ids": _ids()[:2]}])
    assert "Fixes: score fewer tokens per target" in str(e.value)
    assert "per_token=False" in str(e.value)
    done = traker.store.array(layout.target_array("t", 0, "done"))
    assert not np.asarray(done[:]).any()  # refused before any row was computed
    # The scores [n, m, T] are refused before they are computed too.
    monkeypatch.setattr(_plan, "available_memory", lambda: None)
    traker.score({"input_ids": _ids()[:2]}, inds=range(2))  # the refused call used 0..1
    result = 4 * N * 2 * T  # float32 [n, m, T]
    monkeypatch.setattr(_plan, "available_memory", lambda: result)
    with pytest.raises(
        MemoryBudgetError, match=r"'t' \(\[n=8, m=2, T=6\] .* but 0\.00 GB is avail"
    ):
        traker.finalize_scores("t", per_token=True)
    monkeypatch.setattr(_plan, "available_memory", lambda: None)
    traker.memory_budget = result - 1
    with pytest.raises(MemoryBudgetError, match=r"`memory_budget`=383; score fewer targets"):
        traker.finalize_scores("t", per_token=True)
    traker.memory_budget = None
    assert traker.finalize_scores("t", per_token=True).shape == (N, 2, T)
