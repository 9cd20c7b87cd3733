"""``sample``: store layout, the batches and losses it records, reuse, refusal and resume."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr
from _slt_helpers import (
    SEQ,
    loss_on_two_threads,
    loss_on_two_threads_with_global_dropout,
    reference_token_loss,
    tiny_gpt2,
    tiny_llama,
    token_data,
)
from torch.utils.data import DataLoader

from gradsketch._processes import worker_threads
from gradsketch.slt import (
    FewChainsWarning,
    OutputPathMismatchError,
    SamplingCache,
    _run,
    compute_llc,
    create_param_masks,
    llc,
    per_token_loss,
    sample,
)
from gradsketch.slt._data import as_token_tensor

pytest.importorskip("xarray")

#: The CPU runs (sample's default device, as devinterp's, is CUDA where there is one, and
#: the working copy's seeded dropout, threads and skipped observables are CPU-only).
BASE: dict[str, Any] = dict(
    device="cpu",
    lr=1e-4,
    n_beta=20.0,
    localization=100.0,
    num_chains=2,
    num_draws=3,
    batch_size=4,
    batches_per_draw=2,
    num_init_loss_batches=2,
)

#: devinterp 2.0.1's SamplerConfig fields, in order, plus its legacy fields.
DEVINTERP_SAMPLER_FIELDS = [
    "lr",
    "n_beta",
    "batch_size",
    "num_chains",
    "num_draws",
    "num_burnin_steps",
    "num_steps_bw_draws",
    "gradient_accumulation_steps",
    "num_init_loss_batches",
    "init_seed",
    "localization",
    "noise_level",
    "llc_weight_decay",
    "bounding_box_size",
    "sampling_method",
    "sampling_method_kwargs",
    "init_noise",
    "save_metrics",
    "shuffle",
    "epoch_mode",
    "match_sampling_input_ids_across_chains",
    "scheduler_type",
    "scheduler_kwargs",
    "cores",
    "online",
]


@pytest.fixture(scope="module")
def data() -> torch.Tensor:
    return token_data(32)


@pytest.fixture(scope="module")
def probe() -> torch.Tensor:
    return token_data(12, seed=1)


@pytest.fixture(scope="module")
def stored(
    tmp_path_factory: pytest.TempPathFactory, data: torch.Tensor, probe: torch.Tensor
) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("slt") / "s.zarr"
    tree = sample(
        tiny_gpt2(),
        data,
        {"train": data, "probe-set": (probe, 3)},
        output_path=path,
        save_metrics=True,
        **BASE,
    )
    return path, tree


@pytest.fixture(scope="module")
def run(stored: tuple[Path, Any]) -> Any:
    return stored[1]


def test_layout_is_devinterps(run: Any) -> None:
    ds = run.dataset
    ctx = SEQ - 1
    expected = {
        "init_loss": (("chain", "token_pos"), (2, ctx)),
        "sampling_loss": (("chain", "draw", "batch", "token_pos"), (2, 3, 4, ctx)),
        "sampling_loss_micro": (("chain", "step", "batch_sampling", "token_pos"), (2, 3, 4, ctx)),
        "sampling_input_ids_micro": (("chain", "step", "batch_sampling", "token"), (2, 3, 4, SEQ)),
        "loss_train": (("chain", "draw", "batch_train", "token_pos"), (2, 3, 8, ctx)),
        "input_ids_train": (("batch_train", "token"), (8, SEQ)),
        "loss_probe_set": (("chain", "draw", "batch_probe_set", "token_pos"), (2, 3, 12, ctx)),
        "input_ids_probe_set": (("batch_probe_set", "token"), (12, SEQ)),
    }
    for name in ("scaled_grad", "unscaled_grad", "localization", "weight_decay", "noise"):
        expected[f"metrics_{name}"] = (("chain", "step"), (2, 3))
    for name in ("distance", "dot_grad_prior", "dot_grad_noise", "dot_prior_noise"):
        expected[f"metrics_{name}"] = (("chain", "step"), (2, 3))
    assert {v: (ds[v].dims, ds[v].shape) for v in ds.data_vars} == expected
    sampler = ds.attrs["metadata"]["config"]["sampler"]
    assert list(sampler) == DEVINTERP_SAMPLER_FIELDS
    assert sampler["n_beta"] == 20.0 and sampler["save_metrics"] is True
    assert ds.attrs["completed"] == 1
    assert ds.attrs["metrics_numel"] == sum(p.numel() for p in tiny_gpt2().parameters())
    assert np.isfinite(ds["loss_probe_set"].values).all()


def test_every_array_is_compressed_then_checksummed(stored: tuple[Path, Any]) -> None:
    """Blosc-zstd with byte shuffle, then a crc32c of the compressed chunk (what the
    integrity checks read); int64 byte tokens (7 zero bytes in 8) shrink below a quarter."""
    path, _ = stored
    root = zarr.open_group(str(path), mode="r")
    arrays = [root[name] for name in root.array_keys()]
    arrays += [root[f"progress/{name}"] for name in ("init_done", "chain_done")]
    for array in arrays:
        assert isinstance(array, zarr.Array)
        codecs = array.metadata.to_dict()["codecs"]
        names = [c["name"] for c in codecs]
        assert names == ["bytes", "blosc", "crc32c"], (array.path, names)
        blosc = codecs[1]["configuration"]
        assert (blosc["cname"], blosc["shuffle"]) == ("zstd", "shuffle"), array.path
    ids = root["sampling_input_ids_micro"]
    assert isinstance(ids, zarr.Array)
    chunk_bytes = sum(f.stat().st_size for f in (path / ids.path / "c").rglob("*") if f.is_file())
    assert 0 < chunk_bytes < ids.nbytes / 4


def test_batches_are_devinterps_dataloader_batches(run: Any, data: torch.Tensor) -> None:
    # devinterp: DataLoader(shuffle=True, generator seeded init_seed, drop_last=True).
    loader = DataLoader(
        [{"input_ids": r} for r in data],
        batch_size=4,
        shuffle=True,
        generator=torch.Generator().manual_seed(100),
        drop_last=True,
    )
    batches = [b["input_ids"] for b, _ in zip(loader, range(3))]
    stored = run.dataset["sampling_input_ids_micro"].values
    for chain in range(2):
        for step in range(3):
            assert np.array_equal(stored[chain, step], batches[step].numpy())


def test_observables_are_devinterps_fixed_rows(run: Any, probe: torch.Tensor) -> None:
    rows = random.Random(1337).sample(range(12), 12)
    assert np.array_equal(run.dataset["input_ids_probe_set"].values, probe[rows].numpy())


def test_losses_match_a_float64_reference(run: Any, data: torch.Tensor) -> None:
    """First step's loss is the trained model's; init_loss the mean over the first batches.

    The model has no dropout, so these are deterministic; float32 against float64
    on 16 positions of a 32-wide model agrees to ~1e-6 relative.
    """
    model = tiny_gpt2()
    ds = run.dataset
    first = torch.as_tensor(ds["sampling_input_ids_micro"].values[0, 0])
    ref = reference_token_loss(model, first)
    for chain in range(2):
        np.testing.assert_allclose(ds["sampling_loss_micro"].values[chain, 0], ref, rtol=1e-5)
    init_ids = torch.as_tensor(ds["sampling_input_ids_micro"].values[0, :2].reshape(-1, SEQ))
    init_ref = reference_token_loss(model, init_ids).mean(dim=0)
    np.testing.assert_allclose(ds["init_loss"].values[0], init_ref, rtol=1e-5)
    np.testing.assert_array_equal(ds["init_loss"].values[0], ds["init_loss"].values[1])
    # One step per draw, one micro-batch per step: the draw's loss is the step's.
    np.testing.assert_array_equal(ds["sampling_loss"].values, ds["sampling_loss_micro"].values)


def test_per_token_loss_matches_log_softmax_gather(data: torch.Tensor) -> None:
    model = tiny_gpt2()
    with torch.no_grad():
        fast = per_token_loss(model, data[:5])
    torch.testing.assert_close(
        fast.double(), reference_token_loss(model, data[:5]), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_without_noise_or_steps_observables_see_the_trained_model(
    tmp_path: Path, data: torch.Tensor, probe: torch.Tensor, device: str
) -> None:
    """noise_level=0 and lr=1e-12: weights move by < 1e-9, so each draw's probe loss is
    the trained model's to float32 rounding, and the LLC is n_beta times the difference
    of the trained model's mean losses on the step batches and on the init batches
    (float32 means of ~5.3 carry ~1e-6 relative error; 1e-5 leaves a margin). On CUDA
    (TF32 off, torch's default) the same bound holds against the CPU reference."""
    model = tiny_gpt2()
    kw = {**BASE, "lr": 1e-12, "noise_level": 0.0, "device": device}
    tree = sample(tiny_gpt2(), data, {"probe": (probe, 3)}, output_path=tmp_path / "s.zarr", **kw)
    ref = reference_token_loss(model, torch.as_tensor(tree.dataset["input_ids_probe"].values))
    for chain in range(2):
        for draw in range(3):
            np.testing.assert_allclose(
                tree.dataset["loss_probe"].values[chain, draw], ref, rtol=1e-5
            )
    ids = torch.as_tensor(tree.dataset["sampling_input_ids_micro"].values[0])
    step_mean = float(reference_token_loss(model, ids.reshape(-1, SEQ)).mean())
    init_mean = float(reference_token_loss(model, ids[:2].reshape(-1, SEQ)).mean())
    expected = 20.0 * (step_mean - init_mean)
    with pytest.warns(FewChainsWarning):  # 2 chains
        estimate = compute_llc(tree)
    assert abs(float(estimate.llc_mean) - expected) < 20.0 * 1e-5 * step_mean


def test_gradient_accumulation_averages_micro_batches(tmp_path: Path, data: torch.Tensor) -> None:
    kw = {**BASE, "gradient_accumulation_steps": 2, "num_draws": 2}
    ds = sample(tiny_gpt2(), data, {"d": data}, output_path=tmp_path / "s.zarr", **kw).dataset
    micro = ds["sampling_loss_micro"].values  # [chain, step, 2 * batch, tok]
    assert micro.shape == (2, 2, 8, SEQ - 1)
    halves = (micro[:, :, :4] / 2 + micro[:, :, 4:] / 2).astype(np.float32)
    np.testing.assert_allclose(ds["sampling_loss"].values, halves, rtol=1e-6)


def test_restricted_sampling_records_the_restricted_count(
    tmp_path: Path, data: torch.Tensor
) -> None:
    model = tiny_gpt2()
    mask = create_param_masks(model, "l1h2")
    kw = {**BASE, "num_draws": 2, "save_metrics": True}
    ds = sample(
        model, data, {"d": data}, param_masks=mask, output_path=tmp_path / "a", **kw
    ).dataset
    assert ds.attrs["metrics_numel"] == mask.numel
    # devinterp's dict form selects the same weights: the same run, bit for bit.
    as_dict = {n: m for n, m in mask.items() if m.any()}
    other = sample(model, data, {"d": data}, param_masks=as_dict, output_path=tmp_path / "b", **kw)
    np.testing.assert_array_equal(ds["loss_d"].values, other.dataset["loss_d"].values)
    # Noise only on the head's entries: ||noise||^2 ~ lr * numel (chi-square, numel=1048 dof).
    noise = ds["metrics_noise"].values
    assert np.all(np.abs(noise**2 / (1e-4 * mask.numel) - 1) < 0.25)


@pytest.mark.parametrize("method", ["rmsprop_sgld", "adam_sgld"])
def test_other_samplers_run(tmp_path: Path, data: torch.Tensor, method: str) -> None:
    kw = {**BASE, "num_draws": 2, "sampling_method": method}
    ds = sample(tiny_gpt2(), data, {"d": data}, output_path=tmp_path / "s", **kw).dataset
    assert np.isfinite(ds["loss_d"].values).all()
    assert ds.attrs["metadata"]["config"]["sampler"]["sampling_method"] == method


def test_sketches_are_recorded(tmp_path: Path, data: torch.Tensor) -> None:
    kw = {**BASE, "num_draws": 2}
    ds = sample(
        tiny_gpt2(), data, {"d": data}, output_path=tmp_path / "s", sketch_dim=16, **kw
    ).dataset
    assert ds["sketch_noise"].dims == ("chain", "step", "sketch")
    assert ds["sketch_noise"].shape == (2, 2, 16)
    assert np.isfinite(ds["sketch_noise"].values).all()


def test_completed_store_is_reused_and_other_settings_refused(
    stored: tuple[Path, Any],
    data: torch.Tensor,
    probe: torch.Tensor,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    root, tree = stored
    monkeypatch.setattr(_run.SampleRun, "run", _fail)
    out = tree.dataset
    again = sample(
        tiny_gpt2(),
        data,
        {"train": data, "probe-set": (probe, 3)},
        output_path=root,
        save_metrics=True,
        **BASE,
    )
    np.testing.assert_array_equal(again.dataset["loss_train"].values, out["loss_train"].values)
    with pytest.raises(OutputPathMismatchError, match=r"lr: stored 0.0001, requested 0.0002"):
        sample(
            tiny_gpt2(),
            data,
            {"train": data, "probe-set": (probe, 3)},
            output_path=root,
            save_metrics=True,
            **{**BASE, "lr": 2e-4},
        )
    with pytest.raises(OutputPathMismatchError, match=r"model: stored '[0-9a-f]+', requested"):
        sample(
            tiny_gpt2(seed=1),
            data,
            {"train": data, "probe-set": (probe, 3)},
            output_path=root,
            save_metrics=True,
            **BASE,
        )


def _fail(self: Any) -> None:
    raise AssertionError("a completed store was sampled again")


def test_killed_run_resumes_at_the_unfinished_chain(
    tmp_path: Path, data: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    kw = {**BASE, "num_chains": 3, "num_draws": 2}
    whole = sample(tiny_gpt2(), data, {"d": data}, output_path=tmp_path / "whole", **kw).dataset
    original = _run.SampleRun.sample_chain
    calls: list[int] = []

    def killed(self: Any, chain: int) -> Any:
        calls.append(chain)
        if chain == 1:
            raise KeyboardInterrupt
        return original(self, chain)

    monkeypatch.setattr(_run.SampleRun, "sample_chain", killed)
    with pytest.raises(KeyboardInterrupt):
        sample(tiny_gpt2(), data, {"d": data}, output_path=tmp_path / "cut", **kw)

    def counted(self: Any, chain: int) -> Any:
        calls.append(chain)
        return original(self, chain)

    monkeypatch.setattr(_run.SampleRun, "sample_chain", counted)
    resumed = sample(tiny_gpt2(), data, {"d": data}, output_path=tmp_path / "cut", **kw).dataset
    assert calls == [0, 1, 1, 2]
    assert resumed.attrs["completed"] == 1
    # Each chain's computation is repeated with the same seeds, shapes and threads.
    np.testing.assert_array_equal(resumed["loss_d"].values, whole["loss_d"].values)
    np.testing.assert_array_equal(resumed["init_loss"].values, whole["init_loss"].values)


def test_a_diverging_chain_warns_and_keeps_nan(tmp_path: Path, data: torch.Tensor) -> None:
    def nan_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        # Finite for L(w*) (evaluated under inference mode), NaN on every sampler step.
        scale = 1.0 if torch.is_inference_mode_enabled() else float("nan")
        return per_token_loss(model, ids) * scale

    kw = {**BASE, "num_draws": 2, "num_chains": 1}
    with pytest.warns(
        UserWarning, match=r"Chain failed: chain 0: the loss is NaN or infinite at step 0 on rows"
    ):
        ds = sample(
            tiny_gpt2(), data, {"d": data}, output_path=tmp_path / "s", loss_fn=nan_loss, **kw
        ).dataset
    assert np.isnan(ds["loss_d"].values).all()


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"rmsprop_eps": 0.1}, ValueError, r"`rmsprop_eps` is only valid with sampling_method"),
        (
            {
                "sampling_method": "rmsprop_sgld",
                "rmsprop_alpha": 0.9,
                "sampling_method_kwargs": {"alpha": 0.9},
            },
            ValueError,
            r"`rmsprop_alpha` is given and so is",
        ),
        ({"sampling_method": "hmc"}, ValueError, r"`sampling_method` must be one of"),
        ({"sampling_method_kwargs": {"beta": 1}}, ValueError, r"has \['beta'\], which"),
        ({"num_chains": 0}, ValueError, r"`num_chains` must be a positive int, got 0"),
        ({"cores": 0}, ValueError, r"`cores` must be a positive integer, got 0; pass the number"),
        ({"cores": 2.0}, ValueError, r"`cores` must be a positive integer, got 2.0 of type float"),
        (
            # A lambda drawing from the global generator: chains need worker processes.
            {
                "cores": 2,
                "loss_fn": lambda model, ids: torch.nn.functional.dropout(
                    per_token_loss(model, ids), 0.1
                ),
            },
            ValueError,
            r"`loss_fn`=.* cannot be sent to worker processes \(cores=2; its forward pass "
            r"draws from torch's global generator.*module-level",
        ),
        ({"lr": -1.0}, ValueError, r"`lr` must be a non-negative number"),
        ({"batches_per_draw": 9}, ValueError, r"has 32 sequences but needs batch_size"),
        ({"batch_size": 64}, ValueError, r"fewer than `batch_size`=64"),
        (
            {"param_masks": {"transformer.wte.weight": torch.zeros(256, 32, dtype=torch.bool)}},
            ValueError,
            r"selects no weight",
        ),
    ],
    ids=[
        "eps-sgld",
        "alpha-twice",
        "method",
        "method-kwargs",
        "chains",
        "cores-zero",
        "cores-float",
        "cores-lambda",
        "lr",
        "obs-size",
        "batch",
        "empty-mask",
    ],
)
def test_argument_errors(
    tmp_path: Path, data: torch.Tensor, change: dict[str, Any], error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        sample(tiny_gpt2(), data, {"d": data}, output_path=tmp_path / "s", **{**BASE, **change})


def test_data_errors(tmp_path: Path, data: torch.Tensor) -> None:
    model = tiny_gpt2()
    with pytest.raises(ValueError, match=r"has sequences of 9 tokens but `dataset` has 17"):
        sample(model, data, {"d": data[:, :9]}, output_path=tmp_path / "a", **BASE)
    with pytest.raises(ValueError, match=r"integer token ids of shape \[n, seq\]"):
        sample(model, data.float(), {"d": data}, output_path=tmp_path / "b", **BASE)
    with pytest.raises(ValueError, match=r"non-empty dict"):
        sample(model, data, {}, output_path=tmp_path / "c", **BASE)
    from datasets import Dataset

    ragged = Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5]]})
    with pytest.raises(ValueError, match=r"`dataset` has 'input_ids' sequences of different"):
        sample(model, ragged, {"d": data}, output_path=tmp_path / "e", **BASE)
    table = Dataset.from_dict({"input_ids": data.tolist()}).with_format("torch")
    assert torch.equal(as_token_tensor(table), data)

    def bad_shape(m: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return per_token_loss(m, ids).mean(dim=1)

    with pytest.raises(ValueError, match=r"`loss_fn` must return the per-token loss of shape"):
        sample(model, data, {"d": data}, output_path=tmp_path / "d", loss_fn=bad_shape, **BASE)


def test_noise_stream_is_not_the_dropout_stream() -> None:
    """The dropout generator (and the global one) is seeded init_seed + chain, as devinterp
    seeds its global generator; the noise generator must not replay it (a shared stream
    correlated noise and dropout masks and biased the LLC upwards). Two independent streams
    of 1000 normals have a sample correlation with sd 1/sqrt(1000) ~ 0.032, so 0.15 is
    ~4.7 sd; the same stream would give 1."""
    for chain in range(4):
        seed = _run.noise_seed(100, chain)
        assert seed not in {100 + c for c in range(8)}
        noise = torch.randn(1000, generator=torch.Generator().manual_seed(seed))
        dropout_stream = torch.randn(1000, generator=torch.Generator().manual_seed(100 + chain))
        assert abs(float(torch.corrcoef(torch.stack([noise, dropout_stream]))[0, 1])) < 0.15
    assert len({_run.noise_seed(100, c) for c in range(64)}) == 64


@pytest.mark.parametrize(
    ("loss_fn", "backend"),
    [
        (loss_on_two_threads, "threads"),
        (loss_on_two_threads_with_global_dropout, "processes"),
    ],
    ids=["threads", "processes"],
)
def test_cores_give_the_bits_of_one_core_and_share_its_store(
    tmp_path: Path,
    data: torch.Tensor,
    monkeypatch: pytest.MonkeyPatch,
    loss_fn: Any,
    backend: str,
) -> None:
    """cores=2 on 4 threads: two chains at once on 4 // 2 = 2 threads each.

    In threads of this process when nothing the chains run draws from
    torch's global generator (the model's dropout is then the working
    copy's, seeded per chain), else in two spawned workers (a loss through
    torch's functional dropout). ``loss_on_two_threads`` fails on any other
    thread count (the chains, and this process while it computes
    ``init_loss``). Every array equals the cores=1 store's bit for bit when
    cores=1 runs on those 2 threads too (CPU kernels may split reductions by
    thread count). ``cores`` is no setting: the cores=1 store is reused as
    it is.
    """
    kw = {**BASE, "num_chains": 3, "save_metrics": True, "loss_fn": loss_fn}
    obs = {"d": data}
    model = tiny_gpt2(dropout=0.1)
    backends: list[str] = []
    real_run_jobs = _run.run_jobs

    def spy(*args: Any, **kwargs: Any) -> Any:
        backends.append(kwargs["backend"])
        return real_run_jobs(*args, **kwargs)

    monkeypatch.setattr(_run, "run_jobs", spy)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        one = sample(model, data, obs, output_path=tmp_path / "one", cores=1, **kw).dataset
        torch.set_num_threads(4)
        two = sample(model, data, obs, output_path=tmp_path / "two", cores=2, **kw).dataset
        assert torch.get_num_threads() == 4
    finally:
        torch.set_num_threads(before)
    assert backends == ["processes", backend]  # cores=1 runs them here (the default name)
    assert set(one.data_vars) == set(two.data_vars)
    assert one.attrs == two.attrs
    for var in one.data_vars:
        np.testing.assert_array_equal(two[var].values, one[var].values, err_msg=str(var))
    assert np.isfinite(one["loss_d"].values).all()
    # Chains differ from one another (each has its own seeds).
    assert not np.array_equal(one["loss_d"].values[0], one["loss_d"].values[1])

    monkeypatch.setattr(_run.SampleRun, "run", _fail)
    reused = sample(model, data, obs, output_path=tmp_path / "one", cores=2, **kw).dataset
    np.testing.assert_array_equal(reused["loss_d"].values, one["loss_d"].values)


@pytest.mark.slow
def test_a_killed_store_resumes_in_worker_processes(tmp_path: Path, data: torch.Tensor) -> None:
    """A cores=1 store with chains 1 and 2 unfinished (flags off, rows NaN) resumes with
    cores=2, those chains sampled by two workers: the bits of an uninterrupted run."""
    import zarr

    kw = {**BASE, "num_chains": 3}
    obs = {"d": data}
    model = tiny_gpt2(dropout=0.1)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        torch.set_num_threads(worker_threads(2))
        whole = sample(model, data, obs, output_path=tmp_path / "whole", **kw).dataset
        sample(model, data, obs, output_path=tmp_path / "one", **kw)
        torch.set_num_threads(2)
        root = zarr.open_group(str(tmp_path / "one"), mode="a")
        root["progress/chain_done"][1:] = 0
        root["loss_d"][1:] = np.nan
        root.update_attributes({"completed": 0})
        resumed = sample(model, data, obs, output_path=tmp_path / "one", cores=2, **kw).dataset
    finally:
        torch.set_num_threads(before)
    assert resumed.attrs["completed"] == 1
    for var in whole.data_vars:
        np.testing.assert_array_equal(resumed[var].values, whole[var].values, err_msg=str(var))


def test_the_initial_loss_is_computed_once_per_cache_for_the_same_inputs(
    tmp_path: Path, data: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second run given the same cache that differs only in its restriction
    (susceptibilities' runs) reuses L(w*), which ignores the restriction, bit for bit;
    another dropout rate, other data or another init_seed compute it again, and so does a
    call with a cache of its own (the default)."""
    cache = SamplingCache()
    calls: list[int] = []
    original = _run.SampleRun._init_loss

    def counted(self: Any, work: Any, chain: int, cache: Any) -> Any:
        calls.append(chain)
        return original(self, work, chain, cache)

    monkeypatch.setattr(_run.SampleRun, "_init_loss", counted)
    model = tiny_gpt2(dropout=0.1)
    head = {n: torch.zeros_like(p, dtype=torch.bool) for n, p in model.named_parameters()}
    head["transformer.h.0.attn.c_attn.weight"][:, :4] = True
    base = {**BASE, "cache": cache}
    full = sample(model, data, {"d": data}, output_path=tmp_path / "full", **base)
    assert calls == [0]  # every chain takes chain 0's L(w*) (same batches)
    restricted = sample(
        model, data, {"d": data}, param_masks=head, output_path=tmp_path / "head", **base
    )
    assert calls == [0]
    np.testing.assert_array_equal(
        restricted.dataset["init_loss"].values, full.dataset["init_loss"].values
    )
    sample(tiny_gpt2(dropout=0.2), data, {"d": data}, output_path=tmp_path / "p", **base)
    assert calls == [0] * 2
    sample(model, data.flip(0), {"d": data}, output_path=tmp_path / "data", **base)
    assert calls == [0] * 3
    sample(model, data, {"d": data}, output_path=tmp_path / "seed", init_seed=7, **base)
    assert calls == [0] * 4
    assert len(cache.init_losses) == 4
    sample(model, data, {"d": data}, param_masks=head, output_path=tmp_path / "own", **BASE)
    assert calls == [0] * 5


@pytest.mark.parametrize("bad", [{}, "cache", 1])
def test_cache_must_be_a_sampling_cache(data: torch.Tensor, bad: Any) -> None:
    with pytest.raises(TypeError, match=r"`cache` must be a gradsketch.slt.SamplingCache or None"):
        sample(tiny_gpt2(), data, {"d": data}, cache=bad, **BASE)


def _global_dropout_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.dropout(per_token_loss(model, ids), p=0.1, training=True)


@pytest.mark.parametrize(
    ("make", "loss_fn", "skipped"),
    [
        (lambda: tiny_gpt2(dropout=0.1), None, True),
        (tiny_llama, None, True),
        (tiny_gpt2, _global_dropout_loss, False),
    ],
    ids=["gpt2-dropout", "llama", "global-generator-loss"],
)
def test_skipped_observables_leave_the_chains_as_they_were(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    make: Any,
    loss_fn: Any,
    skipped: bool,
) -> None:
    """``evaluate_observables=False``: the store holds every variable of the full run but the
    observables', bit for bit the same. Under dropout the skipped forward pass's seeds are
    drawn all the same (counted, not zero); a loss drawing from torch's global generator
    cannot be skipped so, and its observables are evaluated. A store without them is not
    reused by a call that wants them; one with them is reused by a call that does not."""
    model = make()
    ids = token_data(32, seed=2) % 64  # tiny_llama's vocabulary
    kw = {**BASE, "save_metrics": True, "loss_fn": loss_fn}
    drawn: list[int] = []
    real = _run.skip_seeds

    def spy(generator: torch.Generator, count: int) -> None:
        drawn.append(count)
        real(generator, count)

    monkeypatch.setattr(_run, "skip_seeds", spy)
    full = sample(model, ids, {"d": ids}, output_path=tmp_path / "full", **kw).dataset
    assert drawn == []
    part = sample(
        model, ids, {"d": ids}, output_path=tmp_path / "part", evaluate_observables=False, **kw
    ).dataset
    observed = {"loss_d", "input_ids_d"}
    assert set(part.data_vars) == set(full.data_vars) - (observed if skipped else set())
    for var in part.data_vars:
        np.testing.assert_array_equal(part[var].values, full[var].values, err_msg=str(var))
    draws = BASE["num_chains"] * BASE["num_draws"]
    if not skipped:
        assert drawn == []
    elif make is tiny_llama:
        assert drawn == [0] * draws
    else:  # embedding, 2 × (attention, residual x 2), per forward pass
        assert len(drawn) == draws and drawn[0] > 0 and set(drawn) == {drawn[0]}
    with pytest.raises(OutputPathMismatchError, match=r"evaluate_observables"):
        sample(model, ids, {"d": ids}, output_path=tmp_path / "part", **kw)
    # The store with them holds more than a call without them asks for: reused as it is.
    monkeypatch.setattr(_run.SampleRun, "run", _fail)
    again = sample(
        model, ids, {"d": ids}, output_path=tmp_path / "full", evaluate_observables=False, **kw
    ).dataset
    np.testing.assert_array_equal(again["loss_d"].values, full["loss_d"].values)


def test_llc_without_a_store_skips_the_observables(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Nothing reads the observables of a store nobody keeps: ``llc`` skips them unless an
    ``output_path`` keeps the store (or the caller asks), with the same estimate."""
    model, ids = tiny_gpt2(dropout=0.1), token_data(32, seed=3)
    asked: list[bool] = []
    real = _run.SampleRun._decide_observables

    def spy(self: Any) -> None:
        asked.append(self.evaluate_observables)
        real(self)

    monkeypatch.setattr(_run.SampleRun, "_decide_observables", spy)
    kw = {**BASE, "num_chains": 4}
    kept = llc(model, ids, {"d": ids}, output_path=tmp_path / "s", **kw)
    bare = llc(model, ids, {"d": ids}, **kw)
    asked_for = llc(model, ids, {"d": ids}, evaluate_observables=True, **kw)
    assert asked == [True, False, True]
    for out in (bare, asked_for):
        np.testing.assert_array_equal(out["llc_per_chain"].values, kept["llc_per_chain"].values)


@pytest.mark.parametrize("bad", ["no", 0, None])
def test_evaluate_observables_must_be_a_bool(data: torch.Tensor, bad: Any) -> None:
    with pytest.raises(TypeError, match=r"`evaluate_observables` must be True or False, got"):
        sample(tiny_gpt2(), data, {"d": data}, evaluate_observables=bad, **BASE)


def test_estimates_that_read_the_observables_refuse_to_skip_them(data: torch.Tensor) -> None:
    """bif and susceptibilities are computed from the observables' losses; a store without
    them is refused by compute_bif with the fix."""
    from gradsketch.slt import bif, compute_bif, susceptibilities

    model = tiny_gpt2()
    with pytest.raises(ValueError, match=r"`bif` is computed from the observables' losses"):
        bif(model, data, {"d": data}, evaluate_observables=False, **BASE)
    with pytest.raises(ValueError, match=r"`susceptibilities` is computed from the obs"):
        susceptibilities(
            model,
            data,
            {"d": data, "p": data},
            {"full": None},
            sampling_task="d",
            evaluate_observables=False,
            **BASE,
        )
    bare = sample(model, data, {"d": data}, evaluate_observables=False, **BASE)
    with pytest.raises(ValueError, match=r"hold no observable .*\(evaluate_observables=True"):
        compute_bif(bare)


def test_a_killed_store_with_observables_resumes_them_when_asked_to_skip_them(
    tmp_path: Path, data: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Resuming a store made with its observables, a call that skips them evaluates them
    for the remaining chains too: every chain of the store is alike, the uninterrupted run."""
    kw = {**BASE, "num_chains": 3, "num_draws": 2}
    model = tiny_gpt2(dropout=0.1)
    whole = sample(model, data, {"d": data}, output_path=tmp_path / "whole", **kw).dataset
    original = _run.SampleRun.sample_chain

    def killed(self: Any, chain: int) -> Any:
        if chain == 1:
            raise KeyboardInterrupt
        return original(self, chain)

    monkeypatch.setattr(_run.SampleRun, "sample_chain", killed)
    with pytest.raises(KeyboardInterrupt):
        sample(model, data, {"d": data}, output_path=tmp_path / "cut", **kw)
    monkeypatch.setattr(_run.SampleRun, "sample_chain", original)
    resumed = sample(
        model, data, {"d": data}, output_path=tmp_path / "cut", evaluate_observables=False, **kw
    ).dataset
    assert set(resumed.data_vars) == set(whole.data_vars)
    for var in whole.data_vars:
        np.testing.assert_array_equal(resumed[var].values, whole[var].values, err_msg=str(var))
