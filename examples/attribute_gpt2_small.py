"""Attribute a 124M-parameter language model over a `datasets` corpus, in one command.

Builds GPT-2 small (12 layers x 768, vocabulary 50,257) or, with
``--family pythia``, Pythia-160M (GPT-NeoX: rotary position on a quarter of
each head, parallel residual, untied output embedding, vocabulary 50,304)
from its config, randomly initialised (nothing is downloaded), or loads your
own trained model folder with ``--model DIR``. The corpus is the Python
standard library's own source (present on every machine), cut into
documents and saved as ``datasets`` folders; the attribution is then
exactly what

    gradsketch attribute --model OUT/model --train OUT/train --queries OUT/queries

does: it prints the plan (disk, memory and time per document), builds the
store with progress bars and writes each query's top-k proponents and
opponents to ``OUT/topk.json`` and ``OUT/report.html``.

A random model attributes by token statistics only; bring a trained one
(``--model DIR``, with its tokenizer) for attributions that mean something.

    python examples/attribute_gpt2_small.py --documents 16              # the 124M shape
    python examples/attribute_gpt2_small.py --layers 2 --documents 4    # a smoke test
    python examples/attribute_gpt2_small.py --family pythia --method ekfac
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import torch
from torch import nn

#: Standard-library files the corpus is cut from (pure Python, one topic each).
STDLIB_FILES = ("textwrap.py", "shlex.py", "fnmatch.py", "bisect.py", "heapq.py", "base64.py")
#: Characters per document: about 128 tokens of Python source for GPT-2's tokenizer.
DOC_CHARS = 480

#: The published shapes: GPT-2 small and Pythia-160M.
SHAPES: dict[str, dict[str, int]] = {
    "gpt2": {"layers": 12, "width": 768, "heads": 12, "vocab": 50_257, "positions": 1024},
    "pythia": {"layers": 12, "width": 768, "heads": 12, "vocab": 50_304, "positions": 2048},
}

#: The blocks' linear weights: what Kronfluence and bergson attribute through by default
#: (the vocabulary-sized embedding and head stay out).
GRAD_WRT = {
    "gpt2": "*.h.*.attn.c_attn.weight|*.h.*.attn.c_proj.weight|*.h.*.mlp.c_fc.weight"
    "|*.h.*.mlp.c_proj.weight",
    "pythia": "*.layers.*.attention.query_key_value.weight|*.layers.*.attention.dense.weight"
    "|*.layers.*.mlp.dense_h_to_4h.weight|*.layers.*.mlp.dense_4h_to_h.weight",
}


def build_model(family: str, *, seed: int = 0, **sizes: int) -> nn.Module:
    """A randomly initialised GPT-2 small or Pythia-160M; ``sizes`` override the shape.

    Example:
        >>> with torch.device("meta"):
        ...     model = build_model("gpt2")
        >>> sum(p.numel() for p in model.parameters())
        124439808
    """
    shape = {**SHAPES[family], **sizes}
    torch.manual_seed(seed)
    if family == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        model = GPT2LMHeadModel(
            GPT2Config(
                n_layer=shape["layers"],
                n_embd=shape["width"],
                n_head=shape["heads"],
                vocab_size=shape["vocab"],
                n_positions=shape["positions"],
                bos_token_id=0,
                eos_token_id=0,
            )
        )
        # GPT-2 ties its LM head to the token embedding; transformers 5.0 does not tie
        # a model built on the meta device at construction, so tie it here.
        model.tie_weights()
        return model
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    return GPTNeoXForCausalLM(
        GPTNeoXConfig(
            num_hidden_layers=shape["layers"],
            hidden_size=shape["width"],
            num_attention_heads=shape["heads"],
            intermediate_size=4 * shape["width"],
            vocab_size=shape["vocab"],
            max_position_embeddings=shape["positions"],
            rotary_pct=0.25,
            use_parallel_residual=True,
            tie_word_embeddings=False,
            bos_token_id=0,
            eos_token_id=0,
        )
    )


def stdlib_documents(count: int, *, queries: bool = False) -> tuple[list[str], list[str]]:
    """``count`` documents of :data:`DOC_CHARS` characters of stdlib source, and their names.

    Training documents are the even pieces of the files, queries the odd ones:
    each query's neighbours in its file are training documents.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, names = [], []
    for name in STDLIB_FILES:
        source = (root / name).read_text(encoding="utf-8")
        for start in range(0, len(source) - DOC_CHARS + 1, DOC_CHARS):
            texts.append(source[start : start + DOC_CHARS])
            names.append(f"{name}:{source.count(chr(10), 0, start) + 1}")
    picked = list(range(1 if queries else 0, len(texts), 2))
    if count > len(picked):
        raise SystemExit(
            f"{'--queries' if queries else '--documents'} {count} is more than the corpus's "
            f"{len(picked)}; pass fewer."
        )
    return [texts[i] for i in picked[:count]], [names[i] for i in picked[:count]]


def train_tokenizer(texts: list[str], vocab: int) -> Any:
    """A byte-level BPE tokenizer trained on ``texts`` (GPT-2's kind; no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=min(vocab, 4096),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=sorted(SHAPES), default="gpt2")
    parser.add_argument(
        "--model", type=Path, help="your own save_pretrained folder (of --family's kind)"
    )
    parser.add_argument("--layers", type=int, help="fewer blocks, for a quick run")
    parser.add_argument("--documents", type=int, default=16, help="training documents")
    parser.add_argument("--queries", type=int, default=4, help="query documents")
    parser.add_argument("--method", default="trak", help="trak, identity, kfac or ekfac")
    parser.add_argument("--max-length", type=int, default=128, help="tokens per document")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=3)
    parser.add_argument(
        "--per-token", action="store_true", help="shade query tokens (T gradients per query)"
    )
    parser.add_argument("--out", type=Path, default=Path("attribute_gpt2_out"))
    args = parser.parse_args(argv)

    import datasets

    args.out.mkdir(parents=True, exist_ok=True)
    train_texts, train_names = stdlib_documents(args.documents)
    query_texts, query_names = stdlib_documents(args.queries, queries=True)
    for name, texts, names in (
        ("train", train_texts, train_names),
        ("queries", query_texts, query_names),
    ):
        table = datasets.Dataset.from_dict({"text": texts, "source": names})
        table.save_to_disk(str(args.out / name))
    model_dir = args.model
    if model_dir is None:
        model_dir = args.out / "model"
        sizes = {} if args.layers is None else {"layers": args.layers}
        model = build_model(args.family, **sizes)
        tokenizer = train_tokenizer(train_texts, SHAPES[args.family]["vocab"])
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        params = sum(p.numel() for p in model.parameters())
        print(f"{args.family}: {params:,} parameters (random init) saved to {model_dir}")
        del model
    command = [
        *("gradsketch", "attribute", "--model", str(model_dir)),
        *("--train", str(args.out / "train"), "--queries", str(args.out / "queries")),
        *("--out", str(args.out), "--method", args.method, "--lambda-reg", "auto"),
        *("--max-length", str(args.max_length), "--batch-size", str(args.batch_size)),
        *("--top-k", str(args.top_k)),
    ]
    if args.method in ("identity", "kfac", "ekfac"):
        command += ["--projection", "16,16"]  # LoGra's per-layer projection, as bergson's
    command += ["--grad-wrt", GRAD_WRT[args.family]]  # --family names your --model's family
    if args.per_token:
        command.append("--per-token")
    print("$ " + " ".join(shlex.quote(c) for c in command), flush=True)
    # The command itself (python -m gradsketch.cli is the `gradsketch` script).
    subprocess.run([sys.executable, "-m", "gradsketch.cli", *command[1:]], check=True)
    top = json.loads((args.out / "topk.json").read_text())
    for query in top["queries"]:
        best = ", ".join(f"{p['name']} ({p['score']:+.3g})" for p in query["proponents"])
        print(f"{query['name']}: {best}")
    return top


if __name__ == "__main__":
    main()
