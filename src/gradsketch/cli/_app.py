"""The typer app behind ``gradsketch demo | sketch-demo | attribute | llc | factorize | bench``.

Each command imports its capability only when run, so ``gradsketch --help``
is instant and a broken optional piece cannot break the others. :func:`run`
(the console script) prints the message alone of an error gradsketch raised
on purpose, and exits with status 1; ``gradsketch --debug ...`` shows the
traceback too.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import typer

from gradsketch.cli._paths import check_folder

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="gradsketch: compressed gradients for attribution, sampling and factorization.",
)

#: Set by ``--debug``: errors show their traceback.
_DEBUG = {"on": False}
#: The package's source folder: errors raised from files below it carry our messages.
_PACKAGE = str(Path(__file__).resolve().parents[1])


def _out_folder(value: Path) -> Path:
    """``--out``: a folder or a path where one can be created (not a file)."""
    try:
        return check_folder(value)
    except NotADirectoryError as err:
        raise typer.BadParameter(str(err), param_hint="--out") from err


_OUT = typer.Option(
    "gradsketch_out", "--out", "-o", help="Output folder (created).", callback=_out_folder
)
_CONFIG = typer.Argument(..., exists=True, dir_okay=False, help="A Python config file.")


@app.callback()
def _options(
    debug: bool = typer.Option(
        False, "--debug", help="Show the full traceback of an error, not its message alone."
    ),
) -> None:
    """gradsketch: compressed gradients for attribution, sampling and factorization."""
    if debug:  # run() takes --debug from anywhere on the line before the app parses it
        _DEBUG["on"] = True


def _ours(error: BaseException) -> bool:
    """Whether ``error`` is one gradsketch raised on purpose, with a message for the user.

    Every :class:`~gradsketch.errors.GradsketchError`; a ``ValueError`` or
    ``TypeError`` raised from gradsketch's own code (its argument checks); and
    file-system errors, whose message names the path.
    """
    from gradsketch.errors import GradsketchError

    if isinstance(error, (GradsketchError, OSError)):
        return True
    if not isinstance(error, (ValueError, TypeError)):
        return False
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and Path(tb.tb_frame.f_code.co_filename).resolve().is_relative_to(
        _PACKAGE
    )


def run(args: Sequence[str] | None = None) -> None:
    """Run the app (the ``gradsketch`` script): our errors print their message alone.

    Exit status 1 with ``Error: <message>`` on stderr; ``--debug`` re-raises
    for the full traceback. Anything else (a bug) keeps its traceback.
    """
    given = list(sys.argv[1:] if args is None else args)
    # Anywhere on the line, not only before the command.
    _DEBUG["on"] = "--debug" in given
    try:
        app(args=[a for a in given if a != "--debug"], prog_name="gradsketch")
    except Exception as error:
        if _DEBUG["on"] or not _ours(error):
            raise
        typer.echo(f"Error: {error}", err=True)
        typer.echo("(gradsketch --debug ... shows the traceback)", err=True)
        raise SystemExit(1) from None


def _fast_path(value: str) -> str:
    """``--fast-path``: one of :data:`gradsketch.slt.FAST_PATHS`."""
    from gradsketch.slt import FAST_PATHS

    if value not in FAST_PATHS:
        raise typer.BadParameter(
            f"--fast-path must be one of {', '.join(FAST_PATHS)}, got {value!r}; e.g. "
            "--fast-path off to run the model's own modules with torch's operations.",
            param_hint="--fast-path",
        )
    return value


def _step_size(lr: str) -> float | str:
    """``--lr``: a positive number, or ``auto``."""
    if lr.strip().lower() == "auto":
        return "auto"
    try:
        value = float(lr)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise typer.BadParameter(
            f"--lr must be a positive number or 'auto', got {lr!r}; e.g. --lr 1e-4.",
            param_hint="--lr",
        )
    return value


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s: %(message)s",
    )
    # Third-party chatter (ArviZ announces optional subpackages) is not progress.
    for noisy in ("arviz", "matplotlib", "numcodecs"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


@app.command()
def demo(
    out: Path = typer.Option(
        "demo_out", "--out", "-o", help="Output folder (created).", callback=_out_folder
    ),
    quick: bool = typer.Option(False, help="Smaller sizes, for a smoke test."),
    lm: bool = typer.Option(
        False, "--lm", help="The language-model job: GPT-2 on the stdlib's sources, HTML report."
    ),
    replay: bool | None = typer.Option(
        None,
        "--replay/--no-replay",
        help="Digits demo: also attribute by exact metagradients through checkpoint 0's "
        "training run (MAGIC; its gallery and LDS beside EK-FAC's); on by default (about "
        "15 s on 2 cores). The --lm job has none.",
    ),
    verbose: bool = typer.Option(True, help="Log progress."),
) -> None:
    """The main job: TRAK attribution on scikit-learn's bundled digits, with LDS and a gallery."""
    _setup_logging(verbose)
    if lm and replay:
        raise typer.BadParameter(
            "--replay adds the replay to the digits demo; the --lm job has no replay. Drop one "
            "of the two flags.",
            param_hint="--replay",
        )
    if lm:
        from gradsketch.demos.lm import run_lm_demo

        result = run_lm_demo(out, quick=quick, progress=verbose)
        typer.echo(f"LDS {result['lds']:.3f}; report: {result['report']}")
        return
    from gradsketch.demos import format_report, run_demo

    summary = run_demo(out, quick=quick, report_replay=replay is not False)
    typer.echo(summary.get("report") or format_report(summary))


@app.command("sketch-demo")
def sketch_demo(
    out: Path = _OUT,
    dim: int = typer.Option(1 << 14, min=1, help="Input dimension d (a positive int)."),
) -> None:
    """Inner-product error against sketch size k for every sketch kind (table, PNG, JSON)."""
    from gradsketch.demos import format_sketch_table, run_sketch_demo

    summary = run_sketch_demo(out, dim=dim)
    typer.echo(format_sketch_table(summary))
    typer.echo(f"plot: {summary['plot']}\nsummary: {Path(out) / 'summary.json'}")


@app.command()
def attribute(
    config: Path | None = typer.Argument(
        None,
        help="A Python config file (CONFIG.py). Leave it out to attribute a Hugging Face model "
        "folder with --model, --train and --queries.",
        show_default=False,
    ),
    out: Path = _OUT,
    model: Path | None = typer.Option(
        None,
        "--model",
        help="A local Hugging Face causal LM folder (save_pretrained), with its tokenizer.",
        show_default=False,
    ),
    train: Path | None = typer.Option(
        None,
        "--train",
        help="Training documents: a datasets folder (save_to_disk), a .jsonl "
        "or .parquet file, or a folder of text files.",
        show_default=False,
    ),
    queries: Path | None = typer.Option(
        None, "--queries", help="Query documents, in any form --train takes.", show_default=False
    ),
    method: str = typer.Option("trak", "--method", help="trak, identity, kfac or ekfac."),
    proj_dim: int | None = typer.Option(
        None, "--proj-dim", help="TRAK's projection size (default 2048).", show_default=False
    ),
    projection: str | None = typer.Option(
        None,
        "--projection",
        help="Per-layer methods: K_IN,K_OUT projects each layer's rows "
        "(e.g. 16,16), or exact; default exact rows where they fit the disk, else 16,16.",
        show_default=False,
    ),
    max_length: int = typer.Option(128, "--max-length", help="Tokens per document."),
    text_column: str = typer.Option("text", "--text-column", help="The column of text."),
    top_k: int = typer.Option(5, "--top-k", help="Proponents and opponents per query."),
    memory_budget: int | None = typer.Option(
        None,
        "--memory-budget",
        help="Bytes of working memory for finalize and scoring blocks.",
        show_default=False,
    ),
    batch_size: int = typer.Option(8, "--batch-size", help="Documents per featurize call."),
    grad_wrt: str | None = typer.Option(
        None,
        "--grad-wrt",
        help="'|'-separated parameter-name patterns, e.g. "
        "'*.h.*.attn.c_attn.weight|*.h.*.mlp.c_fc.weight'.",
        show_default=False,
    ),
    lambda_reg: str | None = typer.Option(
        None,
        "--lambda-reg",
        help="Damping: a number >= 0 or 'auto' (default: the method's).",
        show_default=False,
    ),
    per_token: bool = typer.Option(
        False,
        help="Also score each query token, shaded in the report: T gradients per query, T at a "
        "time (memory: about max-length / batch-size times the plan's gradients).",
    ),
    device: str | None = typer.Option(
        None, "--device", help="torch device (default: CUDA when available).", show_default=False
    ),
    verbose: bool = True,
) -> None:
    """Attribute with CONFIG.py, or a local Hugging Face LM over local documents.

    CONFIG.py: your own model, checkpoints and loaders; TRAK by default,
    `method = "ekfac"` (or another method) in the config picks another, and
    `method = "replay"` trains and replays the run it describes.

    --model DIR --train DATA --queries DATA: prints the plan, builds (or
    resumes) the store in --out, and writes each query's top-k proponents and
    opponents as topk.json and report.html.
    """
    _setup_logging(verbose)
    hf = {"--model": model, "--train": train, "--queries": queries}
    if config is not None and config.suffix == ".py":
        given = [name for name, value in hf.items() if value is not None]
        if given:
            raise typer.BadParameter(
                f"{config} is a config file, which defines the model and data itself; drop "
                f"{', '.join(given)}, or drop the config to attribute a model folder.",
                param_hint="CONFIG",
            )
        if not config.is_file():
            raise typer.BadParameter(
                f"config file {config} does not exist; pass an existing .py file (template: "
                "examples/attribute_config.py).",
                param_hint="CONFIG",
            )
        from gradsketch._distributed import process_group_from_env, rank
        from gradsketch.cli._attribute import attribute_command

        # Under torchrun (RANK/WORLD_SIZE set) the TRAKer shards the work across ranks.
        with process_group_from_env():
            summary = attribute_command(config, out, progress=rank() == 0)
            if rank() == 0:
                typer.echo(summary.get("report") or json.dumps(summary, indent=2, default=str))
        return
    if config is not None:
        if not config.is_dir() or model is not None:
            raise typer.BadParameter(
                f"{config} is not a .py config file; pass CONFIG.py, or a model folder with "
                "--model DIR --train DATA --queries DATA.",
                param_hint="CONFIG",
            )
        hf["--model"] = model = config
    missing = [name for name, value in hf.items() if value is None]
    if missing:
        raise typer.BadParameter(
            f"attributing a model folder needs --model DIR --train DATA --queries DATA; missing "
            f"{', '.join(missing)}. Or pass a CONFIG.py.",
            param_hint=missing[0],
        )
    from gradsketch.cli._attribute_hf import attribute_hf_command, parse_lambda, parse_projection

    assert model is not None and train is not None and queries is not None
    summary = attribute_hf_command(
        model,
        train,
        queries,
        out,
        progress=verbose,
        echo=typer.echo,
        method=method,
        proj_dim=proj_dim,
        projection=parse_projection(projection),
        max_length=max_length,
        text_column=text_column,
        top_k=top_k,
        memory_budget=memory_budget,
        batch_size=batch_size,
        grad_wrt=grad_wrt,
        lambda_reg=parse_lambda(lambda_reg),
        per_token=per_token,
        device=device,
    )
    typer.echo(summary["report"])


@app.command()
def llc(
    target: Path = typer.Argument(
        ...,
        exists=True,
        help="A Python config file, or a Hugging Face model directory (save_pretrained).",
    ),
    out: Path = _OUT,
    dataset: Path | None = typer.Option(
        None,
        exists=True,
        help="With a model directory: a datasets directory (save_to_disk, input_ids) or text.",
    ),
    restriction: str = typer.Option("full", help="Weights to sample, e.g. 'l0 attn' or 'l0h1'."),
    lr: str = typer.Option(
        "1e-4", help="SGLD step size, or 'auto' (calibrated from SGLD pilots; model directories)."
    ),
    localization: float = typer.Option(100.0, help="Localization strength gamma."),
    num_chains: int = typer.Option(4, help="Chains."),
    num_draws: int = typer.Option(200, help="Draws per chain."),
    batch_size: int = typer.Option(32, help="Sequences per step."),
    context_length: int = typer.Option(64, help="Tokens per sequence cut from text."),
    fast_path: str = typer.Option(
        "auto",
        "--fast-path",
        help="'auto': faster train-mode kernels where they engage (CPU); 'off': the model's "
        "own modules and torch's operations (model directories).",
        callback=_fast_path,
    ),
    observables: bool = typer.Option(
        False,
        help="Also record, at every draw, the per-token losses of 3 fixed batches (devinterp's "
        "'train' observable) in samples.zarr; the LLC does not read them (model directories).",
    ),
    verbose: bool = True,
) -> None:
    """Estimate the local learning coefficient: of the model in CONFIG.py, or of a local HF LM.

    With a config file, writes JSON and a plot as `llc_summary.json` and
    `llc_trace.png`. With a Hugging Face model directory and `--dataset`,
    runs devinterp 2.0's `llc` on gradsketch (`gradsketch.slt`) and also keeps
    the sample store `samples.zarr` (a rerun reuses it, a killed one resumes).
    """
    _setup_logging(verbose)
    if target.is_dir():
        if dataset is None:
            raise typer.BadParameter(
                f"{target} is a model directory; pass the data with --dataset DIR_OR_TEXT.",
                param_hint="--dataset",
            )
        from gradsketch.cli._slt import run_llc_command

        result = run_llc_command(
            target,
            dataset,
            out=out,
            restriction=restriction,
            lr=_step_size(lr),
            localization=localization,
            num_chains=num_chains,
            num_draws=num_draws,
            batch_size=batch_size,
            context_length=context_length,
            progress=verbose,
            fast_path=fast_path,
            observables=observables,
        )
        typer.echo(json.dumps(result, indent=2, default=str))
        return
    if observables:
        raise typer.BadParameter(
            f"--observables applies to a Hugging Face model directory (gradsketch.slt); {target} "
            "is a config file, whose LLC records no observables: drop --observables.",
            param_hint="--observables",
        )
    if fast_path != "auto":
        raise typer.BadParameter(
            f"--fast-path {fast_path} applies to a Hugging Face model directory (gradsketch.slt); "
            f"{target} is a config file, whose model runs as given: drop --fast-path.",
            param_hint="--fast-path",
        )
    from gradsketch._distributed import barrier, process_group_from_env, rank
    from gradsketch.cli._llc import llc_command

    with process_group_from_env():
        summary_path = Path(llc_command(target, out))
        # Rank 0 writes the summary; the others wait so the job ends together.
        barrier()
        first = rank() == 0
    if not first:
        return
    summary = json.loads(summary_path.read_text())
    # Non-finite values are stored as "nan" / "inf" strings (see gradsketch._json).
    mean, std, ess, rhat = (
        float(summary.get(key, "nan")) for key in ("llc/mean", "llc/std", "llc/ess", "llc/rhat")
    )
    typer.echo(f"LLC = {mean:.4g} +- {std:.2g} (ESS {ess:.0f}, R-hat {rhat:.3f})")
    typer.echo(f"summary: {summary_path}")


@app.command()
def factorize(config: Path = _CONFIG, out: Path = _OUT, verbose: bool = True) -> None:
    """Factorize the Linear/Conv2d layers of the model in CONFIG.py; saves state_dict + report."""
    _setup_logging(verbose)
    from gradsketch.cli._factorize import factorize_command

    typer.echo(str(factorize_command(config, out, progress=verbose)))


@app.command()
def bench(
    name: str = typer.Argument("all", help="projection, attribution, sampling, masked, ..."),
    folder: Path = typer.Option(Path("benchmarks"), help="The repository's benchmarks folder."),
) -> None:
    """Run benchmark scripts from a source checkout (they print JSON lines)."""
    scripts = sorted(folder.glob("bench_*.py"))
    if name != "all":
        scripts = [s for s in scripts if s.stem == f"bench_{name}"]
    if not scripts:
        available = ", ".join(
            s.stem.removeprefix("bench_") for s in sorted(folder.glob("bench_*.py"))
        )
        raise typer.BadParameter(
            f"no benchmark {name!r} in {folder}; available: {available or 'none (wrong folder?)'}",
            param_hint="NAME",
        )
    for script in scripts:
        code = subprocess.call([sys.executable, str(script)])
        if code:
            raise typer.Exit(code)
