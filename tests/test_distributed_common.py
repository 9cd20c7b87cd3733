"""The ground-floor ``gradsketch._distributed`` helpers, in one process and under torchrun.

Single-process behaviour (no group, a real one-rank gloo group, the
environment checks of ``init_from_env``) runs in this process; one
``torchrun --nproc_per_node 2`` launch runs this very file as its script
(see ``_worker``): it checks every collective across two gloo ranks and then
runs ``gradsketch attribute CONFIG.py`` through the CLI, whose scores must
equal the one-process command's bit for bit.
"""

from __future__ import annotations

import ast
import json
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import zarr

import gradsketch._distributed as common
import gradsketch.attribution
import gradsketch.attribution._distributed
import gradsketch.sampling._distributed

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers.launch import free_port, one_thread, torchrun
from helpers.numerics import trak_score_tolerance

WORLD = 2

# Checkpoints are built in memory (no files), so two ranks importing the config
# never race on writing the same checkpoint file.
CONFIG = """
from gradsketch.demos import (
    TrainSettings, build_mlp, load_digits_split, make_loader, train_model,
)

_split = load_digits_split(seed=0)
_x, _y = _split.x_train[:48], _split.y_train[:48]

def build_model():
    return build_mlp(hidden=16, seed=0)

_fast = TrainSettings(epochs=2, batch_size=16)
_trained = train_model(build_model(), _x, _y, seed=0, settings=_fast)
checkpoints = [_trained.state_dict(), build_mlp(hidden=16, seed=1).state_dict()]
train_loader = make_loader(_x, _y, batch_size=16)
target_loader = make_loader(_split.x_test[:6], _split.y_test[:6], batch_size=4)
task = "image_classification"
proj_dim = 16
"""


@pytest.fixture
def no_torchrun_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """An environment without torchrun's variables, whatever launched pytest."""
    for name in (*common.TORCHRUN_VARIABLES, "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# -- one process -------------------------------------------------------------


def test_one_error_class_for_the_whole_package():
    cls = common.DistributedMismatchError
    assert issubclass(cls, RuntimeError)
    assert gradsketch.attribution.DistributedMismatchError is cls
    assert gradsketch.attribution._distributed.DistributedMismatchError is cls
    assert gradsketch.sampling._distributed.DistributedMismatchError is cls


def test_module_is_ground_floor():
    """It imports no capability of gradsketch (only the ground-floor errors and checks),
    so attribution and sampling can both use it."""
    tree = ast.parse(Path(common.__file__).read_text())
    imported = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    ground = {"gradsketch.errors", "gradsketch._checks"}
    assert not [name for name in imported if name.startswith("gradsketch") and name not in ground]


def test_no_group_helpers_are_identities(no_torchrun_env):
    assert not common.is_distributed()
    assert (common.rank(), common.world_size(), common.rank_and_world()) == (0, 1, (0, 1))
    assert common.local_rank() == 0
    common.barrier()
    value = {"a": [1, 2]}
    assert common.broadcast_object(value) is value
    assert common.all_gather_object(value) == [value]
    with common.rank_zero_first() as first:
        assert first
    common.require_same_across_ranks("anything", object())  # a world of one always agrees


def test_one_rank_group_is_a_world_of_one(one_rank_group):
    assert common.is_distributed() and common.rank_and_world() == (0, 1)
    common.barrier()
    assert common.broadcast_object("x") == "x"
    assert common.all_gather_object(3) == [3]
    with common.rank_zero_first() as first:
        assert first
    common.require_same_across_ranks("seed", 3)


def test_local_rank_reads_torchrun_variable(no_torchrun_env):
    no_torchrun_env.setenv("LOCAL_RANK", "3")
    assert common.local_rank() == 3


# -- agreement checks (other ranks simulated by patching the gather) ---------


def _two_ranks(monkeypatch: pytest.MonkeyPatch, other: object) -> None:
    monkeypatch.setattr(common, "all_gather_object", lambda value: [value, other])


def test_equal_values_pass(monkeypatch):
    _two_ranks(monkeypatch, {"seed": 1, "chains": 4})
    common.require_same_across_ranks("settings", {"seed": 1, "chains": 4})


MISMATCHES = [
    pytest.param(
        "a", "b", r"^fingerprint differs across ranks \(rank 0: 'a', rank 1: 'b'\)\. ", id="plain"
    ),
    pytest.param(
        {"seed": 0, "chains": 4},
        {"seed": 1, "chains": 4},
        r"^fingerprint differs across ranks \(seed: rank 0: 0, rank 1: 1\)\. ",
        id="mapping-names-only-differing-keys",
    ),
    pytest.param(
        {"seed": 0},
        {"seed": 0, "chains": 4},
        r"\(rank 0: \{'seed': 0\}, rank 1: \{'seed': 0, 'chains': 4\}\)",
        id="mapping-other-keys-listed-whole",
    ),
]


@pytest.mark.parametrize(("mine", "other", "match"), MISMATCHES)
def test_mismatch_shows_every_rank(monkeypatch, mine, other, match):
    _two_ranks(monkeypatch, other)
    with pytest.raises(common.DistributedMismatchError, match=match) as info:
        common.require_same_across_ranks("fingerprint", mine)
    assert "same value" in str(info.value)  # the default fix
    if isinstance(mine, dict) and mine.keys() == other.keys():
        assert "chains" not in str(info.value)


def test_mismatch_message_ends_with_the_given_fix(monkeypatch):
    _two_ranks(monkeypatch, 2)
    with pytest.raises(common.DistributedMismatchError, match=r"\(rank 0: 1, rank 1: 2\)\. Reload"):
        common.require_same_across_ranks("size", 1, fix="Reload the data.")


def test_attribution_uses_the_one_helper():
    """One `require_same_across_ranks(name, value)`; attribution re-exports it."""
    assert gradsketch.attribution._distributed.require_same_across_ranks is (
        common.require_same_across_ranks
    )


@pytest.mark.parametrize("src", [-1, 1, True, "0"], ids=["negative", "outside", "bool", "str"])
def test_broadcast_refuses_a_rank_outside_the_group(src):
    with pytest.raises(ValueError, match=r"`src` must be an integer in \[0, 1\), got " + repr(src)):
        common.broadcast_object("x", src=src)


# -- init_from_env ---------------------------------------------------------------


def test_plain_run_initialises_nothing(no_torchrun_env):
    assert common.init_from_env() is False
    assert not common.is_distributed()
    with common.process_group_from_env() as made:
        assert made is False and common.world_size() == 1


def test_existing_group_is_left_alone(no_torchrun_env, one_rank_group):
    no_torchrun_env.setenv("RANK", "0")
    no_torchrun_env.setenv("WORLD_SIZE", "1")
    with common.process_group_from_env() as made:
        assert made is False
    assert common.is_distributed()  # still the caller's group


def test_torchrun_environment_makes_and_destroys_a_gloo_group(no_torchrun_env):
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    env["MASTER_PORT"] = str(free_port())
    for name, value in env.items():
        no_torchrun_env.setenv(name, value)
    with common.process_group_from_env(backend="gloo") as made:
        assert made is True
        assert common.is_distributed() and dist.get_backend() == "gloo"
        assert common.rank_and_world() == (0, 1)
    assert not common.is_distributed()


_MASTER = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
ENV_ERRORS = [
    pytest.param(
        {"RANK": "0"}, r"\['RANK'\] are set but \['WORLD_SIZE', 'MASTER_ADDR'", id="rank-only"
    ),
    pytest.param(
        {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1"},
        r"but \['MASTER_ADDR'\] are not.*torchrun --nproc_per_node",
        id="no-master-addr",
    ),
    pytest.param(
        {"RANK": "x", "WORLD_SIZE": "2", **_MASTER},
        r"`RANK` must be an integer >= 0, got 'x'",
        id="rank-text",
    ),
    pytest.param(
        {"RANK": "0", "WORLD_SIZE": "0", **_MASTER},
        r"`WORLD_SIZE` must be an integer >= 1, got '0'",
        id="world-0",
    ),
    pytest.param(
        {"RANK": "2", "WORLD_SIZE": "2", **_MASTER},
        r"`RANK` must lie in range\(0, 2\).*got 2",
        id="rank-too-big",
    ),
]


@pytest.mark.parametrize(("env", "match"), ENV_ERRORS)
def test_malformed_torchrun_environment_is_refused(no_torchrun_env, env, match):
    for name, value in env.items():
        no_torchrun_env.setenv(name, value)
    with pytest.raises(ValueError, match=match):
        common.init_from_env()
    assert not common.is_distributed()


def test_bad_local_rank_is_refused(no_torchrun_env):
    no_torchrun_env.setenv("LOCAL_RANK", "-1")
    with pytest.raises(ValueError, match=r"`LOCAL_RANK` must be an integer >= 0, got '-1'"):
        common.local_rank()


def _one_gpu_with_nccl(patch: pytest.MonkeyPatch, ranks_here: int, rank: int) -> list[str]:
    """A machine of one GPU with NCCL, as torchrun sets it up for ``ranks_here`` local ranks;
    returns the list the backend of ``init_process_group`` is recorded in."""
    env = {"RANK": str(rank), "WORLD_SIZE": str(ranks_here), "LOCAL_RANK": str(rank)}
    env |= {"LOCAL_WORLD_SIZE": str(ranks_here), **_MASTER}
    for name, value in env.items():
        patch.setenv(name, value)
    patch.setattr(torch.cuda, "is_available", lambda: True)
    patch.setattr(torch.cuda, "device_count", lambda: 1)
    patch.setattr(torch.cuda, "set_device", lambda device: None)
    patch.setattr(dist, "is_nccl_available", lambda: True)
    chosen: list[str] = []
    patch.setattr(dist, "init_process_group", lambda backend, **_: chosen.append(backend))
    return chosen


@pytest.mark.parametrize(("ranks_here", "backend"), [(1, "nccl"), (2, "gloo")])
def test_automatic_backend_is_nccl_only_with_a_gpu_per_local_rank(
    no_torchrun_env, ranks_here, backend
):
    """Two ranks on a one-GPU machine: NCCL cannot put both on the GPU (CUDA's "invalid
    device ordinal" on rank 1, seen under torchrun on an H200), so both ranks take gloo."""
    chosen = _one_gpu_with_nccl(no_torchrun_env, ranks_here, rank=ranks_here - 1)
    assert common.init_from_env() is True
    assert chosen == [backend]


def test_nccl_without_a_gpu_for_the_rank_is_refused(no_torchrun_env):
    chosen = _one_gpu_with_nccl(no_torchrun_env, ranks_here=2, rank=1)
    with pytest.raises(
        ValueError,
        match=r"LOCAL_RANK=1 and this machine has 1 GPU\(s\).*"
        r"backend='gloo'",
    ):
        common.init_from_env(backend="nccl")
    assert chosen == []


def test_unknown_backend_lists_the_allowed_ones():
    allowed = ".*".join(repr(name) for name in common.BACKENDS)
    with pytest.raises(ValueError, match=rf"`backend` must be one of {allowed}.*got 'mpi'"):
        common.init_from_env(backend="mpi")


# -- two ranks under torchrun ----------------------------------------------------


def _worker(out: Path, config: Path) -> None:
    """Each torchrun rank: the CLI (which makes its own group), then the helpers."""
    import os

    from gradsketch.cli import app

    torch.set_num_threads(1)
    result: dict[str, object] = {"before": common.is_distributed()}
    real_init = common.init_from_env

    def recording_init(backend: str | None = None) -> bool:
        made = real_init(backend)
        result["cli_group"] = [made, dist.get_backend(), *common.rank_and_world()]
        return made

    common.init_from_env = recording_init  # the CLI reaches it through this module
    app(
        ["attribute", str(config), "--out", str(out / "cli"), "--no-verbose"], standalone_mode=False
    )
    result["after_cli"] = common.is_distributed()
    # A second env:// rendezvous in the same process would reuse torchrun's
    # store keys, so the helpers get a fresh group through a file store.
    dist.init_process_group(
        "gloo",
        init_method=(out / "rendezvous").as_uri(),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )
    try:
        me, world = common.rank_and_world()
        result.update(rank=me, world=world)
        result["broadcast"] = common.broadcast_object(f"from {me}", src=1)
        result["gathered"] = common.all_gather_object(me * 10)
        common.require_same_across_ranks("settings", {"seed": 0})
        try:
            common.require_same_across_ranks("settings", {"seed": me, "chains": 4})
            result["mismatch"] = "no error"
        except common.DistributedMismatchError as err:
            result["mismatch"] = str(err)
        marker = out / "created_by_rank_0"
        with common.rank_zero_first() as first:
            if first:
                marker.write_text("0")
            result["marker_seen"] = marker.exists()
        common.barrier()
    finally:
        dist.destroy_process_group()
    (out / f"rank{me}.json").write_text(json.dumps(result))


def test_two_ranks_under_torchrun(tmp_path):
    """``gradsketch attribute`` under torchrun, and collectives across 2 gloo ranks.

    The ranks featurize disjoint whole chunks with the same single-threaded
    kernels, so the stored features are bit-identical to the one-process
    command's. XᵀX is not: each rank sums its own rows and ``all_reduce``
    adds the two partials, another order than one sum over all rows (on an
    AVX2 CPU this changed 85% of the scores by up to 6e-8). So the scores
    must agree within the bound of ``tests/helpers/numerics.py::trak_score_tolerance``:
    the exact effect of the two stored XᵀX's difference plus each run's
    float32 rounding.
    """
    from gradsketch.cli import attribute_command

    config = tmp_path / "trak_config.py"
    config.write_text(textwrap.dedent(CONFIG))
    output = torchrun(Path(__file__), str(tmp_path), str(config), nproc=WORLD, timeout=180)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for r, result in enumerate(ranks):
        # The CLI made a gloo group of both ranks from torchrun's variables, then destroyed it.
        assert result["before"] is False and result["after_cli"] is False
        assert result["cli_group"] == [True, "gloo", r, WORLD]
        assert (result["rank"], result["world"]) == (r, WORLD)
        assert result["broadcast"] == "from 1"
        assert result["gathered"] == [0, 10]
        assert result["mismatch"].startswith(
            "settings differs across ranks (seed: rank 0: 0, rank 1: 1)."
        )
        assert result["marker_seen"] is True  # rank 1 ran its block after rank 0's
    # Only rank 0 prints the report.
    assert output.count("gradsketch attribute: scored 6 targets against 48") == 1

    with one_thread():
        attribute_command(config, tmp_path / "single", progress=False)
    scores = np.load(tmp_path / "cli" / "scores.npy")
    single = np.load(tmp_path / "single" / "scores.npy")
    assert scores.shape == (48, 6)

    def arrays(run: str, name: str) -> list[np.ndarray]:
        store = tmp_path / run / "trak_store"
        return [zarr.open_array(str(store / name.format(c)))[:] for c in (0, 1)]

    for name in (
        "checkpoints/{}/grads",
        "checkpoints/{}/out_to_loss",
        "experiments/targets/{}/grads",
    ):
        for a, b in zip(arrays("cli", name), arrays("single", name)):
            np.testing.assert_array_equal(a, b, err_msg=name)
    tol = trak_score_tolerance(
        arrays("single", "checkpoints/{}/grads"),
        arrays("single", "experiments/targets/{}/grads"),
        arrays("single", "checkpoints/{}/out_to_loss"),
        arrays("single", "checkpoints/{}/xtx"),
        arrays("cli", "checkpoints/{}/xtx"),
        0.0,  # the CLI's default lambda_reg
    )
    assert np.all(np.abs(scores.astype(np.float64) - single) <= tol)
    assert tol.max() < 1e-3 * np.abs(single).max()  # informative, not vacuous


if __name__ == "__main__":
    _worker(Path(sys.argv[1]), Path(sys.argv[2]))
