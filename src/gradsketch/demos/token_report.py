"""The language-model demo's HTML report for documents of any tokenizer's tokens.

:mod:`gradsketch.demos._lm_report` draws the demo's byte-level chunks (one
token per byte, named ``file:line``); ``gradsketch attribute --model DIR``
attributes documents of a Hugging Face tokenizer, whose tokens are strings of
any length, named by the dataset's row or file. This module draws those with
the same page: the same styles, the same shading (green raised the token's
log-odds, red lowered it, opacity ``|score| / max |score|`` over the query's
tokens) and the same ``data-score`` attributes, so a test can read the
numbers back. The demo's own report is left as it is.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gradsketch.demos._lm_report import LEGEND, page, shaded_spans, table_rows

__all__ = ["Document", "DocumentView", "render_document_report", "write_document_report"]


@dataclass(frozen=True)
class Document:
    """A document as the report shows it.

    Attributes:
        name: how the report names it (a file, or ``train[12]``).
        tokens: the text of each of its tokens, in order.
    """

    name: str
    tokens: tuple[str, ...]

    @property
    def text(self) -> str:
        """The tokens joined."""
        return "".join(self.tokens)


@dataclass(frozen=True)
class DocumentView:
    """What the report shows of one query.

    Attributes:
        query: the query's row.
        document: the query.
        token_scores: ``[T]`` scores of its tokens for ``shaded_by`` (``None``:
            no per-token scores, the tokens are drawn unshaded).
        shaded_by: the training row whose per-token scores those are.
        proponents: ``[(train row, document, score)]``, highest score first.
        opponents: ``[(train row, document, score)]``, lowest score first.
    """

    query: int
    document: Document
    token_scores: np.ndarray | None
    shaded_by: int
    proponents: Sequence[tuple[int, Document, float]]
    opponents: Sequence[tuple[int, Document, float]]


def _text_html(text: str) -> str:
    """Escaped text; newlines and tabs also drawn as symbols, as the demo draws them."""
    return (
        html.escape(text)
        .replace("\n", '<span class="ctl">\u21b5</span>\n')
        .replace("\t", '<span class="ctl">\u21e5</span>')
    )


def shaded_document(tokens: Sequence[str], scores: np.ndarray | None) -> str:
    """``<span>`` per token, background by its score (scaled by the largest ``|score|``).

    Example:
        >>> page = shaded_document(["a", "<b"], np.array([0.0, -2.0], dtype=np.float32))
        >>> page.count('class="tok"'), "&lt;b" in page, "rgba(210,30,30,0.850)" in page
        (2, True, True)
    """
    if scores is None:
        scores = np.zeros(len(tokens), dtype=np.float32)
    return shaded_spans([_text_html(token) for token in tokens], scores[: len(tokens)])


def _rows(kind: str, items: Sequence[tuple[int, Document, float]]) -> str:
    return table_rows(
        kind,
        [(row, html.escape(doc.name), _text_html(doc.text), score) for row, doc, score in items],
    )


def render_document_report(
    views: Sequence[DocumentView], *, title: str, facts: Mapping[str, Any]
) -> str:
    """The report page as a string (see the module docstring).

    Args:
        views: the queries to show.
        title: the page's heading.
        facts: ``{label: value}`` lines shown under the heading.

    Example:
        >>> doc = Document("q.txt", ("x", " = 1"))
        >>> view = DocumentView(0, doc, None, 0, [(0, doc, 1.0)], [(0, doc, 1.0)])
        >>> page = render_document_report([view], title="t", facts={})
        >>> page.startswith("<!doctype html>"), "q.txt" in page
        (True, True)
    """
    shaded = any(v.token_scores is not None for v in views)
    legend = (
        LEGEND
        if shaded
        else '<p class="legend">No per-token scores were computed (--no-per-token).</p>'
    )
    sections = []
    for i, v in enumerate(views):
        note = (
            f"tokens shaded by proponent 1, training row {v.shaded_by}"
            if v.token_scores is not None
            else f"{len(v.document.tokens)} tokens"
        )
        sections.append(
            f'<section class="query" data-query="{v.query}" data-shaded-by="{v.shaded_by}">'
            f"<h2>Query {i + 1}: {html.escape(v.document.name)}"
            f' <span class="meta">({note})</span></h2>'
            f'<pre class="tokens">{shaded_document(v.document.tokens, v.token_scores)}</pre>'
            "<table><tr><th></th><th>score</th><th>document</th><th>training text</th></tr>"
            f"{_rows('proponent', v.proponents)}{_rows('opponent', v.opponents)}</table>"
            "</section>"
        )
    return page(title, facts, legend, sections)


def write_document_report(path: str | Path, views: Sequence[DocumentView], **kwargs: Any) -> Path:
    """Write :func:`render_document_report` to ``path`` (UTF-8) and return the path."""
    out = Path(path)
    out.write_text(render_document_report(views, **kwargs), encoding="utf-8")
    return out
