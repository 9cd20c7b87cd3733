"""ParamMask: constructors, select/scatter, save/load, fingerprint, randomness, errors."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from gradsketch._hash import chunk_bits, entry_hash, mix32, name_key, random_bits
from gradsketch.masked import MaskError, ParamMask


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3)
        self.body = nn.Sequential(nn.Linear(12, 8), nn.ReLU(), nn.Linear(8, 4))
        self.norm = nn.LayerNorm(4)


@pytest.fixture
def model() -> nn.Module:
    torch.manual_seed(0)
    return Net().double()


def total(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------- constructors


def test_from_patterns(model):
    mask = ParamMask.from_patterns(model, include=["body.*"], exclude=["*.bias"])
    assert mask.names == tuple(n for n, _ in model.named_parameters())
    assert mask.numel == 12 * 8 + 8 * 4
    assert mask["body.0.weight"].all() and not mask["body.0.bias"].any()
    assert ParamMask.from_patterns(model).numel == total(model)


def test_from_module_types(model):
    mask = ParamMask.from_module_types(model, (nn.Linear, nn.LayerNorm))
    assert mask.numel == total(model) - model.conv.weight.numel() - model.conv.bias.numel()
    assert ParamMask.from_module_types(model, nn.Conv2d).numel == 2 * 3 * 9 + 3


def test_topk_magnitude(model):
    mask = ParamMask.topk_magnitude(model, 10)
    assert mask.numel == 10
    values = torch.cat([p.detach().abs().reshape(-1) for p in model.parameters()])
    chosen = mask.select(model).abs()
    assert chosen.min() >= values.sort(descending=True).values[9]
    assert ParamMask.topk_magnitude(model, 0.25).numel == math.floor(0.25 * total(model) + 0.5)
    assert ParamMask.topk_magnitude(model, 1.0).numel == total(model)
    assert ParamMask.topk_magnitude(model, 0).numel == 0


def test_topk_ties_break_towards_earlier_entries():
    model = nn.Linear(3, 1)
    with torch.no_grad():
        model.weight.fill_(1.0)
        model.bias.fill_(1.0)
    assert ParamMask.topk_magnitude(model, 2)["weight"].tolist() == [[True, True, False]]


# --------------------------------------------------------------------------- random masks


def test_random_is_deterministic_and_seed_sensitive(model):
    a = ParamMask.random(model, 0.3, seed=7)
    assert a == ParamMask.random(model, 0.3, seed=7)
    assert a != ParamMask.random(model, 0.3, seed=8)
    assert ParamMask.random(model, 0.0, seed=1).numel == 0
    assert ParamMask.random(model, 1.0, seed=1).numel == total(model)


def test_random_matches_pure_python_hash():
    """Device independence: the torch int64 hash equals the Python-int hash bit for bit.

    Python ints are exact, so agreement means the torch path never overflows or
    rounds; the same integer ops run identically on any device.
    """
    key = name_key(2**63 + 12345, "layer.weight")
    index = torch.tensor([0, 1, 2, 12345, 2**31 - 1, 2**32, 2**32 + 7, 2**40 + 3])
    assert entry_hash(key, index).tolist() == [entry_hash(key, int(i)) for i in index]
    x = torch.arange(0, 2**32, 2**20 + 12345)
    assert mix32(x).tolist() == [mix32(int(v)) for v in x]


@pytest.mark.parametrize("start", [0, 12345, 2**32 - 100, 2**32, 2**40 + 7])
@pytest.mark.parametrize("threshold", [0, 2**31, 2**32 - 1, 2**32])
def test_numpy_and_torch_chunk_bits_agree(start, threshold):
    """The CPU numpy path and the torch path (used on GPUs) give the same bits."""
    key = name_key(99, "w")
    next_boundary = ((start >> 32) + 1) << 32
    stop = min(start + 1000, next_boundary)
    cpu = torch.device("cpu")
    a = chunk_bits(key, start, stop, threshold, cpu, use_numpy=True)
    b = chunk_bits(key, start, stop, threshold, cpu, use_numpy=False)
    assert torch.equal(a, b)
    assert torch.equal(a, entry_hash(key, torch.arange(start, stop)) < threshold)


def test_chunk_bits_refuses_chunks_across_2_to_32():
    with pytest.raises(ValueError, match=r"crosses a multiple of 2\*\*32"):
        chunk_bits(1, 2**32 - 1, 2**32 + 1, 2**31, torch.device("cpu"), use_numpy=True)


def test_random_bits_do_not_depend_on_chunking():
    whole = random_bits(99, 5000, 2**31, torch.device("cpu"))
    for start in (0, 1234, 4999):
        index = torch.arange(start, 5000)
        assert torch.equal(whole[start:], entry_hash(99, index) < 2**31)


def test_random_mask_on_each_device(device):
    model = nn.Linear(30, 20).to(device)
    on_device = ParamMask.random(model, 0.2, seed=3)
    assert on_device["weight"].device.type == device.type
    assert on_device.to("cpu") == ParamMask.random(model.cpu(), 0.2, seed=3)
    assert on_device.fingerprint == ParamMask.random(model.cpu(), 0.2, seed=3).fingerprint


@pytest.mark.parametrize("fraction", [0.01, 0.3, 0.9])
def test_random_fraction_statistics(fraction):
    """The selected count is Binomial(n, f); accept within 5 standard deviations.

    Each entry is selected independently with probability f (its hash is below
    f * 2**32), so the count K ~ Binomial(n, f) with mean n f and variance
    n f (1 - f). With n = 200_000, |K - n f| <= 5 sqrt(n f (1 - f)) fails with
    probability below 6e-7 for a fair hash. Two seeds must also be independent:
    the overlap is Binomial(n, f^2), checked with the same 5-sigma rule.
    """
    model = nn.Linear(1000, 200, bias=False)
    n = 200_000
    a = ParamMask.random(model, fraction, seed=11)
    b = ParamMask.random(model, fraction, seed=12)
    assert abs(a.numel - n * fraction) <= 5 * math.sqrt(n * fraction * (1 - fraction))
    both = (a & b).numel
    f2 = fraction**2
    assert abs(both - n * f2) <= 5 * math.sqrt(n * f2 * (1 - f2))
    # Rows are not correlated with the flat index: first and second halves agree.
    halves = a["weight"].view(2, -1).sum(1).double()
    half_sd = math.sqrt(n / 2 * fraction * (1 - fraction))
    assert abs(halves[0] - halves[1]) <= 5 * math.sqrt(2) * half_sd


# --------------------------------------------------------------------------- select / scatter


def test_select_scatter_are_inverse(model):
    mask = ParamMask.random(model, 0.4, seed=0)
    params = dict(model.named_parameters())
    flat = mask.select(params)
    assert flat.shape == (mask.numel,)
    full = mask.scatter(flat)
    for name, p in params.items():
        assert torch.equal(full[name], torch.where(mask[name], p, torch.zeros_like(p)))
    assert torch.equal(mask.select(full), flat)
    # select of one tensor by name
    assert torch.equal(
        mask.select(params["conv.weight"], name="conv.weight"), flat[: mask.counts()["conv.weight"]]
    )


def test_select_batched_matches_per_example_select(model):
    mask = ParamMask.random(model, 0.3, seed=1)
    per_example = {n: torch.randn(5, *p.shape, dtype=p.dtype) for n, p in model.named_parameters()}
    batched = mask.select_batched(per_example)
    assert batched.shape == (5, mask.numel)
    for i in range(5):
        assert torch.equal(batched[i], mask.select({n: t[i] for n, t in per_example.items()}))
    back = mask.scatter(batched)
    assert back["body.0.weight"].shape == (5, 8, 12)


def test_absent_parameters_are_unselected(model):
    mask = ParamMask({"body.2.bias": torch.tensor([True, False, True, False])})
    assert mask.select(model).tolist() == model.body[2].bias.detach()[[0, 2]].tolist()
    assert list(mask.scatter(torch.ones(2))) == ["body.2.bias"]
    mask.apply_(model)
    assert model.conv.weight.eq(0).all() and model.body[0].weight.eq(0).all()
    assert model.body[2].bias[0] != 0 and model.body[2].bias[1] == 0
    by_param = mask.by_parameter(model)
    assert not by_param[model.conv.weight].any() and by_param[model.body[2].bias].sum() == 2


def test_apply_zeroes_unselected_entries(model):
    mask = ParamMask.random(model, 0.5, seed=2)
    kept = mask.select(model).detach().clone()
    mask.apply_(model)
    assert torch.equal(mask.select(model), kept)
    for name, p in model.named_parameters():
        assert p[~mask[name]].eq(0).all()


def test_all_false_parameters_may_be_missing_from_inputs(model):
    mask = ParamMask.from_patterns(model, include=["conv.*"])
    grads = {"conv.weight": torch.ones(3, 2, 3, 3), "conv.bias": torch.ones(3)}
    assert mask.select(grads).shape == (57,)
    assert mask.select_batched({k: v[None] for k, v in grads.items()}).shape == (1, 57)


def test_combining_masks(model):
    a = ParamMask.random(model, 0.5, seed=1)
    b = ParamMask.from_patterns(model, include=["body.*"])
    both, either = a & b, a | b
    assert both.numel == sum(int(a[n].sum()) for n in a.names if n.startswith("body."))
    assert either.numel == a.numel + b.numel - both.numel


# --------------------------------------------------------------------------- identity


def test_fingerprint_stability_and_sensitivity(model):
    mask = ParamMask.from_patterns(model, include=["body.*"])
    assert mask.fingerprint == ParamMask.from_patterns(model, include=["body.*"]).fingerprint
    assert len(mask.fingerprint) == 16 and int(mask.fingerprint, 16) >= 0
    # A known value pins the format: changing it breaks stored sketches.
    pinned = ParamMask({"w": torch.tensor([[True, False], [False, True]])})
    assert pinned.fingerprint == PINNED_FINGERPRINT
    flipped = dict(mask.items())
    flipped["body.0.weight"] = flipped["body.0.weight"].clone()
    flipped["body.0.weight"][3, 4] = False
    renamed = {("x" + n if i == 0 else n): m for i, (n, m) in enumerate(mask.items())}
    reshaped = {n: (m.reshape(-1) if i == 0 else m) for i, (n, m) in enumerate(mask.items())}
    reordered = dict(reversed(list(mask.items())))
    others = [flipped, renamed, reshaped, reordered]
    prints = {mask.fingerprint} | {ParamMask(o).fingerprint for o in others}
    assert len(prints) == 5
    # Mutating a mask in place updates the fingerprint.
    before = pinned.fingerprint
    pinned["w"][0, 1] = True
    assert pinned.fingerprint != before


PINNED_FINGERPRINT = "07fc95c181d16051"


def test_save_load_round_trip(model, tmp_path):
    mask = ParamMask.random(model, 0.37, seed=5)
    mask.save(tmp_path / "mask.pt")
    loaded = ParamMask.load(tmp_path / "mask.pt")
    assert loaded == mask and loaded.fingerprint == mask.fingerprint
    assert loaded.names == mask.names
    empty = ParamMask({})
    empty.save(tmp_path / "empty.pt")
    assert ParamMask.load(tmp_path / "empty.pt") == empty and empty.numel == 0


def test_equality_and_repr(model):
    a = ParamMask.from_patterns(model, include=["norm.*"])
    assert a == ParamMask.from_patterns(model, include=["norm.*"])
    assert a != ParamMask.from_patterns(model, include=["conv.*"])
    assert a != "mask" and a != ParamMask({})
    assert repr(a).startswith(f"ParamMask(8 parameters, 8/{total(model)} selected")
    assert len(a) == 8 and "norm.weight" in a and list(a) == list(a.names)


# --------------------------------------------------------------------------- errors


def test_constructor_errors():
    with pytest.raises(MaskError, match=r"`masks\['w'\]` must be a torch.bool tensor; received"):
        ParamMask({"w": torch.ones(2)})
    with pytest.raises(MaskError, match="keys must be parameter names"):
        ParamMask({0: torch.ones(2, dtype=torch.bool)})  # type: ignore[dict-item]
    with pytest.raises(MaskError, match="must be a mapping name -> boolean tensor"):
        ParamMask([torch.ones(2, dtype=torch.bool)])  # type: ignore[arg-type]
    with pytest.raises(MaskError, match=r"layout torch\.sparse_coo"):
        ParamMask({"w": torch.ones(2, dtype=torch.bool).to_sparse()})


def test_pattern_and_type_errors(model):
    with pytest.raises(MaskError, match=r"`include` pattern 'bdy\.\*' matches no parameter"):
        ParamMask.from_patterns(model, include=["bdy.*"])
    with pytest.raises(MaskError, match="`exclude` pattern 'x' matches no parameter"):
        ParamMask.from_patterns(model, exclude=["x"])
    with pytest.raises(MaskError, match="`include` must be a list of name patterns"):
        ParamMask.from_patterns(model, include="body.*")
    with pytest.raises(MaskError, match=r"`model` must be an nn\.Module"):
        ParamMask.from_patterns({"w": torch.ones(2)})  # type: ignore[arg-type]
    with pytest.raises(MaskError, match=r"`types` must be nn\.Module subclasses"):
        ParamMask.from_module_types(model, ("Linear",))  # type: ignore[arg-type]
    with pytest.raises(MaskError, match=r"match no module that owns parameters.*'Conv2d'"):
        ParamMask.from_module_types(model, nn.BatchNorm1d)


@pytest.mark.parametrize(
    "fraction,seed,match",
    [
        (1.5, 0, r"`fraction` must be in \[0, 1\]; received 1.5"),
        ("half", 0, "`fraction` must be a float"),
        (0.5, -1, r"`seed` must be an integer in \[0, 2\*\*64\), got -1"),
        (0.5, 2**64, "`seed` must be an integer"),
        (0.5, 1.0, "`seed` must be an integer"),
    ],
)
def test_random_errors(model, fraction, seed, match):
    with pytest.raises(MaskError, match=match):
        ParamMask.random(model, fraction, seed=seed)


@pytest.mark.parametrize(
    "k,match",
    [
        (-1, r"as a count must be in \[0, "),
        (10**9, r"as a count must be in \[0, "),
        (1.5, r"as a fraction must be in \[0, 1\]"),
        (True, "must be an int count or a float fraction"),
    ],
)
def test_topk_errors(model, k, match):
    with pytest.raises(MaskError, match=match):
        ParamMask.topk_magnitude(model, k)


def test_select_scatter_apply_errors(model):
    mask = ParamMask.from_patterns(model, include=["body.*"])
    with pytest.raises(MaskError, match=r"has no tensor for 'body\.0\.weight'"):
        mask.select({"conv.weight": model.conv.weight})
    with pytest.raises(MaskError, match=r"has shape \(12, 8\); expected \[8, 12\]"):
        mask.select(
            {n: p for n, p in model.named_parameters()} | {"body.0.weight": torch.ones(12, 8)}
        )
    with pytest.raises(MaskError, match=r"expected \[batch, 3, 2, 3, 3\]"):
        mask.select_batched({n: p for n, p in model.named_parameters()})
    with pytest.raises(MaskError, match="is on meta but the mask is on cpu"):
        mask.select(torch.ones(8, 12, device="meta"), name="body.0.weight")
    with pytest.raises(MaskError, match="got a single tensor but no `name`"):
        mask.select(torch.ones(3))
    with pytest.raises(MaskError, match="unknown parameter name 'nope'"):
        mask.select(torch.ones(3), name="nope")
    with pytest.raises(MaskError, match="unknown parameter name 'nope'"):
        mask["nope"]
    with pytest.raises(MaskError, match=rf"last dimension {mask.numel}.*received shape \(3,\)"):
        mask.scatter(torch.ones(3))
    with pytest.raises(MaskError, match=r"`target` must be an nn\.Module or a mapping"):
        mask.apply_([torch.ones(3)])  # type: ignore[arg-type]
    with pytest.raises(MaskError, match="records parameters the model does not have"):
        ParamMask({"fc.weight": torch.ones(2, dtype=torch.bool)}).by_parameter(model)
    batched = {n: torch.ones(2, *p.shape) for n, p in model.named_parameters()}
    batched["body.2.bias"] = torch.ones(3, 4)
    with pytest.raises(MaskError, match="has batch size 3; the tensors before it have 2"):
        mask.select_batched(batched)


def test_combining_shape_mismatch():
    a = ParamMask({"w": torch.ones(2, dtype=torch.bool)})
    b = ParamMask({"w": torch.ones(3, dtype=torch.bool)})
    with pytest.raises(MaskError, match=r"'w' has shape \(2,\) in one and \(3,\)"):
        a & b


def test_load_errors(tmp_path):
    torch.save({"format": "something else"}, tmp_path / "other.pt")
    with pytest.raises(MaskError, match="is not a ParamMask file"):
        ParamMask.load(tmp_path / "other.pt")
    mask = ParamMask({"w": torch.tensor([True, False])})
    mask.save(tmp_path / "m.pt")
    payload = torch.load(tmp_path / "m.pt", weights_only=True)
    torch.save(payload | {"version": 99}, tmp_path / "v.pt")
    with pytest.raises(MaskError, match="format version 99"):
        ParamMask.load(tmp_path / "v.pt")
    torch.save(payload | {"fingerprint": "0" * 16}, tmp_path / "bad.pt")
    with pytest.raises(MaskError, match="is corrupt"):
        ParamMask.load(tmp_path / "bad.pt")


def test_more_input_errors(model):
    mask = ParamMask.from_patterns(model, include=["norm.*"])
    with pytest.raises(MaskError, match=r"`source`\['norm.bias'\] must be a tensor"):
        mask.select(dict(model.named_parameters()) | {"norm.bias": [0.0] * 4})
    with pytest.raises(MaskError, match="received shape 'flat'"):
        mask.scatter("flat")  # type: ignore[arg-type]
    with pytest.raises(MaskError, match=r"`types` must be nn.Module subclasses.*received \(\)"):
        ParamMask.from_module_types(model, ())
    with pytest.raises(MaskError, match=r"`source` must be an nn\.Module or a mapping"):
        mask.select_batched([torch.ones(3)])  # type: ignore[arg-type]
