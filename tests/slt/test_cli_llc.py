"""run_llc_command: a saved HF model and local text or a saved dataset, end to end."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from _slt_helpers import count_calibrations, tiny_gpt2, tiny_llama, token_data

from gradsketch.cli._slt import load_tokens, run_llc_command
from gradsketch.slt import FewChainsWarning

SMALL = dict(num_chains=2, num_draws=2, batch_size=4, context_length=16, lr=1e-4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model")
    tiny_gpt2().save_pretrained(path)
    return path


def test_llc_from_text_files(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = tmp_path / "corpus"
    text.mkdir()
    (text / "a.py").write_text("def f(x):\n    return x + 1\n" * 20)
    (text / "b.txt").write_text("the quick brown fox jumps over the lazy dog. " * 20)
    out = tmp_path / "out"
    with pytest.warns(FewChainsWarning, match=r"rests on 2 chains \(num_chains=2\)"):
        summary = run_llc_command(model_dir, text, out=out, restriction="l1 attn", **SMALL)
    # Progress bars on stderr, terminal or not: L(w*), then 2 chains x 2 draws.
    err = capsys.readouterr().err
    assert "L(w*)" in err and "sampling" in err and "4/4" in err
    assert summary["tokens_from"] == "bytes"
    assert summary["context_length"] == 16
    assert len(summary["llc_per_chain"]) == 2
    assert summary["selected_weights"] < summary["total_weights"]
    written = json.loads((out / "llc_summary.json").read_text())
    assert written["llc_mean"] == pytest.approx(summary["llc_mean"])
    assert (out / "llc_trace.png").stat().st_size > 0
    # A rerun reuses the completed samples: the same estimate.
    with pytest.warns(FewChainsWarning):
        again = run_llc_command(
            model_dir, text, out=out, restriction="l1 attn", progress=False, **SMALL
        )
    err = capsys.readouterr().err
    assert "sampling" not in err and "L(w*)" not in err
    assert again["llc_mean"] == summary["llc_mean"]


def test_llc_from_a_saved_dataset(model_dir: Path, tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    ids = token_data(16)
    datasets.Dataset.from_dict({"input_ids": ids.tolist()}).save_to_disk(str(tmp_path / "ds"))
    tokens, how = load_tokens(tmp_path / "ds", model_dir, context_length=16, max_sequences=12)
    assert how == "datasets.load_from_disk" and tokens.shape == (12, 17)
    with pytest.warns(FewChainsWarning):
        summary = run_llc_command(
            model_dir, tmp_path / "ds", out=tmp_path / "out", n_beta=5.0, **SMALL
        )
    assert summary["n_beta"] == 5.0 and summary["sequences"] == 16


def test_llc_command_errors(model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no config.json"):
        run_llc_command(tmp_path, tmp_path, out=tmp_path / "o")
    with pytest.raises(FileNotFoundError, match=r"does not exist"):
        run_llc_command(model_dir, tmp_path / "missing", out=tmp_path / "o")
    (tmp_path / "t.txt").write_text("short")
    with pytest.raises(ValueError, match=r"fewer than one sequence of 17"):
        run_llc_command(model_dir, tmp_path / "t.txt", out=tmp_path / "o", context_length=16)
    small = tmp_path / "llama"
    tiny_llama().save_pretrained(small)  # vocabulary of 64: bytes do not fit
    (tmp_path / "u.txt").write_text("zzzz" * 40)
    with pytest.raises(ValueError, match=r"token id 122 but the model's vocabulary has 64"):
        run_llc_command(small, tmp_path / "u.txt", out=tmp_path / "o", **SMALL)


def test_gradsketch_llc_command_takes_a_model_directory(model_dir: Path, tmp_path: Path) -> None:
    """`gradsketch llc MODEL_DIR --dataset TEXT` runs the devinterp-2.0 LLC end to end."""
    from typer.testing import CliRunner

    from gradsketch.cli._app import app

    text = tmp_path / "corpus.txt"
    text.write_text("import os\nprint(os.getcwd())\n" * 40)
    args = ["llc", str(model_dir), "--dataset", str(text), "--out", str(tmp_path / "o")]
    small = ["--num-chains", "2", "--num-draws", "2", "--batch-size", "4"]
    with pytest.warns(FewChainsWarning):
        result = CliRunner().invoke(app, [*args, *small, "--context-length", "16", "--no-verbose"])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "o" / "llc_summary.json").read_text())
    assert len(summary["llc_per_chain"]) == 2
    assert f'"llc_mean": {summary["llc_mean"]}' in result.output
    missing = CliRunner().invoke(app, ["llc", str(model_dir), "--out", str(tmp_path / "p")])
    assert missing.exit_code != 0 and "--dataset" in missing.output


def test_gradsketch_llc_lr_auto_records_the_calibrated_step(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--lr auto` calibrates (gradsketch.slt.sample's lr="auto"); other words are refused.

    The pilot runs are replaced by a counter (tests/slt/test_auto_lr.py runs them for
    real): what is under test is that the command asks for them and records the step.
    """
    from typer.testing import CliRunner

    from gradsketch.cli._app import app

    calls = count_calibrations(monkeypatch, step=3.456e-4)

    text = tmp_path / "corpus.txt"
    text.write_text("import os\nprint(os.getcwd())\n" * 40)
    base = ["llc", str(model_dir), "--dataset", str(text), "--context-length", "16"]
    small = ["--num-chains", "1", "--num-draws", "2", "--batch-size", "4", "--no-verbose"]
    out = tmp_path / "o"
    with pytest.warns(FewChainsWarning, match=r"rests on 1 chain \(num_chains=1\)"):
        result = CliRunner().invoke(app, [*base, *small, "--lr", "auto", "--out", str(out)])
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "llc_summary.json").read_text())
    # The calibrated step, to two significant digits, as recorded by sample().
    assert calls == [1] and summary["lr"] == 3.5e-4
    for bad in ("fast", "0", "-1e-4"):
        refused = CliRunner().invoke(
            app, [*base, *small, "--lr", bad, "--out", str(tmp_path / "p")]
        )
        assert refused.exit_code != 0 and "--lr" in refused.output


def _plain(output: str) -> str:
    """CLI output without rich's error box, its words joined by single spaces."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", output).split())


def test_gradsketch_llc_fast_path_switch(model_dir: Path, tmp_path: Path) -> None:
    """`--fast-path auto|off` reaches sample(fast_path=...): the store's record says which
    ran; other values are refused naming the allowed ones, and so is `off` with a config
    file (its model runs as given); `--help` lists every value sample() takes."""
    from typer.testing import CliRunner

    from gradsketch.cli._app import app
    from gradsketch.slt import FAST_PATHS

    helped = CliRunner().invoke(app, ["llc", "--help"], env={"COLUMNS": "200"})
    assert helped.exit_code == 0 and "--fast-path" in helped.output
    assert all(f"'{value}'" in helped.output for value in FAST_PATHS)
    text = tmp_path / "corpus.txt"
    text.write_text("import os\nprint(os.getcwd())\n" * 40)
    base = ["llc", str(model_dir), "--dataset", str(text), "--context-length", "16"]
    small = ["--num-chains", "1", "--num-draws", "2", "--batch-size", "4", "--no-verbose"]
    out = tmp_path / "o"
    with pytest.warns(FewChainsWarning):
        result = CliRunner().invoke(app, [*base, *small, "--fast-path", "off", "--out", str(out)])
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "llc_summary.json").read_text())
    assert [entry["fast_path"] for entry in summary["fast_path"]] == ["off"]
    for bad in ("on", "OFF", ""):
        refused = CliRunner().invoke(
            app, [*base, *small, "--fast-path", bad, "--out", str(tmp_path / "p")]
        )
        assert refused.exit_code != 0
        assert "--fast-path must be one of auto, off" in _plain(refused.output)
    assert not (tmp_path / "p" / "llc_summary.json").exists()
    config = tmp_path / "config.py"
    config.write_text("raise SystemExit('the config must not be loaded')\n")
    refused = CliRunner().invoke(app, ["llc", str(config), "--fast-path", "off"])
    assert refused.exit_code != 0
    assert "applies to a Hugging Face model directory" in _plain(refused.output)
    with pytest.raises(ValueError, match=r"`fast_path` must be one of \['auto', 'off'\], got 'on'"):
        run_llc_command(model_dir, text, out=tmp_path / "q", fast_path="on")


def test_gradsketch_llc_observables_switch(model_dir: Path, tmp_path: Path) -> None:
    """The command's store holds no observables unless `--observables` asks (the LLC reads
    only the sampling losses): the same estimate either way; refused with a config file."""
    import xarray as xr
    from typer.testing import CliRunner

    from gradsketch.cli._app import app

    text = tmp_path / "corpus.txt"
    text.write_text("import os\nprint(os.getcwd())\n" * 40)
    base = ["llc", str(model_dir), "--dataset", str(text), "--context-length", "16"]
    small = ["--num-chains", "1", "--num-draws", "2", "--batch-size", "4", "--no-verbose"]
    summaries, stored = [], []
    for flag, out in (("--no-observables", tmp_path / "a"), ("--observables", tmp_path / "b")):
        with pytest.warns(FewChainsWarning):
            result = CliRunner().invoke(app, [*base, *small, flag, "--out", str(out)])
        assert result.exit_code == 0, result.output
        summaries.append(json.loads((out / "llc_summary.json").read_text()))
        tree = xr.open_datatree(str(out / "samples.zarr"), engine="zarr", consolidated=False)
        stored.append(set(tree.dataset.data_vars))
    assert summaries[0]["llc_per_chain"] == summaries[1]["llc_per_chain"]
    assert stored[1] - stored[0] == {"loss_train", "input_ids_train"}
    config = tmp_path / "config.py"
    config.write_text("raise SystemExit('the config must not be loaded')\n")
    refused = CliRunner().invoke(app, ["llc", str(config), "--observables"])
    assert refused.exit_code != 0
    assert "--observables applies to a Hugging Face model directory" in _plain(refused.output)
