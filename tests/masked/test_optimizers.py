"""Masked optimizers against torch.optim, the seed example, state dicts, errors."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from torch import nn

import gradsketch.masked._optimizers as optimizers_mod
from gradsketch.masked import MaskedAdagrad, MaskedAdam, MaskedSGD, MaskError, ParamMask

SHAPE = (6, 5)


@pytest.fixture(autouse=True)
def _check_sparse_invariants():
    """torch's sparse optimizers build COO tensors; checking them also silences a warning."""
    with torch.sparse.check_sparse_tensor_invariants(enable=True):
        yield


def coo(dense: torch.Tensor, flags: torch.Tensor) -> torch.Tensor:
    """The entries of `dense` at `flags` as a sparse COO tensor (zeros stay stored)."""
    return torch.sparse_coo_tensor(
        flags.nonzero().T, dense[flags], dense.shape, check_invariants=True
    )


def masked_tensor(data: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # MaskedTensor is a prototype
        return torch.masked.masked_tensor(data, mask)


def changing_masks(steps: int, seed: int = 0):
    """Per step: a random mask (density varying 0-90 %) and a gradient with specified zeros."""
    gen = torch.Generator().manual_seed(seed)
    for i in range(steps):
        flags = torch.rand(SHAPE, generator=gen, dtype=torch.float64) < (i % 10) / 10
        grad = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
        grad[torch.rand(SHAPE, generator=gen) < 0.25] = 0.0
        noise = torch.full(SHAPE, float("nan"), dtype=torch.float64)
        yield flags, grad, torch.where(flags, grad, noise)  # unspecified entries are NaN


def params_pair(seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    start = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
    return nn.Parameter(start.clone()), nn.Parameter(start.clone())


# --------------------------------------------------------------------------- adagrad


@pytest.mark.parametrize("grad_form", ["bool-mask", "coo", "masked_tensor"])
@pytest.mark.parametrize(
    "hyper",
    [
        dict(lr=0.1),
        dict(lr=0.5, lr_decay=0.1, initial_accumulator_value=0.3),
        dict(lr=0.05, eps=1e-3, initial_accumulator_value=1.0),
    ],
    ids=["default", "lr_decay+init", "eps"],
)
def test_adagrad_equals_torch_sparse_adagrad(grad_form, hyper):
    ours_p, torch_p = params_pair()
    ours = MaskedAdagrad([ours_p], **hyper)
    ref = torch.optim.Adagrad([torch_p], **hyper)
    for flags, grad, noisy in changing_masks(30):
        torch_p.grad = coo(grad, flags)
        ref.step()
        if grad_form == "bool-mask":
            ours_p.grad = noisy
            ours.step(masks={ours_p: flags})
        elif grad_form == "coo":
            ours_p.grad = coo(grad, flags)
            ours.step()
        else:
            ours_p.grad = masked_tensor(noisy, flags)
            ours.step()
    torch.testing.assert_close(ours_p, torch_p, rtol=1e-12, atol=1e-14)
    for key in ("sum", "step"):
        torch.testing.assert_close(ours.state[ours_p][key], ref.state[torch_p][key])


def test_seed_example_reproduces_printed_parameters():
    """The 2x4 example of shared/seeds/maskedtensor_adagrad.txt, both printed steps."""
    param = nn.Parameter(torch.arange(8).reshape(2, 4).float())
    opt = MaskedAdagrad([param], lr=0.1, initial_accumulator_value=0.5, eps=1e-10)
    i = torch.tensor([[0, 1, 1], [2, 0, 2]])
    v = torch.tensor([3, 4, 5], dtype=torch.float32)
    param.grad = torch.sparse_coo_tensor(i, v, [2, 4], check_invariants=True)
    opt.step()
    first = torch.tensor([[0.0000, 1.0000, 1.9027, 3.0000], [3.9015, 5.0000, 5.9010, 7.0000]])
    torch.testing.assert_close(param.detach(), first, rtol=0, atol=5e-5)
    sums = torch.tensor([[0.5, 0.5, 9.5, 0.5], [16.5, 0.5, 25.5, 0.5]])
    torch.testing.assert_close(opt.state[param]["sum"], sums)
    # The seed runs the same update again: masked gradient, same state.
    dense = param.grad.to_dense()
    param.grad = masked_tensor(dense, dense != 0)
    opt.step()
    second = torch.tensor([[0.0000, 1.0000, 1.8329, 3.0000], [3.8314, 5.0000, 5.8306, 7.0000]])
    torch.testing.assert_close(param.detach(), second, rtol=0, atol=5e-5)


# --------------------------------------------------------------------------- adam


@pytest.mark.parametrize("grad_form", ["bool-mask", "coo"])
def test_adam_parameter_counts_equal_sparse_adam(grad_form):
    """step_counts='parameter' is SparseAdam, over changing masks.

    SparseAdam adds eps before the bias correction, MaskedAdam (like Adam)
    after; with eps = 1e-30 the difference is below float64 rounding.
    """
    ours_p, torch_p = params_pair()
    ours = MaskedAdam([ours_p], lr=0.01, betas=(0.8, 0.95), eps=1e-30, step_counts="parameter")
    ref = torch.optim.SparseAdam([torch_p], lr=0.01, betas=(0.8, 0.95), eps=1e-30)
    for flags, grad, noisy in changing_masks(30, seed=3):
        flags[0, 0] = True  # SparseAdam divides 0/0 at entries never seen with eps -> 0
        grad[0, 0] = noisy[0, 0] = 1.0
        torch_p.grad = coo(grad, flags)
        ref.step()
        if grad_form == "coo":
            ours_p.grad = coo(grad, flags)
            ours.step()
        else:
            ours_p.grad = noisy
            ours.step(masks={ours_p: flags})
    torch.testing.assert_close(ours_p, torch_p, rtol=1e-10, atol=1e-12)
    for key in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(ours.state[ours_p][key], ref.state[torch_p][key])


def test_adam_entry_counts_equal_sparse_adam_under_a_static_mask():
    """Per-entry and per-parameter counts agree when every step has the same mask."""
    ours_p, torch_p = params_pair()
    flags = torch.rand(SHAPE, generator=torch.Generator().manual_seed(5)) < 0.4
    ours = MaskedAdam([{"params": [ours_p], "mask": flags}], lr=0.01, eps=1e-30)
    ref = torch.optim.SparseAdam([torch_p], lr=0.01, eps=1e-30)
    for _, grad, _ in changing_masks(20, seed=4):
        torch_p.grad = coo(grad, flags)
        ref.step()
        ours_p.grad = grad
        ours.step()
    torch.testing.assert_close(ours_p, torch_p, rtol=1e-10, atol=1e-12)
    assert ours.state[ours_p]["step"][flags].eq(20).all()
    assert ours.state[ours_p]["step"][~flags].eq(0).all()


def test_adam_entry_counts_give_first_update_full_bias_correction():
    """An entry first specified late moves by ~lr, as at Adam's first step."""
    p = nn.Parameter(torch.zeros(2, dtype=torch.float64))
    opt = MaskedAdam([p], lr=0.1)
    for _ in range(50):
        p.grad = torch.ones(2, dtype=torch.float64)
        opt.step(masks={p: torch.tensor([True, False])})
    before = p.detach()[1].item()
    opt.step(masks={p: torch.tensor([False, True])})
    assert p.detach()[1].item() - before == pytest.approx(-0.1, rel=1e-6)


# --------------------------------------------------------------------------- all-True == dense


DENSE_CASES = [
    pytest.param(MaskedAdagrad, torch.optim.Adagrad, dict(lr=0.1), id="adagrad"),
    pytest.param(
        MaskedAdagrad,
        torch.optim.Adagrad,
        dict(lr=0.1, lr_decay=0.01, weight_decay=0.1, initial_accumulator_value=0.2),
        id="adagrad-wd",
    ),
    pytest.param(MaskedAdam, torch.optim.Adam, dict(lr=0.01), id="adam"),
    pytest.param(
        MaskedAdam,
        torch.optim.Adam,
        dict(lr=0.01, betas=(0.5, 0.9), weight_decay=0.1),
        id="adam-wd",
    ),
    pytest.param(MaskedSGD, torch.optim.SGD, dict(lr=0.1), id="sgd"),
    pytest.param(MaskedSGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9), id="sgd-momentum"),
    pytest.param(
        MaskedSGD,
        torch.optim.SGD,
        dict(lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.01),
        id="sgd-dampening-wd",
    ),
    pytest.param(
        MaskedSGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True), id="sgd-nesterov"
    ),
    pytest.param(
        MaskedSGD, torch.optim.SGD, dict(lr=0.1, momentum=0.5, maximize=True), id="sgd-maximize"
    ),
]


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "reference"])
@pytest.mark.parametrize("ours_cls,torch_cls,hyper", DENSE_CASES)
@pytest.mark.parametrize("mask_form", ["all-true", "none"])
def test_all_true_mask_equals_dense_torch(ours_cls, torch_cls, hyper, fast, mask_form):
    ours_p, torch_p = params_pair()
    ours = ours_cls([ours_p], fast=fast, **hyper)
    ref = torch_cls([torch_p], foreach=False, **hyper)
    everything = torch.ones(SHAPE, dtype=torch.bool)
    for _, grad, _ in changing_masks(15, seed=7):
        torch_p.grad, ours_p.grad = grad.clone(), grad.clone()
        ref.step()
        ours.step(masks={ours_p: everything} if mask_form == "all-true" else None)
    torch.testing.assert_close(ours_p, torch_p, rtol=1e-12, atol=1e-14)
    for key, value in ref.state[torch_p].items():
        if key != "step":
            torch.testing.assert_close(ours.state[ours_p][key], value, rtol=1e-12, atol=1e-14)


def test_sgd_equals_torch_sparse_sgd():
    ours_p, torch_p = params_pair()
    ours, ref = MaskedSGD([ours_p], lr=0.1), torch.optim.SGD([torch_p], lr=0.1)
    for flags, grad, noisy in changing_masks(10):
        torch_p.grad = coo(grad, flags)
        ref.step()
        ours_p.grad = noisy
        ours.step(masks={ours_p: flags})
    torch.testing.assert_close(ours_p, torch_p, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("cls", [MaskedAdagrad, MaskedAdam, MaskedSGD])
def test_unspecified_entries_and_state_are_untouched(cls):
    p = nn.Parameter(torch.randn(SHAPE, dtype=torch.float64))
    opt = cls([p], lr=0.1, **({"momentum": 0.9} if cls is MaskedSGD else {}))
    flags = torch.rand(SHAPE) < 0.5
    p.grad = torch.randn(SHAPE, dtype=torch.float64)
    opt.step(masks={p: flags})
    state0 = copy.deepcopy(opt.state[p])
    p0 = p.detach().clone()
    p.grad = torch.randn(SHAPE, dtype=torch.float64)
    opt.step(masks={p: ~flags})
    assert torch.equal(p.detach()[flags], p0[flags])
    for key, value in opt.state[p].items():
        if value.shape == SHAPE:
            assert torch.equal(value[flags], state0[key][flags]), key


@pytest.mark.parametrize("cls", [MaskedAdagrad, MaskedAdam, MaskedSGD])
def test_specified_zero_gradients_still_update(cls):
    p = nn.Parameter(torch.ones(3, dtype=torch.float64))
    opt = cls([p], lr=0.1, weight_decay=0.5)
    p.grad = torch.zeros(3, dtype=torch.float64)
    opt.step(masks={p: torch.tensor([True, False, True])})
    moved = p.detach() != 1.0
    assert moved.tolist() == [True, False, True]  # weight decay acts on the zero gradient


# --------------------------------------------------------------------------- masks sources


def test_group_mask_step_mask_and_gradient_intersect():
    p = nn.Parameter(torch.zeros(4, dtype=torch.float64))
    static = torch.tensor([True, True, True, False])
    opt = MaskedSGD([{"params": [p], "mask": [static]}], lr=1.0)
    p.grad = torch.sparse_coo_tensor(
        torch.tensor([[0, 1, 3]]), torch.ones(3, dtype=torch.float64), (4,), check_invariants=True
    )
    opt.step(masks={p: torch.tensor([True, False, True, True])})
    assert p.detach().tolist() == [-1.0, 0.0, 0.0, 0.0]


def test_group_mask_edits_in_place_are_seen():
    """The group mask's scan is cached per tensor version; in-place edits invalidate it."""
    p = nn.Parameter(torch.zeros(4, dtype=torch.float64))
    static = torch.tensor([True, False, False, False])
    opt = MaskedSGD([{"params": [p], "mask": static}], lr=1.0)
    p.grad = torch.ones(4, dtype=torch.float64)
    opt.step()
    static[3] = True
    opt.step()
    assert p.detach().tolist() == [-2.0, 0.0, 0.0, -1.0]


def test_step_mask_scan_is_cached_per_tensor_version(monkeypatch):
    """A boolean mask passed to every step is indexed once per object and version."""
    scans = []
    real = optimizers_mod.dense_mask_index

    def counting(mask, **kw):
        scans.append(mask)
        return real(mask, **kw)

    monkeypatch.setattr(optimizers_mod, "dense_mask_index", counting)
    p = nn.Parameter(torch.zeros(4, dtype=torch.float64))
    opt = MaskedSGD([p], lr=1.0)
    mask = torch.tensor([True, False, False, False])
    p.grad = torch.ones(4, dtype=torch.float64)
    for _ in range(3):  # first use: windowed scan; then indexed once and reused
        opt.step(masks={p: mask})
    assert len(scans) == 1
    mask[3] = True  # in place: bumps the version, so the cached index is dropped
    for _ in range(2):
        opt.step(masks={p: mask})
    assert len(scans) == 2
    opt.step(masks={p: mask.clone()})  # another object: not indexed on first use
    assert len(scans) == 2
    assert p.detach().tolist() == [-6.0, 0.0, 0.0, -3.0]


def test_param_mask_with_named_parameters():
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1)).double()
    mask = ParamMask.from_patterns(model, include=["0.*"])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = MaskedSGD([{"params": model.named_parameters(), "mask": mask}], lr=0.1)
    model(torch.randn(4, 3, dtype=torch.float64)).sum().backward()
    opt.step()
    after = dict(model.named_parameters())
    assert not torch.equal(after["0.weight"], before["0.weight"])
    assert torch.equal(after["1.weight"], before["1.weight"])
    # The same restriction per step, by ParamMask or by parameter.
    opt2 = MaskedSGD(model.named_parameters(), lr=0.1)
    opt2.step(masks=ParamMask.from_patterns(model, include=["1.bias"]))
    assert torch.equal(after["0.weight"], model[0].weight)
    assert not torch.equal(after["1.bias"], before["1.bias"])
    opt3 = MaskedSGD(model.parameters(), lr=0.1)
    keep = model[0].weight.detach().clone()
    opt3.step(masks=ParamMask.from_patterns(model, include=["1.*"]).by_parameter(model))
    assert torch.equal(keep, model[0].weight)


@pytest.mark.parametrize("cls", [MaskedAdagrad, MaskedAdam, MaskedSGD])
def test_step_bumps_parameter_version(cls):
    """Updates written through numpy still count as in-place ops for autograd."""
    p = nn.Parameter(torch.zeros(10))
    opt = cls([p], lr=0.1)
    p.grad = torch.ones(10)
    before = p._version
    opt.step(masks={p: torch.arange(10) % 3 == 0})
    assert p._version > before


def test_parameters_without_gradient_are_skipped():
    a, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    opt = MaskedAdagrad([a, b], lr=0.1)
    a.grad = torch.ones(2)
    opt.step(masks={b: torch.tensor([True, True])})
    assert b.detach().tolist() == [1.0, 1.0] and b not in opt.state


def test_closure_loss_is_returned():
    p = nn.Parameter(torch.ones(2))
    opt = MaskedSGD([p], lr=0.1)

    def closure():
        opt.zero_grad()
        loss = (p**2).sum()
        loss.backward()
        return loss

    loss = opt.step(closure, masks={p: torch.tensor([True, False])})
    assert loss.item() == 2.0
    assert p.detach().tolist() == pytest.approx([0.8, 1.0])


# --------------------------------------------------------------------------- state dict


@pytest.mark.parametrize(
    "cls,hyper",
    [
        (MaskedAdagrad, dict(lr=0.1, lr_decay=0.01)),
        (MaskedAdam, dict(lr=0.01)),
        (MaskedAdam, dict(lr=0.01, step_counts="parameter")),
        (MaskedSGD, dict(lr=0.1, momentum=0.9, dampening=0.1)),
    ],
    ids=["adagrad", "adam", "adam-parameter", "sgd"],
)
def test_state_dict_round_trip(cls, hyper):
    """Train 5 steps, save, load into a fresh optimizer; 5 more steps agree exactly."""
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
    static = torch.rand(SHAPE, generator=gen) < 0.8
    masks = [torch.rand(SHAPE, generator=gen) < 0.5 for _ in range(10)]
    grads = [torch.randn(SHAPE, generator=gen, dtype=torch.float64) for _ in range(10)]

    def make(p):
        return cls([{"params": [p], "mask": [static]}], **hyper)

    a = nn.Parameter(start.clone())
    opt_a = make(a)
    for m, g in zip(masks, grads):
        a.grad = g
        opt_a.step(masks={a: m})

    b = nn.Parameter(start.clone())
    opt_b = make(b)
    for m, g in zip(masks[:5], grads[:5]):
        b.grad = g
        opt_b.step(masks={b: m})
    buffer = io.BytesIO()
    torch.save(opt_b.state_dict(), buffer)
    buffer.seek(0)
    c = nn.Parameter(b.detach().clone())
    opt_c = make(c)
    opt_c.load_state_dict(torch.load(buffer, weights_only=True))
    for m, g in zip(masks[5:], grads[5:]):
        c.grad = g
        opt_c.step(masks={c: m})
    assert torch.equal(a, c)
    for key, value in opt_a.state[a].items():
        assert torch.equal(value, opt_c.state[c][key]), key


# --------------------------------------------------------------------------- errors

CONSTRUCTOR_ERRORS = [
    pytest.param(
        MaskedAdagrad, dict(lr=-1.0), r"`lr` must be a float >= 0.0; received -1.0", id="lr"
    ),
    pytest.param(MaskedAdagrad, dict(lr_decay=-0.1), "`lr_decay`", id="lr_decay"),
    pytest.param(MaskedAdagrad, dict(eps=-1.0), "`eps`", id="eps"),
    pytest.param(
        MaskedAdagrad, dict(initial_accumulator_value=-1), "`initial_accumulator_value`", id="init"
    ),
    pytest.param(MaskedAdagrad, dict(weight_decay=-1), "`weight_decay`", id="wd"),
    pytest.param(MaskedAdam, dict(betas=(1.0, 0.9)), r"`betas\[0\]` must be a float in", id="b1"),
    pytest.param(MaskedAdam, dict(betas=(0.9, -0.1)), r"`betas\[1\]`", id="b2"),
    pytest.param(MaskedAdam, dict(betas=0.9), "`betas` must be a pair", id="betas"),
    pytest.param(MaskedAdam, dict(step_counts="global"), "`step_counts` must be", id="counts"),
    pytest.param(MaskedSGD, dict(lr=0.1, momentum=-1), "`momentum`", id="momentum"),
    pytest.param(MaskedSGD, dict(lr=0.1, dampening=-1), "`dampening`", id="dampening"),
    pytest.param(MaskedSGD, dict(lr=0.1, nesterov=True), "`nesterov=True` needs", id="nesterov"),
    pytest.param(MaskedSGD, dict(lr="fast"), "`lr` must be", id="lr-type"),
]


@pytest.mark.parametrize("cls,hyper,match", CONSTRUCTOR_ERRORS)
def test_constructor_errors(cls, hyper, match):
    with pytest.raises(ValueError, match=match):
        cls([nn.Parameter(torch.zeros(2))], **hyper)


def test_step_mask_for_a_tensor_the_optimizer_does_not_hold():
    p = nn.Parameter(torch.zeros(2))
    opt = MaskedSGD([p], lr=0.1)
    p.grad = torch.ones(2)
    with pytest.raises(MaskError, match=r"does not hold: Parameter\(shape=\(2,\)"):
        opt.step(masks={nn.Parameter(torch.zeros(2)): torch.ones(2, dtype=torch.bool)})
    with pytest.raises(MaskError, match="does not hold: 'weight'"):
        opt.step(masks={"weight": torch.ones(2, dtype=torch.bool)})  # type: ignore[dict-item]
    with pytest.raises(MaskError, match="must be a mapping parameter -> boolean tensor"):
        opt.step(masks=[torch.ones(2, dtype=torch.bool)])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "mask,match",
    [
        pytest.param(torch.ones(2), "dtype torch.float32", id="dtype"),
        pytest.param(torch.ones(3, dtype=torch.bool), r"has shape \(3,\)", id="shape"),
        pytest.param(torch.ones(2, dtype=torch.bool, device="meta"), "on device meta", id="device"),
    ],
)
def test_step_mask_errors(mask, match):
    p = nn.Parameter(torch.zeros(2))
    opt = MaskedAdagrad([p], lr=0.1)
    p.grad = torch.ones(2)
    with pytest.raises(MaskError, match=match):
        opt.step(masks={p: mask})
    with pytest.raises(MaskError, match=match):
        MaskedAdagrad([{"params": [p], "mask": mask}])


def test_group_mask_errors():
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    with pytest.raises(MaskError, match="single tensor but the group holds 2"):
        MaskedSGD([{"params": [a, b], "mask": torch.ones(2, dtype=torch.bool)}], lr=0.1)
    with pytest.raises(MaskError, match="list has 1 entries but the group holds 2"):
        MaskedSGD([{"params": [a, b], "mask": [None]}], lr=0.1)
    with pytest.raises(MaskError, match="must be None, a boolean tensor"):
        MaskedSGD([{"params": [a], "mask": "weight"}], lr=0.1)
    pm = ParamMask({"w": torch.ones(2, dtype=torch.bool)})
    with pytest.raises(MaskError, match="needs parameter names"):
        MaskedSGD([{"params": [a], "mask": pm}], lr=0.1)


def test_param_mask_step_errors():
    model = nn.Linear(2, 1)
    opt = MaskedSGD(model.parameters(), lr=0.1)
    pm = ParamMask.from_patterns(model)
    with pytest.raises(MaskError, match="holds unnamed parameters"):
        opt.step(masks=pm)
    named = MaskedSGD(model.named_parameters(), lr=0.1)
    with pytest.raises(MaskError, match=r"does not hold: \['other'\]"):
        named.step(masks=ParamMask({"other": torch.ones(2, dtype=torch.bool)}))
