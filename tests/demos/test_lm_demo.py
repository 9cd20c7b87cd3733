"""The language-model demo: corpus, training, report, a run end to end, its page in a browser."""

from __future__ import annotations

import html.parser
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from gradsketch.demos import lm
from gradsketch.demos._lm_corpus import (
    STDLIB_MODULES,
    CorpusError,
    chunk_bytes,
    load_corpus,
    split_chunks,
    stdlib_dir,
)
from gradsketch.demos._lm_report import query_views, render_report, shaded_tokens
from gradsketch.demos.lm import LMDemoSettings, LMDemoSettingsError, run_lm_demo

#: Architecture of the end-to-end test: the demo's own.
ARCH = LMDemoSettings().arch

#: A run small enough for the default suite (seconds on one thread).
TINY: dict[str, Any] = {
    "num_train": 48,
    "num_queries": 3,
    "epochs": 1,
    "batch_size": 16,
    "num_checkpoints": 1,
    "proj_dim": 32,
    "lds_models": 3,
    "report_queries": 3,
    "top_k": 2,
    "modules": ("bisect.py", "colorsys.py"),
}


# -- corpus -------------------------------------------------------------------------
def test_chunks_are_the_file_bytes_with_their_lines() -> None:
    """Each chunk is ``data[offset:offset+L]`` and ``line`` counts the newlines before it."""
    data = (stdlib_dir() / "bisect.py").read_bytes()
    chunks = chunk_bytes(data, "bisect.py", 64)
    assert len(chunks) == len(data) // 64
    for c in chunks:
        assert c.data == data[c.offset : c.offset + 64]
        assert c.line == data[: c.offset].count(b"\n") + 1
    corpus = load_corpus(["bisect.py"], chunk_len=64)
    ids = corpus.token_ids([0, 3])
    assert ids.dtype == torch.int64
    assert bytes(ids[1].tolist()) == chunks[3].data


def test_corpus_is_deterministic_and_records_hashes() -> None:
    a, b = load_corpus(chunk_len=64), load_corpus(chunk_len=64)
    assert a.chunks == b.chunks
    assert list(a.files) == list(STDLIB_MODULES)
    assert all(len(h) == 64 for h in a.files.values())
    assert {c.source for c in a.chunks} == set(STDLIB_MODULES)


def test_split_is_seeded_and_disjoint() -> None:
    train, query = split_chunks(100, 60, 10, seed=3)
    again = split_chunks(100, 60, 10, seed=3)
    assert np.array_equal(train, again[0]) and np.array_equal(query, again[1])
    assert len(set(train.tolist()) | set(query.tolist())) == 70
    assert not np.array_equal(split_chunks(100, 60, 10, seed=4)[1], query)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: load_corpus(["no_such_module.py"]), "not a file under"),
        (lambda: chunk_bytes(b"abc", "x", 1), "`chunk_len` must be an int >= 2"),
        (lambda: split_chunks(10, 8, 3, seed=0), "exceeds the 10 chunks"),
        (lambda: split_chunks(10, 0, 3, seed=0), "`num_train` must be a positive int"),
    ],
    ids=["missing-file", "chunk-len", "too-many", "zero-train"],
)
def test_corpus_errors(call: Any, match: str) -> None:
    with pytest.raises(CorpusError, match=match):
        call()


# -- settings -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"arch": "bert"}, "`arch` must be one of 'gpt2'"),
        ({"num_train": 1}, "`num_train` must be an integer >= 2"),
        ({"epochs": 1.5}, "`epochs` must be an integer"),
        ({"width": 65, "n_head": 2}, "not a multiple of `n_head`"),
        ({"lds_models": 2}, "`lds_models` must be 0"),
        ({"lr": 0.0}, "`lr` must be a finite number > 0"),
        ({"lambda_reg": -1.0}, "`lambda_reg` must be a finite number >= 0 or 'auto'"),
        ({"modules": ()}, "`modules` is empty"),
        ({"warmup_steps": -1}, "`warmup_steps` must be an integer >= 0"),
    ],
    ids=[
        "arch",
        "num-train",
        "epochs-float",
        "heads",
        "lds-models",
        "lr",
        "lambda",
        "modules",
        "warmup",
    ],
)
def test_settings_errors(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(LMDemoSettingsError, match=match):
        LMDemoSettings(**kwargs)


def test_unknown_override_is_refused(tmp_path: Path) -> None:
    with pytest.raises(LMDemoSettingsError, match=r"unknown settings \['epoch'\]"):
        run_lm_demo(tmp_path, epoch=3)


# -- training -------------------------------------------------------------------------
@pytest.mark.parametrize("arch", lm.ARCHITECTURES)
def test_training_is_seeded_and_lowers_the_loss(arch: str) -> None:
    torch.set_num_threads(1)
    s = LMDemoSettings(arch=arch, epochs=3, batch_size=8)
    ids = load_corpus(["bisect.py"]).token_ids(range(16))
    m1, losses = lm.train_lm(ids, s, seed=5)
    m2, _ = lm.train_lm(ids, s, seed=5)
    for (n1, p1), (n2, p2) in zip(m1.state_dict().items(), m2.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    assert losses[-1] < losses[0]


def test_fine_tune_starts_from_init_state_and_seeds_only_the_order() -> None:
    """``init_state`` replaces the initialisation: a run whose one step has rate 0 (a
    warmup longer than the run) returns those weights exactly; with steps, two seeds
    differ only through the batch order."""
    torch.set_num_threads(1)
    ids = load_corpus(["bisect.py"]).token_ids(range(16))
    base = lm.train_lm(ids, LMDemoSettings(epochs=1, batch_size=8), seed=9)[0].state_dict()
    frozen = LMDemoSettings(epochs=1, batch_size=16, warmup_steps=2)
    still, _ = lm.train_lm(ids, frozen, seed=3, init_state=base)
    for name, value in still.state_dict().items():
        assert torch.equal(value, base[name]), name
    assert not torch.equal(
        lm.build_lm(frozen, seed=3).state_dict()["lm_head.weight"], base["lm_head.weight"]
    )
    s = LMDemoSettings(epochs=1, batch_size=4, lr=1e-4)
    a = lm.train_lm(ids, s, seed=3, init_state=base)[0].state_dict()
    b = lm.train_lm(ids, s, seed=4, init_state=base)[0].state_dict()
    one_batch = LMDemoSettings(epochs=1, batch_size=16, lr=1e-4)
    c = lm.train_lm(ids, one_batch, seed=3, init_state=base)[0].state_dict()
    d = lm.train_lm(ids, one_batch, seed=4, init_state=base)[0].state_dict()
    # One batch of every row: the two seeds differ only in the order the float32
    # gradient is summed. AdamW's one step moves a weight by lr * g / (|g| + eps), a
    # value in [-lr, lr] (the decay is the same in both runs). Where g is further
    # from 0 than the summation's rounding, that step is the same to float32
    # rounding; where g is within rounding of 0 (a handful of the 16k embedding
    # weights of tokens barely used), the order may move it anywhere in [-lr, lr].
    # So every weight agrees within 2 * lr, and all but those few to float32 rounding.
    lr = one_batch.lr
    for name in base:
        diff = (c[name] - d[name]).abs()
        assert float(diff.max()) <= 2 * lr * (1 + 1e-5), name
        loose = ~torch.isclose(c[name], d[name], rtol=1e-5, atol=1e-6)
        assert int(loose.sum()) <= max(1, c[name].numel() // 10_000), name
    assert any(not torch.allclose(a[n], b[n], rtol=1e-5, atol=1e-6) for n in base)


@pytest.mark.parametrize("warmup", [0, 3, 40])
def test_schedule_is_transformers_linear_schedule_with_warmup(warmup: int) -> None:
    """``lr_multiplier`` equals transformers' schedule step for step (0: 1 - t/T exactly)."""
    from transformers import get_linear_schedule_with_warmup

    total = 12
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    sched = get_linear_schedule_with_warmup(opt, warmup, total)
    for step in range(total):
        want = sched.get_last_lr()[0]
        assert lm.lr_multiplier(step, total, warmup) == pytest.approx(want, rel=1e-15, abs=0)
        opt.step()
        sched.step()
    assert [lm.lr_multiplier(t, total) for t in range(total)] == [
        1.0 - t / total for t in range(total)
    ]


def test_log_likelihood_matches_a_float64_loop() -> None:
    """Summed ``log p(x_t | x_<t)`` equals a per-token loop over the float64 log-softmax."""
    model = lm.build_lm(LMDemoSettings(), seed=0).eval()
    ids = load_corpus(["bisect.py"]).token_ids(range(3))
    got = lm.sequence_log_likelihood(model, ids, batch_size=2)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.double()
    for b in range(3):
        ref = sum(float(torch.log_softmax(logits[b, t - 1], -1)[ids[b, t]]) for t in range(1, 64))
        assert got[b] == pytest.approx(ref, rel=1e-12, abs=1e-9)


# -- report ---------------------------------------------------------------------------
def test_tokens_are_escaped_and_shaded() -> None:
    text = shaded_tokens(b"<&\n\x01", np.array([1.0, -0.5, 0.0, 0.25], dtype=np.float32))
    assert "&lt;" in text and "&amp;" in text and "\\x01" in text
    assert "rgba(0,160,60,0.850)" in text  # the largest |score| is fully shaded
    assert "rgba(210,30,30,0.425)" in text  # half the largest, negative
    assert 'data-score="0.0" style="background:transparent"' in text


def test_query_views_pick_the_extremes() -> None:
    corpus = load_corpus(["bisect.py"])
    chunks = list(corpus.chunks[:6])
    scores = np.array([[0.1, 3.0], [0.5, -1.0], [-2.0, 0.0], [0.4, 2.0], [0.0, 0.0], [1.0, 1.0]])
    tokens = np.zeros((6, 2, 64), dtype=np.float32)
    tokens[5, 0, 10] = 7.0
    views = query_views(scores, tokens, chunks, chunks[:2], [-1.0, -2.0], top_k=2, queries=[0, 1])
    assert [r for r, _, _ in views[0].proponents] == [5, 1]
    assert [r for r, _, _ in views[0].opponents] == [2, 4]
    assert [r for r, _, _ in views[1].proponents] == [0, 3]
    assert views[0].shaded_by == 5 and views[0].token_scores[10] == 7.0
    page = render_report(views, title="t", facts={"a": 1})
    assert page.count('<section class="query"') == 2
    assert 'data-train-row="5" data-score="1.0"' in page


# -- the run end to end ---------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("lm_demo")
    summary = run_lm_demo(out, progress=False, arch=ARCH, **TINY)
    return out, summary


class _ReportParser(html.parser.HTMLParser):
    """Reads queries, their listed training rows and token scores back from the page."""

    def __init__(self) -> None:
        super().__init__()
        self.queries: list[dict[str, Any]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "section" and a.get("class") == "query":
            self.queries.append(
                {
                    "query": int(a["data-query"] or ""),
                    "shaded_by": int(a["data-shaded-by"] or ""),
                    "rows": [],
                    "tokens": [],
                }
            )
        elif tag == "tr" and "data-train-row" in a:
            self.queries[-1]["rows"].append(
                (a["class"], int(a["data-train-row"] or ""), float(a["data-score"] or ""))
            )
        elif tag == "span" and a.get("class") == "tok":
            self.queries[-1]["tokens"].append(float(a["data-score"] or ""))


def _check_page_numbers(page: str, out: Path) -> None:
    """Every number on the page equals the saved score arrays, at the extremes they claim."""
    scores = np.load(out / "scores.npy")
    tokens = np.load(out / "token_scores.npy")
    parser = _ReportParser()
    parser.feed(page)
    assert len(parser.queries) == TINY["report_queries"]
    for q in parser.queries:
        j, column = q["query"], scores[:, q["query"]]
        pro = [r for kind, r, _ in q["rows"] if kind == "proponent"]
        opp = [r for kind, r, _ in q["rows"] if kind == "opponent"]
        assert pro == np.argsort(-column, kind="stable")[: TINY["top_k"]].tolist()
        assert opp == np.argsort(column, kind="stable")[: TINY["top_k"]].tolist()
        for _, r, value in q["rows"]:
            assert np.float32(value) == scores[r, j]
        assert q["shaded_by"] == pro[0]
        np.testing.assert_array_equal(np.float32(q["tokens"]), tokens[pro[0], j])


def test_run_writes_consistent_outputs(tiny_run: tuple[Path, dict[str, Any]]) -> None:
    out, summary = tiny_run
    scores = np.load(out / "scores.npy")
    tokens = np.load(out / "token_scores.npy")
    assert scores.shape == (TINY["num_train"], TINY["num_queries"])
    assert tokens.shape == (*scores.shape, 64)
    # f = Σ_t f_t: per-token scores add up to the query's score (float32 sums).
    np.testing.assert_allclose(
        tokens.sum(-1), scores, rtol=1e-4, atol=1e-4 * float(np.abs(scores).max())
    )
    assert np.all(tokens[:, :, 0] == 0)  # the first token is never predicted
    saved = json.loads((out / "summary.json").read_text())
    assert saved["settings"]["arch"] == ARCH
    assert saved["settings"]["lds_models"] == 3
    assert saved["lds_protocol"]["measurement"] == "summed log-likelihood of the query chunk"
    assert saved["lds"] is None or -1.0 <= saved["lds"] <= 1.0
    low, high = saved["lds_protocol"]["ci95"]  # bootstrap interval over the 3 retrains
    assert -1.0 <= low <= high <= 1.0
    assert set(saved["corpus"]["files"]) == set(TINY["modules"])
    assert summary["lds"] == saved["lds"]
    truth = np.load(out / "lds_truth.npz")
    assert truth["masks"].shape == (3, TINY["num_train"])
    assert truth["outputs"].shape == (3, TINY["num_queries"])
    assert np.all(truth["masks"].sum(1) == TINY["num_train"] // 2)
    # The saved first checkpoint is the model whose log-likelihoods the summary holds.
    settings = {**saved["settings"], "modules": tuple(saved["settings"]["modules"])}
    model = lm.build_lm(LMDemoSettings(**settings), seed=123)
    model.load_state_dict(torch.load(out / "model_0.pt", weights_only=True))
    queries = load_corpus(settings["modules"]).token_ids(saved["corpus"]["query_chunks"])
    np.testing.assert_allclose(
        lm.sequence_log_likelihood(model.eval(), queries), saved["query_log_likelihood"], rtol=1e-6
    )
    chunks = json.loads((out / "chunks.json").read_text())
    assert len(chunks["train"]) == TINY["num_train"]
    _check_page_numbers((out / "report.html").read_text(encoding="utf-8"), out)


def test_report_is_self_contained(tiny_run: tuple[Path, dict[str, Any]]) -> None:
    page = (tiny_run[0] / "report.html").read_text(encoding="utf-8")
    for external in ("<script src", "<link", "http://", "https://", "<img"):
        assert external not in page


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(_chromium() is None, reason="no chromium on this machine")
def test_report_renders_in_a_browser(tiny_run: tuple[Path, dict[str, Any]]) -> None:
    """Headless Chromium loads the page, its DOM's numbers match ``scores``, it paints shading."""
    from PIL import Image

    out = tiny_run[0]
    url = (out / "report.html").resolve().as_uri()
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-background-networking",
    ]
    browser = _chromium()
    assert browser is not None
    dom = subprocess.run(
        [browser, *flags, "--dump-dom", url], capture_output=True, text=True, timeout=120
    )
    assert dom.returncode == 0, dom.stderr[-2000:]
    _check_page_numbers(dom.stdout, out)
    shot = out / "report.png"
    run = subprocess.run(
        [browser, *flags, f"--screenshot={shot}", "--window-size=1200,1600", url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0 and shot.exists(), run.stderr[-2000:]
    pixels = np.asarray(Image.open(shot).convert("RGB")).astype(int)
    r, g, b = pixels[..., 0], pixels[..., 1], pixels[..., 2]
    assert ((g - r > 40) & (g - b > 20)).sum() > 50, "no green (proponent) shading painted"
    assert (pixels.sum(-1) < 200).sum() > 1000, "no dark text painted"


def test_gradsketch_demo_lm_command_writes_the_report(tmp_path):
    """`gradsketch demo --lm` (what `make demo-lm` runs) reaches run_lm_demo."""
    from typer.testing import CliRunner

    from gradsketch.cli._app import app

    out = tmp_path / "lm"
    result = CliRunner().invoke(app, ["demo", "--lm", "--quick", "--no-verbose", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "LDS" in result.output and (out / "report.html").is_file()
    assert (out / "scores.npy").is_file() and (out / "summary.json").is_file()


def test_attribute_leaves_every_checkpoint_model_unchanged(tmp_path):
    """TRAKer loads each checkpoint into its model; ``attribute`` must not lend it models[0]."""
    s = LMDemoSettings(width=8, n_head=2, n_layer=1, chunk_len=8, proj_dim=8)
    models = [lm.build_lm(s, seed=seed).eval() for seed in (0, 1)]
    before = [{k: v.clone() for k, v in m.state_dict().items()} for m in models]
    ids = torch.randint(0, 200, (6, 8), generator=torch.Generator().manual_seed(0))
    lm.attribute(models, ids, ids[:2], s, tmp_path, per_token=False)
    for model, state in zip(models, before):
        assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
