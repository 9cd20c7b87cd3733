"""``gradsketch attribute --model DIR --train DATA --queries DATA``: attribution in one command.

The other mode of ``gradsketch attribute`` (the first is a Python config,
:mod:`gradsketch.cli._attribute`): a local Hugging Face causal LM and two
local document collections. :func:`attribute_hf_command` loads the model
and its tokenizer from ``DIR`` (``save_pretrained``; nothing is downloaded),
reads the documents, tokenizes each into at most ``max_length`` tokens,
prints the :class:`~gradsketch.attribution.AttributionPlan`, builds (or
resumes) the store with progress bars, scores the queries and writes each
query's top-k proponents and opponents as ``topk.json`` and as
``report.html`` (the language-model demo's page:
:mod:`gradsketch.demos.token_report`).

``DATA`` is one of :data:`DATA_FORMATS`: a ``datasets`` folder written by
``save_to_disk``, a JSON Lines (or JSON) file, a Parquet file, or a folder
of text files (each file one document, read recursively in sorted order).
Each document's text is the ``text_column`` of its row (for a folder of text
files, the file). Rows keep their numbers in ``topk.json``: a document with
fewer than two tokens (nothing to predict) is left out, and said so, but the
others keep their row in the dataset.

Outputs in ``out``: ``topk.json``, ``report.html``, ``summary.json`` (the
settings, the plan, timings, files), ``inputs.json`` (fingerprints of the
tokenized training documents: a rerun with other documents in the same
folder is refused) and the store ``store/``: a rerun featurizes only the
rows that are missing, and queries already scored are not scored again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from gradsketch._checks import check_int, positive_int
from gradsketch.cli._paths import check_folder, output_folder, write_summary
from gradsketch.errors import (
    ConfigError,
    ConfigFileError,
    MemoryBudgetError,
    SettingsMismatchError,
)

__all__ = [
    "DATA_FORMATS",
    "HFAttributeSettings",
    "Documents",
    "attribute_hf_command",
    "load_documents",
    "load_causal_lm",
    "load_tokenizer",
]

#: What ``--train`` / ``--queries`` may be, in the order they are recognised.
DATA_FORMATS = {
    "datasets": "a folder written by datasets' save_to_disk",
    "jsonl": "a JSON Lines file (.jsonl, or .json)",
    "parquet": "a Parquet file (.parquet)",
    "text": "a folder of text files (one document per file)",
}
JSON_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
#: Files of a text folder that are documents.
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".text")
#: A column of one of these names, where a dataset has one, names its documents.
NAME_COLUMNS = ("name", "title", "id", "source", "path", "file")
#: Files of a model folder that hold a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
#: TRAK's projection size when ``--proj-dim`` is not given.
DEFAULT_PROJ_DIM = 2048
#: ``--projection exact``: exact per-layer rows, whatever the disk holds.
EXACT = "exact"
STORE = "store"
INPUTS_FILE = "inputs.json"
#: How the refusal of a plan that does not fit reads on the command line.
CLI_FIXES = (
    "On the command line: --projection 16,16 (per-layer methods), a smaller --proj-dim "
    "(trak), --grad-wrt naming fewer weights, --memory-budget BYTES, a smaller --max-length "
    "or --batch-size."
)


def _methods() -> list[str]:
    """The methods a model folder can use: every registered preconditioner."""
    from gradsketch.attribution import CURVATURE_PRECONDITIONERS

    return sorted(CURVATURE_PRECONDITIONERS)


def _layered(method: str) -> bool:
    from gradsketch.attribution import CURVATURE_PRECONDITIONERS

    return CURVATURE_PRECONDITIONERS[method].features == "layers"


@dataclass(frozen=True)
class HFAttributeSettings:
    """The options of ``gradsketch attribute --model DIR`` (saved in ``summary.json``).

    Attributes:
        method: a registered method (``trak``, ``identity``, ``kfac``, ``ekfac``...).
        proj_dim: TRAK's projection size (default 2048); per-layer methods take
            ``projection`` instead.
        projection: per-layer methods: ``(k_in, k_out)`` projects each layer's
            inputs and output gradients (LoGra); ``"exact"``: exact per-layer rows
            (recomputed while scoring where they do not fit the disk); ``None``:
            exact rows where they fit the free disk, else 16 × 16.
        max_length: tokens per document (longer ones are cut).
        text_column: the column holding each document's text.
        top_k: proponents and opponents kept per query.
        memory_budget: bytes of working memory for the finalize and scoring blocks.
        batch_size: documents per featurize call.
        grad_wrt: ``|``-separated parameter-name patterns to attribute through
            (``None``: TRAKer's default).
        per_token: also score each query token (the report's shading). Each query
            then costs ``T`` per-example gradients, computed ``T`` at a time: about
            ``T / batch_size`` times the featurize memory the plan shows.
        device: torch device (default: CUDA when available).
        lambda_reg: damping (``None``: the method's default).
        seed: the projection's seed.
    """

    method: str = "trak"
    proj_dim: int | None = None
    projection: tuple[int, int] | str | None = None
    max_length: int = 128
    text_column: str = "text"
    top_k: int = 5
    memory_budget: int | None = None
    batch_size: int = 8
    grad_wrt: str | None = None
    per_token: bool = False
    device: str | None = None
    lambda_reg: float | str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        methods = _methods()
        if self.method not in methods:
            raise ConfigError(
                f"`--method` must be one of {', '.join(methods)}, got {self.method!r}; e.g. "
                "--method ekfac for influence with per-layer curvature."
            )
        layered = _layered(self.method)
        if layered and self.proj_dim is not None:
            raise ConfigError(
                f"`--proj-dim` {self.proj_dim} sets TRAK's projection, but --method "
                f"{self.method} keeps per-layer rows; project them with --projection "
                "K_IN,K_OUT (e.g. --projection 16,16), or drop --proj-dim."
            )
        if not layered and self.projection is not None:
            raise ConfigError(
                f"`--projection` {self.projection} projects per-layer rows, but --method "
                f"{self.method} keeps one projected gradient; use --proj-dim K, or drop "
                "--projection."
            )
        positive_int("--proj-dim", self.proj_dim, optional=True, error=ConfigError)
        if self.projection is not None and self.projection != EXACT:
            if isinstance(self.projection, str) or len(self.projection) != 2:
                raise ConfigError(
                    f"`--projection` must be two sizes K_IN,K_OUT, got {self.projection!r}; "
                    "e.g. --projection 16,16."
                )
            for size in self.projection:
                positive_int(
                    "--projection", size, error=ConfigError, fix="pass e.g. --projection 16,16"
                )
        check_int(
            "--max-length",
            self.max_length,
            low=2,
            error=ConfigError,
            fix="pass e.g. --max-length 128",
        )
        positive_int("--top-k", self.top_k, error=ConfigError, fix="pass e.g. --top-k 5")
        positive_int(
            "--batch-size", self.batch_size, error=ConfigError, fix="pass e.g. --batch-size 8"
        )
        positive_int(
            "--memory-budget",
            self.memory_budget,
            optional=True,
            error=ConfigError,
            fix="pass bytes, e.g. --memory-budget 2000000000",
        )
        if not self.text_column:
            raise ConfigError("`--text-column` is empty; name the column of text, e.g. text.")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready settings."""
        record = dataclasses.asdict(self)
        p = self.projection
        record["projection"] = p if p is None or isinstance(p, str) else list(p)
        return record


@dataclass(frozen=True)
class Documents:
    """Documents read from ``--train`` or ``--queries``.

    Attributes:
        path: where they were read from.
        form: one of :data:`DATA_FORMATS`.
        texts: each document's text, in row order.
        names: how reports name each document.
    """

    path: Path
    form: str
    texts: list[str]
    names: list[str]


def _offline() -> None:
    """Nothing may be fetched: local files only (set before ``datasets`` is imported)."""
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        os.environ.setdefault(var, "1")


def _formats() -> str:
    return "; ".join(f"{v}" for v in DATA_FORMATS.values())


def _read_table(path: Path, form: str, arg: str, cache_dir: Path | None) -> Any:
    """A ``datasets.Dataset`` from a local file or ``save_to_disk`` folder."""
    _offline()
    import datasets

    if form == "datasets":
        data = datasets.load_from_disk(str(path))
        if isinstance(data, datasets.DatasetDict):
            splits = sorted(data)
            raise ConfigError(
                f"`{arg}` {path} holds the splits {splits} (a DatasetDict); pass one split's "
                f"folder, e.g. {arg} {path / splits[0]}."
            )
        return data
    builder = "json" if form == "jsonl" else "parquet"
    if path.stat().st_size == 0:
        raise _empty(arg, path, "0 bytes")
    try:
        return datasets.load_dataset(
            builder,
            data_files=str(path),
            split="train",
            cache_dir=None if cache_dir is None else str(cache_dir),
        )
    except Exception as err:  # pyarrow's and datasets' parse errors have no common base
        if "corresponds to no data" in str(err):
            raise _empty(arg, path, "0 rows") from err
        raise ConfigError(
            f"`{arg}` {path} could not be read as {DATA_FORMATS[form]}: {err}; check the file."
        ) from err


def _empty(arg: str, path: Path, what: str) -> ConfigError:
    return ConfigError(f"`{arg}` {path} is empty ({what}); give it at least one document.")


def data_form(path: Path, arg: str) -> str:
    """Which of :data:`DATA_FORMATS` ``path`` is (refused, with the forms, if none)."""
    if not path.exists():
        raise ConfigFileError(f"`{arg}` {path} does not exist; pass {_formats()}.")
    if path.is_dir():
        if (path / "dataset_info.json").is_file() or (path / "state.json").is_file():
            return "datasets"
        if (path / "dataset_dict.json").is_file():
            return "datasets"
        return "text"
    suffix = path.suffix.lower()
    if suffix in JSON_SUFFIXES:
        return "jsonl"
    if suffix in PARQUET_SUFFIXES:
        return "parquet"
    raise ConfigError(
        f"`{arg}` {path} is a file of unknown format {suffix or '(no suffix)'!r}; pass "
        f"{_formats()} (a single text file: put it in a folder)."
    )


def load_documents(
    path: str | Path,
    *,
    arg: str = "--train",
    text_column: str = "text",
    cache_dir: Path | None = None,
) -> Documents:
    """The documents of ``path`` (one of :data:`DATA_FORMATS`), in row order.

    Args:
        path: the data.
        arg: the option it came from, named in refusals.
        text_column: the column of text (tables and ``datasets`` folders).
        cache_dir: where ``datasets`` caches a parsed JSON / Parquet file.

    Raises:
        ConfigFileError: ``path`` does not exist.
        ConfigError: an unknown format, no documents, no ``text_column``, or
            a ``text_column`` that is not text.
    """
    where = Path(path)
    form = data_form(where, arg)
    if form == "text":
        files = sorted(
            p for p in where.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES
        )
        if not files:
            raise ConfigError(
                f"`{arg}` {where} is a folder with no text files ({', '.join(TEXT_SUFFIXES)}) "
                f"and no saved dataset; pass {_formats()}."
            )
        texts = [p.read_text(encoding="utf-8", errors="replace") for p in files]
        names = [str(p.relative_to(where)) for p in files]
        return Documents(where, form, texts, names)
    table = _read_table(where, form, arg, cache_dir)
    if len(table) == 0:
        raise _empty(arg, where, "0 rows")
    if text_column not in table.column_names:
        raise ConfigError(
            f"`{arg}` {where} has no column {text_column!r} (its columns: "
            f"{table.column_names}); pass --text-column NAME with the column holding the text."
        )
    texts = table[text_column]
    bad = [i for i, t in enumerate(texts) if not isinstance(t, str)]
    if bad:
        raise ConfigError(
            f"`{arg}` {where}: column {text_column!r} is not text at rows {bad[:10]} (e.g. "
            f"{type(texts[bad[0]]).__name__}); pass --text-column NAME of a column of strings."
        )
    label = next((c for c in NAME_COLUMNS if c in table.column_names), None)
    stem = arg.removeprefix("--")
    names = (
        [f"{stem}[{i}] {v}" for i, v in enumerate(table[label])]
        if label is not None
        else [f"{stem}[{i}]" for i in range(len(texts))]
    )
    return Documents(where, form, list(texts), names)


def model_folder(model_dir: str | Path) -> Path:
    """``model_dir`` as a Path, refused unless it is a Hugging Face model folder."""
    where = Path(model_dir)
    if not where.is_dir():
        raise ConfigFileError(
            f"`--model` {where} is not a folder; pass a folder written by "
            "model.save_pretrained(DIR) (with its tokenizer.save_pretrained(DIR))."
        )
    if not (where / "config.json").is_file():
        raise ConfigError(
            f"`--model` {where} has no config.json, so it is not a Hugging Face model folder; "
            "pass a folder written by model.save_pretrained(DIR)."
        )
    return where


def load_causal_lm(model_dir: str | Path) -> nn.Module:
    """The causal LM saved in ``model_dir`` (local files only), in eval mode and float32."""
    where = model_folder(model_dir)
    _offline()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(where), local_files_only=True)
    # float32: per-example gradients of half weights lose the small documents' signal.
    return model.float().eval()


def load_tokenizer(model_dir: str | Path) -> Any:
    """The tokenizer saved beside the model in ``model_dir`` (refused when there is none)."""
    where = model_folder(model_dir)
    if not any((where / f).is_file() for f in TOKENIZER_FILES):
        raise ConfigError(
            f"`--model` {where} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
            "the documents are text, so save the model's tokenizer beside it with "
            "tokenizer.save_pretrained(DIR)."
        )
    _offline()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(where), local_files_only=True)


def tokenize(
    docs: Documents, tokenizer: Any, max_length: int, arg: str
) -> tuple[list[list[int]], list[int]]:
    """Each document's token ids (at most ``max_length``) and the rows kept.

    Rows with fewer than two tokens predict nothing and are left out; the
    others keep their row number.

    Raises:
        ConfigError: no document has two tokens.
    """
    ids = tokenizer(docs.texts, truncation=True, max_length=max_length)["input_ids"]
    kept = [i for i, row in enumerate(ids) if len(row) >= 2]
    if not kept:
        raise ConfigError(
            f"`{arg}` {docs.path}: none of its {len(ids)} documents has two tokens or more "
            "(a causal LM predicts from the second token on); give longer documents."
        )
    return [list(ids[i]) for i in kept], kept


def _fingerprint(rows: Sequence[Sequence[int]]) -> str:
    h = hashlib.sha256()
    for row in rows:
        h.update(np.asarray(row, dtype=np.int64).tobytes())
        h.update(b"|")
    return h.hexdigest()


def _check_inputs(out: Path, record: dict[str, Any]) -> None:
    """Refuse a rerun whose training documents or model differ from the store's."""
    path = out / INPUTS_FILE
    if path.is_file():
        stored = json.loads(path.read_text())
        changed = [k for k in ("model", "train", "train_rows") if stored.get(k) != record.get(k)]
        if changed:
            raise SettingsMismatchError(
                f"`--out` {out} holds a store built from other inputs ({', '.join(changed)} "
                f"differ): stored {json.dumps({k: stored.get(k) for k in changed})}, now "
                f"{json.dumps({k: record.get(k) for k in changed})}; pass another --out, or "
                f"delete {out / STORE} and {path} to rebuild it."
            )
    path.write_text(json.dumps(record, indent=2) + "\n")


def _dataset(rows: Sequence[Sequence[int]], pad_to: int | None = None) -> Any:
    """A ``datasets.Dataset`` of ``input_ids`` (right-padded to ``pad_to`` with a mask)."""
    _offline()
    import datasets

    if pad_to is None:
        return datasets.Dataset.from_dict({"input_ids": [list(r) for r in rows]})
    ids = [list(r) + [0] * (pad_to - len(r)) for r in rows]
    mask = [[1] * len(r) + [0] * (pad_to - len(r)) for r in rows]
    return datasets.Dataset.from_dict({"input_ids": ids, "attention_mask": mask})


def _token_texts(tokenizer: Any, ids: Sequence[int]) -> tuple[str, ...]:
    """Each token's own text (a byte-level piece of a character shows as the replacement)."""
    return tuple(tokenizer.decode([int(t)]) for t in ids)


def _make_traker(
    model: nn.Module, n: int, save_dir: Path, s: HFAttributeSettings, progress: bool
) -> Any:
    from gradsketch.attribution import HookGradientComputer, TRAKer

    extra: dict[str, Any] = (
        {"projection": _traker_projection(s.projection)}
        if _layered(s.method)
        else {
            "gradient_computer": HookGradientComputer,
            "proj_dim": s.proj_dim or DEFAULT_PROJ_DIM,
            "use_half_precision": False,
        }
    )
    return TRAKer(
        model,
        "language_modeling",
        n,
        save_dir=save_dir,
        load_from_save_dir=True,
        device=s.device,
        projector_seed=s.seed,
        grad_wrt=s.grad_wrt,
        lambda_reg=s.lambda_reg,
        memory_budget=s.memory_budget,
        method=s.method,
        progress=progress,
        logging_level=logging.INFO if progress else logging.WARNING,
        **extra,
    )


def attribute_hf_command(
    model: str | Path,
    train: str | Path,
    queries: str | Path,
    out: str | Path = "gradsketch_out",
    settings: HFAttributeSettings | None = None,
    *,
    progress: bool = True,
    echo: Callable[[str], None] = print,
    **overrides: Any,
) -> dict[str, Any]:
    """Attribute each query document to the training documents with a local HF causal LM.

    Args:
        model: a ``save_pretrained`` folder holding the model and its tokenizer.
        train: the training documents (one of :data:`DATA_FORMATS`).
        queries: the query documents (likewise).
        out: output folder (created; a rerun resumes the store in it).
        settings: the options (default :class:`HFAttributeSettings`).
        progress: progress bars, and the TRAKer's plan logged at the first batch.
        echo: where the plan and the closing lines are printed.
        **overrides: fields of :class:`HFAttributeSettings` to change.

    Returns:
        The summary written to ``summary.json``; ``summary["report"]`` is a short
        text for the terminal.

    Raises:
        ConfigFileError: a path that does not exist.
        ConfigError: an input refused (see :func:`load_documents`, :func:`load_tokenizer`).
        SettingsMismatchError: ``out`` holds a store of other training documents.
        MemoryBudgetError: the plan does not fit this machine (with the flags that help).

    Example:
        >>> attribute_hf_command("no_such_model", "t", "q", "o")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        gradsketch.errors.ConfigFileError: `--model` no_such_model is not a folder; ...
    """
    s = dataclasses.replace(settings or HFAttributeSettings(), **overrides)
    out_dir = check_folder(out)
    check_folder(out_dir / STORE, name="save_dir")
    # The cheap checks first: a refused input costs no model load.
    tokenizer = load_tokenizer(model)
    start = time.perf_counter()
    timings: dict[str, float] = {}
    out_dir = output_folder(out_dir)
    cache = out_dir / "datasets_cache"
    train_docs = load_documents(train, arg="--train", text_column=s.text_column, cache_dir=cache)
    query_docs = load_documents(
        queries, arg="--queries", text_column=s.text_column, cache_dir=cache
    )
    train_ids, train_rows = tokenize(train_docs, tokenizer, s.max_length, "--train")
    query_ids, query_rows = tokenize(query_docs, tokenizer, s.max_length, "--queries")
    for arg, docs, rows in (
        ("--train", train_docs, train_rows),
        ("--queries", query_docs, query_rows),
    ):
        left = sorted(set(range(len(docs.texts))) - set(rows))
        if left:
            echo(
                f"{arg}: left out {len(left)} document(s) with fewer than 2 tokens: rows "
                f"{left[:10]}{' ...' if len(left) > 10 else ''}"
            )
    n, m = len(train_ids), len(query_ids)
    lm = load_causal_lm(model)
    inputs = {
        "model": str(Path(model).resolve()),
        "train": _fingerprint(train_ids),
        "train_rows": train_rows,
        "max_length": s.max_length,
    }
    _check_inputs(out_dir, inputs)
    length = max(len(r) for r in query_ids)
    # One experiment per query set: other queries (or per-token on/off) are scored afresh.
    exp = f"queries-{_fingerprint(query_ids)[:12]}{'-tokens' if s.per_token else ''}"

    try:
        traker = _make_traker(lm, n, out_dir / STORE, s, progress)
    except MemoryBudgetError as err:
        raise MemoryBudgetError(f"{err}\n{CLI_FIXES}") from err
    plan_before = str(traker.plan)
    echo(plan_before)
    state = {k: v.detach().clone() for k, v in lm.state_dict().items()}
    t0 = time.perf_counter()
    traker.load_checkpoint(state, model_id=0)
    try:
        traker.featurize_loader(_dataset(train_ids), batch_size=s.batch_size)
    except MemoryBudgetError as err:
        raise MemoryBudgetError(f"{err}\n{CLI_FIXES}") from err
    timings["featurize"] = time.perf_counter() - t0
    plan = traker.plan
    if plan.seconds_per_row is not None:
        echo(str(plan))

    t0 = time.perf_counter()
    traker.finalize_features()
    timings["finalize_features"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    traker.start_scoring_checkpoint(exp, state, model_id=0, num_targets=m, per_token=s.per_token)
    # Per-token scoring expands each query T-fold: the TRAKer groups them, one batch is enough.
    traker.score_loader(
        _dataset(query_ids, pad_to=length if s.per_token else None), batch_size=s.batch_size
    )
    top = traker.topk(exp, k=min(s.top_k, n))
    token_scores = None
    if s.per_token:
        token_scores = np.asarray(traker.finalize_scores(exp, per_token=True))
    timings["score"] = time.perf_counter() - t0

    result = _write_results(
        out_dir,
        s,
        top,
        token_scores,
        (train_docs, train_ids, train_rows),
        (query_docs, query_ids, query_rows),
        tokenizer,
        lm,
        str(plan),
    )
    timings["total"] = time.perf_counter() - start
    summary: dict[str, Any] = {
        "model": inputs["model"],
        "train": {"path": str(train_docs.path), "form": train_docs.form, "documents": n},
        "queries": {"path": str(query_docs.path), "form": query_docs.form, "documents": m},
        "settings": s.to_dict(),
        "experiment": exp,
        "plan": str(plan),
        "plan_before_featurizing": plan_before,
        "timings_s": {k: round(v, 3) for k, v in timings.items()},
        "files": {
            **result,
            "store": str(out_dir / STORE),
            "summary": str(out_dir / "summary.json"),
        },
    }
    return write_summary(
        out_dir,
        summary,
        f"gradsketch attribute: {m} queries against {n} training documents with "
        f"method={s.method} in {timings['total']:.1f} s",
        f"top-{min(s.top_k, n)}: {result['topk']}",
        f"report: {result['report']}",
    )


def _write_results(
    out: Path,
    s: HFAttributeSettings,
    top: Any,
    token_scores: np.ndarray | None,
    train: tuple[Documents, list[list[int]], list[int]],
    queries: tuple[Documents, list[list[int]], list[int]],
    tokenizer: Any,
    lm: nn.Module,
    plan: str,
) -> dict[str, str]:
    """``topk.json`` and ``report.html``; their paths."""
    from gradsketch.demos.token_report import Document, DocumentView, write_document_report

    train_docs, train_ids, train_rows = train
    query_docs, query_ids, query_rows = queries
    preview = 200

    def doc(docs: Documents, ids: Sequence[int], row: int) -> Document:
        return Document(docs.names[row], _token_texts(tokenizer, ids))

    pro, pro_s = top.proponents.numpy(), top.proponent_scores.numpy()
    opp, opp_s = top.opponents.numpy(), top.opponent_scores.numpy()
    records, views = [], []
    for j, q_row in enumerate(query_rows):
        pros = [(int(i), float(v)) for i, v in zip(pro[:, j], pro_s[:, j], strict=True)]
        opps = [(int(i), float(v)) for i, v in zip(opp[:, j], opp_s[:, j], strict=True)]

        def entry(i: int, v: float) -> dict[str, Any]:
            row = train_rows[i]
            text = train_docs.texts[row]
            return {"row": row, "name": train_docs.names[row], "score": v, "text": text[:preview]}

        records.append(
            {
                "query": q_row,
                "name": query_docs.names[q_row],
                "text": query_docs.texts[q_row][:preview],
                "proponents": [entry(i, v) for i, v in pros],
                "opponents": [entry(i, v) for i, v in opps],
            }
        )
        best = pros[0][0]
        shading = None
        if token_scores is not None:
            shading = np.asarray(token_scores[best, j, : len(query_ids[j])], dtype=np.float32)
        views.append(
            DocumentView(
                query=q_row,
                document=doc(query_docs, query_ids[j], q_row),
                token_scores=shading,
                shaded_by=train_rows[best],
                proponents=[
                    (train_rows[i], doc(train_docs, train_ids[i], train_rows[i]), v)
                    for i, v in pros
                ],
                opponents=[
                    (train_rows[i], doc(train_docs, train_ids[i], train_rows[i]), v)
                    for i, v in opps
                ],
            )
        )
    topk_path = out / "topk.json"
    topk_path.write_text(
        json.dumps(
            {
                "method": s.method,
                "k": int(pro.shape[0]),
                "score_meaning": "higher: the training document raised the query's log-odds",
                "queries": records,
            },
            indent=2,
        )
        + "\n"
    )
    params = sum(p.numel() for p in lm.parameters())
    facts = {
        "model": f"{type(lm).__name__}, {params:,} parameters",
        "training documents": f"{len(train_ids)} from {train_docs.path} ({train_docs.form}), "
        f"at most {s.max_length} tokens each",
        "method": f"{s.method}"
        + (f", proj_dim {s.proj_dim or DEFAULT_PROJ_DIM}" if not _layered(s.method) else "")
        + (f", projection {s.projection}" if s.projection else ""),
        "plan": plan.splitlines()[0] if plan else "",
    }
    report = write_document_report(
        out / "report.html",
        views,
        title="gradsketch: which training documents taught the model these queries",
        facts=facts,
    )
    return {"topk": str(topk_path), "report": str(report)}


def parse_projection(value: str | None) -> tuple[int, int] | str | None:
    """``"16,16"`` as ``(16, 16)``; ``"exact"`` as :data:`EXACT`; ``None`` as ``None``.

    Example:
        >>> parse_projection("16,8")
        (16, 8)
    """
    if value is None:
        return None
    if value.strip().lower() == EXACT:
        return EXACT
    parts = value.replace("x", ",").split(",")
    try:
        k_in, k_out = (int(p) for p in parts)
    except ValueError:
        raise ConfigError(
            f"`--projection` must be two sizes K_IN,K_OUT or exact, got {value!r}; e.g. "
            "--projection 16,16."
        ) from None
    return k_in, k_out


def _traker_projection(projection: tuple[int, int] | str | None) -> Any:
    """``TRAKer(projection=)`` for ``--projection``: exact rows only when asked for.

    Not given: ``"auto"`` (exact rows where they fit the free disk, else 16 × 16
    per layer, logged); ``exact``: ``None`` (exact rows, recomputed while
    scoring where they do not fit).
    """
    if projection is None:
        return "auto"
    return None if projection == EXACT else projection


def parse_lambda(value: str | None) -> float | str | None:
    """``--lambda-reg``: a number >= 0, ``auto``, or ``None`` (the method's default)."""
    if value is None or value.strip().lower() == "auto":
        return None if value is None else "auto"
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not (math.isfinite(number) and number >= 0):
        raise ConfigError(
            f"`--lambda-reg` must be a number >= 0 or 'auto', got {value!r}; pass e.g. "
            "--lambda-reg auto."
        )
    return number
