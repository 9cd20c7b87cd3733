"""`gradsketch attribute --model DIR --train DATA --queries DATA`, end to end on a tiny GPT-2.

The model and its byte-level BPE tokenizer are built in code and saved to a
temporary folder (no download). The command's top-k lists are compared with
a direct :class:`TRAKer` run on the same tokens, without the command's
padding of the queries. Scores there are float32 sums over ``k <= 64``
projected coordinates of gradients of a 16-token document: rounding of a
different padding shape moves them by a few float32 ulps of the largest
product, far below ``rtol=1e-4`` of the largest score; the indices agree
exactly as no two scores of a query tie at that precision (checked). The
report's per-token scores of a query sum to its score (``f = Σ_t f_t`` and
the scores are linear in the query's features); their float32 rows are
projected and preconditioned separately, so the sum is held to ``rtol=1e-3``.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")
from typer.testing import CliRunner  # noqa: E402

from gradsketch.attribution import TRAKer  # noqa: E402
from gradsketch.cli._app import app  # noqa: E402
from gradsketch.cli._attribute_hf import (  # noqa: E402
    HFAttributeSettings,
    _traker_projection,
    attribute_hf_command,
    load_documents,
    load_tokenizer,
    parse_lambda,
    parse_projection,
)
from gradsketch.errors import ConfigError, ConfigFileError, SettingsMismatchError  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
MAX_LENGTH = 16
PROJ_DIM = 64
#: Training documents: code and prose, so proponents have something to find.
TEXTS = [
    f"def f{i}(x):\n    return x + {i}\n" if i % 2 else f"the cat sat on the mat {i} times"
    for i in range(12)
]
QUERIES = ["def g(y):\n    return y", "the cat sat on a mat", "the dog ran"]


def _tokenizer(texts: list[str]) -> Any:
    from transformers import PreTrainedTokenizerFast

    models, pre, dec, trainers = (
        tokenizers.models,
        tokenizers.pre_tokenizers,
        tokenizers.decoders,
        tokenizers.trainers,
    )
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre.ByteLevel(add_prefix_space=False)
    tok.decoder = dec.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre.ByteLevel.alphabet(), special_tokens=["<eos>"]
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def _save(model: Any, tokenizer: Any, where: Path) -> Path:
    model.save_pretrained(where)
    tokenizer.save_pretrained(where)
    return where


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A saved 1-layer GPT-2 with its tokenizer, and the data in each of the four forms."""
    from transformers import GPT2Config, GPT2LMHeadModel

    root = tmp_path_factory.mktemp("hf_cli")
    tok = _tokenizer(TEXTS + QUERIES)
    eos = tok.convert_tokens_to_ids("<eos>")
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=1,
        n_embd=32,
        n_head=2,
        vocab_size=len(tok),
        n_positions=64,
        bos_token_id=eos,
        eos_token_id=eos,
    )
    model = _save(GPT2LMHeadModel(config), tok, root / "model")
    paths = {"model": model}
    for name, texts in (("train", TEXTS), ("queries", QUERIES)):
        table = datasets.Dataset.from_dict({"text": texts})
        table.save_to_disk(str(root / f"{name}_ds"))
        (root / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        table.to_parquet(str(root / f"{name}.parquet"))
        folder = root / f"{name}_text"
        folder.mkdir()
        for i, t in enumerate(texts):  # sorted file names keep the row order
            (folder / f"doc{i:02d}.txt").write_text(t)
        paths.update(
            {
                f"{name}_ds": root / f"{name}_ds",
                f"{name}_jsonl": root / f"{name}.jsonl",
                f"{name}_parquet": root / f"{name}.parquet",
                f"{name}_text": folder,
            }
        )
    return paths


def _ids(model_dir: Path, texts: list[str]) -> list[list[int]]:
    tok = load_tokenizer(model_dir)
    return [list(r) for r in tok(texts, truncation=True, max_length=MAX_LENGTH)["input_ids"]]


def direct_topk(tiny: dict[str, Path], tmp: Path, k: int, **kwargs: Any) -> tuple[Any, np.ndarray]:
    """The top-k and ``[n, m]`` scores of TRAKer run directly (queries unpadded)."""
    from transformers import AutoModelForCausalLM

    from gradsketch.attribution import HookGradientComputer

    model = AutoModelForCausalLM.from_pretrained(str(tiny["model"])).float().eval()
    method = kwargs.pop("method", "trak")
    extra = (
        {"gradient_computer": HookGradientComputer, "proj_dim": PROJ_DIM}
        if method == "trak"
        else {}
    )
    traker = TRAKer(
        model,
        "language_modeling",
        len(TEXTS),
        save_dir=tmp,
        device="cpu",
        method=method,
        progress=False,
        logging_level=logging.WARNING,
        lambda_reg=kwargs.pop("lambda_reg", None),
        **extra,
    )
    state = model.state_dict()
    traker.load_checkpoint(state, model_id=0)
    traker.featurize_loader(
        datasets.Dataset.from_dict({"input_ids": _ids(tiny["model"], TEXTS)}), batch_size=4
    )
    traker.finalize_features()
    traker.start_scoring_checkpoint("q", state, model_id=0, num_targets=len(QUERIES))
    traker.score_loader(
        datasets.Dataset.from_dict({"input_ids": _ids(tiny["model"], QUERIES)}), batch_size=1
    )
    return traker.topk("q", k=k), np.asarray(traker.finalize_scores("q"))


def _invoke(args: list[str]) -> Any:
    result = CliRunner().invoke(app, ["attribute", *args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def _common(tiny: dict[str, Path], out: Path, train: str, queries: str) -> list[str]:
    return [
        "--model",
        str(tiny["model"]),
        "--train",
        str(tiny[train]),
        "--queries",
        str(tiny[queries]),
        "--out",
        str(out),
        "--proj-dim",
        str(PROJ_DIM),
        "--max-length",
        str(MAX_LENGTH),
        "--top-k",
        "3",
        "--batch-size",
        "4",
        "--lambda-reg",
        "auto",
        "--no-verbose",
    ]


def test_cli_top_k_equals_a_direct_traker_run_and_the_report_names_the_documents(tiny, tmp_path):
    result = _invoke([*_common(tiny, tmp_path / "out", "train_ds", "queries_jsonl"), "--per-token"])
    assert result.exit_code == 0, result.output
    assert "attribution plan (method='trak', 12 documents" in result.output
    top, scores = direct_topk(tiny, tmp_path / "direct", 3, lambda_reg="auto")
    written = json.loads((tmp_path / "out" / "topk.json").read_text())
    assert written["k"] == 3 and len(written["queries"]) == len(QUERIES)
    for j, q in enumerate(written["queries"]):
        assert q["query"] == j and q["text"] == QUERIES[j]
        pro = [p["row"] for p in q["proponents"]]
        opp = [p["row"] for p in q["opponents"]]
        assert pro == top.proponents[:, j].tolist()
        assert opp == top.opponents[:, j].tolist()
        column = scores[:, j]
        assert len(np.unique(column)) == len(column)  # no ties: the indices are well defined
        assert pro == np.argsort(-column, kind="stable")[:3].tolist()
        scale = float(np.abs(column).max())
        got = [p["score"] for p in q["proponents"]]
        np.testing.assert_allclose(got, column[pro], rtol=1e-4, atol=1e-4 * scale)
        assert [p["text"] for p in q["proponents"]] == [TEXTS[i] for i in pro]
    page = (tmp_path / "out" / "report.html").read_text()
    best = written["queries"][0]["proponents"][0]
    assert f'data-train-row="{best["row"]}"' in page
    assert f"train[{best['row']}]" in page and "queries[1]" in page
    # Every query token is drawn, with its per-token score; a token's scores sum to the query's.
    assert page.count('<section class="query"') == len(QUERIES)
    token_scores = [float(v) for v in re.findall(r'data-t="\d+" data-score="([^"]+)"', page)]
    lengths = [len(r) for r in _ids(tiny["model"], QUERIES)]
    assert len(token_scores) == sum(lengths)
    first = token_scores[: lengths[0]]
    np.testing.assert_allclose(sum(first), best["score"], rtol=1e-3, atol=1e-4 * abs(best["score"]))


class Killed(RuntimeError):
    """The run stops here, as a killed process would."""


def test_a_rerun_resumes_featurizing_only_the_missing_rows(tiny, tmp_path, monkeypatch):
    """Killed after its first training batch, the rerun featurizes the other 8 rows only."""
    from transformers import GPT2LMHeadModel

    args = [*_common(tiny, tmp_path / "out", "train_jsonl", "queries_ds"), "--no-per-token"]
    calls = {"featurize": 0}
    featurize = TRAKer.featurize

    def dies_after_one(self: TRAKer, *a: Any, **k: Any) -> None:
        calls["featurize"] += 1
        if calls["featurize"] == 2:
            raise Killed("killed after one batch")
        featurize(self, *a, **k)

    monkeypatch.setattr(TRAKer, "featurize", dies_after_one)
    with pytest.raises(Killed):
        CliRunner().invoke(app, ["attribute", *args], catch_exceptions=False)
    monkeypatch.setattr(TRAKer, "featurize", featurize)

    rows: list[int] = []
    forward = GPT2LMHeadModel.forward

    def counting(self: Any, *a: Any, **k: Any) -> Any:
        ids = k.get("input_ids", a[0] if a else None)
        rows.append(int(ids.shape[0]))
        return forward(self, *a, **k)

    monkeypatch.setattr(GPT2LMHeadModel, "forward", counting)
    assert _invoke(args).exit_code == 0
    # 12 training rows, 4 stored before the kill: 8 featurized, then the 3 queries scored.
    assert sum(rows) == len(TEXTS) - 4 + len(QUERIES)
    first = (tmp_path / "out" / "topk.json").read_text()
    rows.clear()
    assert _invoke(args).exit_code == 0
    assert rows == []  # every row and query stored: no forward pass at all
    assert (tmp_path / "out" / "topk.json").read_text() == first


@pytest.mark.parametrize("name", ["ds", "jsonl", "parquet", "text"])
def test_each_data_form_reads_the_same_documents(tiny, tmp_path, name):
    docs = load_documents(tiny[f"train_{name}"], arg="--train", cache_dir=tmp_path)
    assert docs.texts == TEXTS
    assert docs.form == {"ds": "datasets", "jsonl": "jsonl", "parquet": "parquet"}.get(name, name)
    expected = [f"doc{i:02d}.txt" for i in range(12)] if name == "text" else None
    assert docs.names == (expected or [f"train[{i}]" for i in range(12)])


def _write(tmp: Path, kind: str) -> Path:
    """Bad inputs, one per refusal."""
    if kind == "missing":
        return tmp / "nowhere"
    if kind == "unknown":
        (tmp / "data.csv").write_text("text\nhello\n")
        return tmp / "data.csv"
    if kind == "empty_file":
        (tmp / "e.jsonl").write_text("")
        return tmp / "e.jsonl"
    if kind == "no_rows":
        datasets.Dataset.from_dict({"text": []}).to_parquet(str(tmp / "e.parquet"))
        return tmp / "e.parquet"
    if kind == "no_text_column":
        (tmp / "d.jsonl").write_text('{"content": "hello there"}\n')
        return tmp / "d.jsonl"
    if kind == "not_text":
        (tmp / "n.jsonl").write_text('{"text": 3}\n')
        return tmp / "n.jsonl"
    if kind == "no_files":
        (tmp / "nothing").mkdir()
        (tmp / "nothing" / "x.bin").write_bytes(b"\0")
        return tmp / "nothing"
    if kind == "splits":
        datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a b"]})}).save_to_disk(
            str(tmp / "dd")
        )
        return tmp / "dd"
    raise AssertionError(kind)


@pytest.mark.parametrize(
    ("kind", "error", "match"),
    [
        ("missing", ConfigFileError, r"`--train` .*nowhere does not exist; pass a folder written"),
        ("unknown", ConfigError, r"unknown format '\.csv'; pass .*JSON Lines"),
        ("empty_file", ConfigError, r"e\.jsonl is empty \(0 bytes\); give it at least one"),
        ("no_rows", ConfigError, r"e\.parquet is empty \(0 rows\); give it at least one"),
        ("no_text_column", ConfigError, r"no column 'text' \(its columns: \['content'\]\); pass "),
        ("not_text", ConfigError, r"column 'text' is not text at rows \[0\] \(e\.g\. int\)"),
        ("no_files", ConfigError, r"a folder with no text files"),
        ("splits", ConfigError, r"holds the splits \['train'\] .*pass one split's folder"),
    ],
    ids=lambda v: v if isinstance(v, str) and " " not in v and "\\" not in v else "",
)
def test_bad_data_is_refused_with_argument_value_and_fix(tmp_path, kind, error, match):
    with pytest.raises(error, match=match):
        load_documents(_write(tmp_path, kind), arg="--train", cache_dir=tmp_path / "c")


def test_model_folder_refusals(tiny, tmp_path):
    with pytest.raises(ConfigFileError, match=r"`--model` .*nope is not a folder"):
        attribute_hf_command(tmp_path / "nope", "t", "q", tmp_path / "o")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"has no config\.json"):
        attribute_hf_command(tmp_path / "empty", "t", "q", tmp_path / "o")
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((tiny["model"] / "config.json").read_text())
    for f in tiny["model"].glob("*.safetensors"):
        (bare / f.name).write_bytes(f.read_bytes())
    with pytest.raises(ConfigError, match=r"has no tokenizer .*tokenizer\.save_pretrained\(DIR\)"):
        attribute_hf_command(bare, tiny["train_ds"], tiny["queries_ds"], tmp_path / "o")


def test_documents_too_short_are_left_out_and_all_too_short_refused(tiny, tmp_path):
    (tmp_path / "q.jsonl").write_text('{"text": "x"}\n{"text": ""}\n')
    with pytest.raises(ConfigError, match=r"`--queries` .* none of its 2 documents has two tokens"):
        attribute_hf_command(
            tiny["model"], tiny["train_ds"], tmp_path / "q.jsonl", tmp_path / "o", top_k=2
        )


def test_another_training_set_in_the_same_out_is_refused(tiny, tmp_path):
    kw = dict(proj_dim=PROJ_DIM, max_length=MAX_LENGTH, per_token=False, progress=False)
    out = tmp_path / "out"
    attribute_hf_command(tiny["model"], tiny["train_ds"], tiny["queries_ds"], out, **kw)
    (tmp_path / "other.jsonl").write_text(
        "".join(json.dumps({"text": t + " more"}) + "\n" for t in TEXTS)
    )
    with pytest.raises(SettingsMismatchError, match=r"built from other inputs \(train differ"):
        attribute_hf_command(tiny["model"], tmp_path / "other.jsonl", tiny["queries_ds"], out, **kw)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"method": "magic"}, r"`--method` must be one of .*ekfac.*trak, got 'magic'"),
        ({"method": "ekfac", "proj_dim": 64}, r"`--proj-dim` 64 sets TRAK's .*--projection"),
        ({"projection": (8, 8)}, r"`--projection` \(8, 8\) projects per-layer rows"),
        ({"max_length": 1}, r"`--max-length` must be an integer >= 2, got 1"),
        ({"top_k": 0}, r"`--top-k` must be a positive integer, got 0; pass e\.g\. --top-k 5"),
        ({"memory_budget": -1}, r"`--memory-budget` must be a positive integer or None"),
        ({"text_column": ""}, r"`--text-column` is empty"),
    ],
    ids=["method", "proj_dim_per_layer", "projection_trak", "max_length", "top_k", "budget", "col"],
)
def test_bad_options_are_refused(options, match):
    with pytest.raises(ConfigError, match=match):
        HFAttributeSettings(**options)


def test_option_parsers():
    assert parse_projection("16,8") == (16, 8) and parse_projection(None) is None
    assert parse_lambda("auto") == "auto" and parse_lambda("0.5") == 0.5
    with pytest.raises(ConfigError, match=r"`--projection` must be two sizes K_IN,K_OUT or exact"):
        parse_projection("x")


def test_projection_not_given_is_the_disk_aware_default_and_exact_is_asked_for():
    """No ``--projection``: TRAKer's ``"auto"``; ``exact``: ``None``; a pair is kept."""
    assert parse_projection("Exact") == "exact"
    assert _traker_projection(None) == "auto"
    assert _traker_projection("exact") is None
    assert _traker_projection((16, 8)) == (16, 8)
    settings = HFAttributeSettings(method="ekfac", projection="exact")
    assert settings.to_dict()["projection"] == "exact"
    with pytest.raises(ConfigError, match=r"`--projection` exact projects per-layer rows"):
        HFAttributeSettings(method="trak", projection="exact")
    with pytest.raises(ConfigError, match=r"`--projection` must be two sizes"):
        HFAttributeSettings(method="ekfac", projection="16")
    with pytest.raises(ConfigError, match=r"`--lambda-reg` must be a number >= 0 or 'auto'"):
        parse_lambda("-1")


def test_the_two_modes_do_not_mix(tiny, tmp_path):
    config = tmp_path / "c.py"
    config.write_text("x = 1\n")

    def refused(*args: str) -> str:
        result = CliRunner().invoke(app, ["attribute", *args])
        assert result.exit_code == 2, result.output
        return re.sub(r"[\s\u2500-\u257f]", "", result.output)  # typer boxes and wraps it

    assert "drop--model" in refused(str(config), "--model", str(tiny["model"]))
    assert "missing--train,--queries" in refused("--model", str(tiny["model"]))
    assert "absent.pydoesnotexist" in refused(str(tmp_path / "absent.py"))
    assert "c.txtisnota.pyconfigfile" in refused(str(config.with_suffix(".txt")))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["identity", "kfac", "ekfac"])
def test_per_layer_methods_match_a_direct_run(tiny, tmp_path, method):
    args = _common(tiny, tmp_path / "out", "train_parquet", "queries_text")
    args = [a for a in args if a not in ("--proj-dim", str(PROJ_DIM))]
    result = _invoke([*args, "--method", method])
    assert result.exit_code == 0, result.output
    top, _ = direct_topk(tiny, tmp_path / "direct", 3, method=method, lambda_reg="auto")
    written = json.loads((tmp_path / "out" / "topk.json").read_text())
    for j, q in enumerate(written["queries"]):
        assert [p["row"] for p in q["proponents"]] == top.proponents[:, j].tolist()
        assert q["name"] == f"doc{j:02d}.txt"


def _example() -> Any:
    spec = importlib.util.spec_from_file_location(
        "attribute_gpt2_small", EXAMPLES / "attribute_gpt2_small.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("family", "params"),
    # GPT-2 small's 124,439,808 (the LM head tied to the token embedding); Pythia-160M's
    # 162,322,944 (GPT-NeoX's own output embedding, untied).
    [("gpt2", 124_439_808), ("pythia", 162_322_944)],
)
def test_example_configs_have_the_published_shapes(family, params):
    with torch.device("meta"):
        model = _example().build_model(family)
    assert sum(p.numel() for p in model.parameters()) == params


def test_a_pythia_shaped_gpt_neox_runs_through_the_command(tiny, tmp_path):
    """GPT-NeoX as Pythia builds it (rotary on a quarter of each head, parallel residual)."""
    small = _example().build_model("pythia", layers=1, width=32, heads=2, vocab=300, positions=64)
    model_dir = _save(small, load_tokenizer(tiny["model"]), tmp_path / "neox")
    summary = attribute_hf_command(
        model_dir,
        tiny["train_text"],
        tiny["queries_jsonl"],
        tmp_path / "out",
        progress=False,
        echo=lambda _: None,
        proj_dim=PROJ_DIM,
        max_length=MAX_LENGTH,
        top_k=2,
    )
    written = json.loads(Path(summary["files"]["topk"]).read_text())
    assert len(written["queries"]) == len(QUERIES)
    assert all(len(q["proponents"]) == 2 for q in written["queries"])
    assert "GPTNeoXForCausalLM" in Path(summary["files"]["report"]).read_text()


def test_a_document_too_short_is_left_out_and_the_others_keep_their_rows(tiny, tmp_path):
    texts = [*TEXTS[:3], "", *TEXTS[3:]]  # row 3 has no token to predict
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    said: list[str] = []
    summary = attribute_hf_command(
        tiny["model"],
        tmp_path / "t.jsonl",
        tiny["queries_ds"],
        tmp_path / "out",
        progress=False,
        echo=said.append,
        proj_dim=PROJ_DIM,
        max_length=MAX_LENGTH,
        top_k=len(TEXTS),
        lambda_reg="auto",
    )
    assert any(
        "--train: left out 1 document(s) with fewer than 2 tokens: rows [3]" in s for s in said
    )
    assert summary["train"]["documents"] == len(TEXTS)
    for q in json.loads(Path(summary["files"]["topk"]).read_text())["queries"]:
        rows = [p["row"] for p in q["proponents"]]
        assert sorted(rows) == [i for i in range(len(texts)) if i != 3]
        assert all(p["text"] == texts[p["row"]] for p in q["proponents"])
