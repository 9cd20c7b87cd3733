"""The language-model demo's HTML report: one self-contained page, no external assets.

For each query chunk the page shows its tokens (bytes) shaded by their
per-token attribution to the query's top proponent (green: that training
chunk raised the token's log-odds, red: lowered it; opacity proportional to
``|score| / max |score|`` over the query's tokens), and a table of its top
proponents and opponents with their scores, source file and line, and text.

Every number shown is also written, unrounded, in a ``data-score``
attribute (``repr`` of the float32 score as a Python float), so a test can
read the rendered page back and compare it with the ``scores`` arrays.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gradsketch.demos._lm_corpus import Chunk

_CSS = """
body { font-family: system-ui, sans-serif; margin: 24px; color: #1b1b1b; max-width: 1150px; }
h1 { font-size: 22px; margin-bottom: 4px; }
h2 { font-size: 16px; margin: 0 0 6px 0; }
.meta { color: #555; font-size: 13px; }
section.query { border: 1px solid #ccc; border-radius: 6px; padding: 12px; margin: 18px 0; }
pre { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 12px; margin: 0;
      white-space: pre-wrap; word-break: break-all; }
pre.tokens { font-size: 14px; line-height: 1.6; padding: 6px; background: #fafafa; }
span.tok { border-radius: 2px; }
span.ctl { color: #999; }
table { border-collapse: collapse; width: 100%; margin-top: 8px; font-size: 13px; }
th, td { border-top: 1px solid #e4e4e4; padding: 4px 6px; text-align: left; vertical-align: top; }
td.score { font-variant-numeric: tabular-nums; white-space: nowrap; }
tr.proponent td.kind { color: #0a7a0a; font-weight: 600; }
tr.opponent td.kind { color: #b01818; font-weight: 600; }
td.src { white-space: nowrap; color: #333; }
.legend span { padding: 0 6px; border-radius: 2px; }
"""


@dataclass(frozen=True)
class QueryView:
    """What the report shows of one query.

    Attributes:
        query: the query's column in the score arrays.
        chunk: the query chunk.
        token_scores: ``[T]`` per-token scores used to shade its tokens.
        shaded_by: the training row whose per-token scores those are.
        proponents: ``[(train row, chunk, score)]``, highest score first.
        opponents: ``[(train row, chunk, score)]``, lowest score first.
        log_likelihood: the query's summed log-likelihood under the model.
    """

    query: int
    chunk: Chunk
    token_scores: np.ndarray
    shaded_by: int
    proponents: Sequence[tuple[int, Chunk, float]]
    opponents: Sequence[tuple[int, Chunk, float]]
    log_likelihood: float


def _byte_html(b: int) -> str:
    """A byte as visible text: printable ASCII as is, controls as symbols."""
    if b == 10:
        return '<span class="ctl">\u21b5</span>\n'
    if b == 9:
        return '<span class="ctl">\u21e5</span>'
    if 32 <= b < 127:
        return html.escape(chr(b))
    return f'<span class="ctl">\\x{b:02x}</span>'


def _shade(score: float, scale: float) -> str:
    if scale <= 0 or score == 0:
        return "transparent"
    alpha = min(1.0, abs(score) / scale) * 0.85
    rgb = "0,160,60" if score > 0 else "210,30,30"
    return f"rgba({rgb},{alpha:.3f})"


def shaded_tokens(data: bytes, scores: np.ndarray) -> str:
    """``<span>`` per byte, background by its score (scaled by the largest ``|score|``).

    Example:
        >>> page = shaded_tokens(b"a<", np.array([0.0, -2.0], dtype=np.float32))
        >>> page.count('class="tok"'), "&lt;" in page, "rgba(210,30,30,0.850)" in page
        (2, True, True)
    """
    return shaded_spans([_byte_html(b) for b in data], scores)


def shaded_spans(pieces: Sequence[str], scores: np.ndarray) -> str:
    """``<span>`` per token's HTML in ``pieces``, shaded as :func:`shaded_tokens` shades."""
    scale = float(np.abs(scores).max()) if scores.size else 0.0
    parts = []
    for t, piece in enumerate(pieces):
        s = float(scores[t])
        parts.append(
            f'<span class="tok" data-t="{t}" data-score="{s!r}" '
            f'style="background:{_shade(s, scale)}" title="token {t}: {s:.3g}">'
            f"{piece}</span>"
        )
    return "".join(parts)


def _chunk_text(data: bytes) -> str:
    return "".join(_byte_html(b) for b in data)


def _rows(kind: str, items: Sequence[tuple[int, Chunk, float]]) -> str:
    return table_rows(
        kind,
        [
            (row, f"{html.escape(chunk.source)}:{chunk.line}", _chunk_text(chunk.data), score)
            for row, chunk, score in items
        ],
    )


def table_rows(kind: str, items: Sequence[tuple[int, str, str, float]]) -> str:
    """A ``<tr>`` per ``(train row, source HTML, text HTML, score)``, ranked from 1."""
    out = []
    for rank, (row, source, text, score) in enumerate(items, 1):
        out.append(
            f'<tr class="{kind}" data-train-row="{row}" data-score="{float(score)!r}">'
            f'<td class="kind">{kind} {rank}</td><td class="score">{score:+.4g}</td>'
            f'<td class="src">{source}</td><td><pre>{text}</pre></td></tr>'
        )
    return "".join(out)


def render_report(views: Sequence[QueryView], *, title: str, facts: Mapping[str, Any]) -> str:
    """The report page as a string (see the module docstring).

    Args:
        views: the queries to show.
        title: the page's heading.
        facts: ``{label: value}`` lines shown under the heading.
    """
    sections = []
    for i, v in enumerate(views):
        sections.append(
            f'<section class="query" data-query="{v.query}" data-shaded-by="{v.shaded_by}">'
            f"<h2>Query {i + 1}: {html.escape(v.chunk.source)}:{v.chunk.line}"
            f' <span class="meta">(log-likelihood {v.log_likelihood:.1f} nats; tokens shaded '
            f"by proponent 1, training chunk {v.shaded_by})</span></h2>"
            f'<pre class="tokens">{shaded_tokens(v.chunk.data, v.token_scores)}</pre>'
            "<table><tr><th></th><th>score</th><th>source</th><th>training chunk</th></tr>"
            f"{_rows('proponent', v.proponents)}{_rows('opponent', v.opponents)}</table>"
            "</section>"
        )
    return page(title, facts, LEGEND, sections)


#: The legend of shaded query tokens.
LEGEND = (
    '<p class="legend">Query tokens are shaded by their per-token score for the top '
    'proponent: <span style="background:rgba(0,160,60,.6)">raised the token\'s '
    'log-odds</span> <span style="background:rgba(210,30,30,.6)">lowered it</span>. '
    "\u21b5 is a newline. Hover a token for its score.</p>"
)


def page(title: str, facts: Mapping[str, Any], legend: str, sections: Sequence[str]) -> str:
    """The whole HTML page: heading, ``facts`` lines, the legend and the query sections."""
    head = "".join(
        f"<div><b>{html.escape(str(k))}</b>: {html.escape(str(v))}</div>" for k, v in facts.items()
    )
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>"
        f'<h1>{html.escape(title)}</h1><div class="meta">{head}</div>{legend}'
        + "".join(sections)
        + "</body></html>\n"
    )


def query_views(
    scores: np.ndarray,
    token_scores: np.ndarray,
    train_chunks: Sequence[Chunk],
    query_chunks: Sequence[Chunk],
    log_likelihoods: Sequence[float] | np.ndarray,
    *,
    top_k: int,
    queries: Sequence[int],
) -> list[QueryView]:
    """The :class:`QueryView` of each of ``queries`` from the score arrays.

    Args:
        scores: ``[n_train, n_queries]`` scores.
        token_scores: ``[n_train, n_queries, T]`` per-token scores.
        train_chunks: the ``n_train`` training chunks, in row order.
        query_chunks: the ``n_queries`` query chunks.
        log_likelihoods: ``[n_queries]`` summed log-likelihoods.
        top_k: proponents and opponents listed per query.
        queries: the query columns to show.
    """
    views = []
    for j in queries:
        column = scores[:, j]
        # Stable sorts: ties keep row order, so the report is deterministic.
        order = np.argsort(-column, kind="stable")
        low = np.argsort(column, kind="stable")
        pro = [(int(i), train_chunks[int(i)], float(column[i])) for i in order[:top_k]]
        opp = [(int(i), train_chunks[int(i)], float(column[i])) for i in low[:top_k]]
        best = int(order[0])
        views.append(
            QueryView(
                query=int(j),
                chunk=query_chunks[int(j)],
                token_scores=np.asarray(token_scores[best, j], dtype=np.float32),
                shaded_by=best,
                proponents=pro,
                opponents=opp,
                log_likelihood=float(log_likelihoods[int(j)]),
            )
        )
    return views


def write_report(path: str | Path, views: Sequence[QueryView], **kwargs: Any) -> Path:
    """Write :func:`render_report` to ``path`` (UTF-8) and return the path."""
    out = Path(path)
    out.write_text(render_report(views, **kwargs), encoding="utf-8")
    return out
