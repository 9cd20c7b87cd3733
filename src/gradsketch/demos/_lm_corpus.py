"""The language-model demo's corpus: the Python standard library's own source.

Every machine that runs gradsketch has the standard library's ``.py`` files
(``sysconfig.get_paths()["stdlib"]``), so the demo needs no download. The
selection is a fixed list of small, self-contained pure-Python modules
(:data:`STDLIB_MODULES`); each file is read as bytes (byte-level tokens,
ids ``0..255``) and cut into non-overlapping chunks of ``chunk_len`` bytes
from its start, the last partial chunk dropped. The chunks of all files, in
the order of the list, are the pool from which :func:`split_chunks` draws
the training and held-out query chunks with a seeded permutation.

The text differs between Python versions, so :func:`load_corpus` records
each file's SHA-256 and the interpreter's version alongside the chunks.
"""

from __future__ import annotations

import hashlib
import platform
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from gradsketch.demos._errors import CorpusError

#: Standard-library modules the demo reads, relative to the stdlib folder:
#: pure Python, no generated code, one topic each (text, data structures,
#: encodings), about 170 kB in all.
STDLIB_MODULES: tuple[str, ...] = (
    "textwrap.py",
    "shlex.py",
    "fnmatch.py",
    "glob.py",
    "bisect.py",
    "heapq.py",
    "colorsys.py",
    "base64.py",
    "json/encoder.py",
    "json/decoder.py",
    "string.py",
    "copy.py",
    "queue.py",
    "sched.py",
    "graphlib.py",
)

#: Byte values are tokens ``0..255``; one more id serves as end-of-text / padding.
BYTE_VOCAB = 256
EOS_ID = 256


@dataclass(frozen=True)
class Chunk:
    """One ``chunk_len``-byte piece of a source file.

    Attributes:
        source: the file, relative to the stdlib folder (``"json/encoder.py"``).
        offset: byte offset of the chunk in the file.
        line: 1-based line number of the chunk's first byte.
        data: the chunk's bytes.
    """

    source: str
    offset: int
    line: int
    data: bytes


@dataclass(frozen=True)
class Corpus:
    """Chunks of the selected files and where they came from.

    Attributes:
        chunks: every chunk, in file order.
        chunk_len: bytes (tokens) per chunk.
        files: ``{relative path: sha256 hex}`` of the files read.
        stdlib: the folder they were read from.
        python: the interpreter version whose stdlib this is.
    """

    chunks: tuple[Chunk, ...]
    chunk_len: int
    files: dict[str, str]
    stdlib: str
    python: str

    def __len__(self) -> int:
        return len(self.chunks)

    def token_ids(self, indices: Sequence[int] | np.ndarray | None = None) -> Tensor:
        """``[len(indices), chunk_len]`` int64 token ids (byte values) of the chunks."""
        rows = range(len(self.chunks)) if indices is None else [int(i) for i in indices]
        buf = b"".join(self.chunks[i].data for i in rows)
        flat = np.frombuffer(buf, dtype=np.uint8).astype(np.int64)
        return torch.from_numpy(flat.reshape(len(rows), self.chunk_len))


def stdlib_dir() -> Path:
    """The folder of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def chunk_bytes(data: bytes, source: str, chunk_len: int) -> list[Chunk]:
    r"""Non-overlapping ``chunk_len``-byte chunks of ``data`` (a trailing partial one dropped).

    Example:
        >>> [(c.offset, c.line, c.data) for c in chunk_bytes(b"ab\ncd\nef", "x.py", 3)]
        [(0, 1, b'ab\n'), (3, 2, b'cd\n')]
    """
    if isinstance(chunk_len, bool) or not isinstance(chunk_len, int) or chunk_len < 2:
        raise CorpusError(f"`chunk_len` must be an int >= 2, got {chunk_len!r}.")
    out = []
    line = 1
    for offset in range(0, len(data) - chunk_len + 1, chunk_len):
        out.append(Chunk(source, offset, line, data[offset : offset + chunk_len]))
        line += data.count(b"\n", offset, offset + chunk_len)
    return out


def load_corpus(
    modules: Sequence[str] = STDLIB_MODULES,
    *,
    chunk_len: int = 64,
    root: str | Path | None = None,
) -> Corpus:
    """Read ``modules`` from the standard library and cut them into chunks.

    Args:
        modules: file paths relative to ``root``.
        chunk_len: bytes (tokens) per chunk.
        root: the folder to read from (default: :func:`stdlib_dir`).

    Returns:
        The :class:`Corpus`.

    Raises:
        CorpusError: a file is missing.

    Example:
        >>> corpus = load_corpus(["bisect.py"], chunk_len=64)
        >>> corpus.chunks[0].source, corpus.chunks[0].line, corpus.token_ids([0, 1]).shape
        ('bisect.py', 1, torch.Size([2, 64]))
    """
    base = Path(root) if root is not None else stdlib_dir()
    chunks: list[Chunk] = []
    files: dict[str, str] = {}
    for name in modules:
        path = base / name
        if not path.is_file():
            raise CorpusError(
                f"`modules` names {name!r}, which is not a file under {str(base)!r}; pass paths "
                f"relative to the standard library folder, such as {STDLIB_MODULES[0]!r}."
            )
        data = path.read_bytes()
        files[name] = hashlib.sha256(data).hexdigest()
        chunks.extend(chunk_bytes(data, name, chunk_len))
    return Corpus(tuple(chunks), chunk_len, files, str(base), platform.python_version())


def split_chunks(
    num_chunks: int, num_train: int, num_queries: int, *, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint sorted training and query chunk indices from a seeded permutation.

    The first ``num_queries`` entries of ``default_rng(seed).permutation``
    are the held-out queries, the next ``num_train`` the training set.

    Example:
        >>> train, query = split_chunks(10, 6, 2, seed=0)
        >>> len(train), len(query), len(set(train) & set(query))
        (6, 2, 0)
    """
    for name, value in (("num_train", num_train), ("num_queries", num_queries)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CorpusError(f"`{name}` must be a positive int, got {value!r}.")
    if num_train + num_queries > num_chunks:
        raise CorpusError(
            f"`num_train` + `num_queries` = {num_train + num_queries} exceeds the {num_chunks} "
            "chunks of the corpus; ask for fewer or add modules."
        )
    perm = np.random.default_rng(seed).permutation(num_chunks)
    query = np.sort(perm[:num_queries])
    train = np.sort(perm[num_queries : num_queries + num_train])
    return train, query
