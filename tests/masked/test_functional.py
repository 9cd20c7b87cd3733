"""Fast path == readable reference path, in float64, for every mask source."""

from __future__ import annotations

import warnings
import zlib
from collections.abc import Callable

import pytest
import torch

from gradsketch.masked import MaskError, adagrad, adam, sgd
from gradsketch.masked import _functional as functional_mod
from gradsketch.masked import _specified as specified_mod
from gradsketch.masked._specified import dense_view, flat_nonzero, resolve

SHAPE = (7, 9)


def masked_tensor(data: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # MaskedTensor is a prototype
        return torch.masked.masked_tensor(data, mask)


def coo_tensor(indices, values, shape) -> torch.Tensor:
    """A checked COO tensor (torch 2.11 on CUDA also warns that later ops skip the checks)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Sparse invariant checks are implicitly disabled")
        return torch.sparse_coo_tensor(indices, values, shape, check_invariants=True)


def make_case(kind: str, gen: torch.Generator, device: torch.device):
    """A (grad, mask) pair of the given kind and the dense mask it specifies."""
    grad = torch.randn(SHAPE, generator=gen, dtype=torch.float64).to(device)
    flags = (torch.rand(SHAPE, generator=gen) < 0.4).to(device)
    grad[flags & (torch.rand(SHAPE, generator=gen) < 0.2).to(device)] = 0.0  # specified zeros
    if kind == "none":
        return grad, None, torch.ones_like(flags)
    if kind == "bool":
        return grad, flags, flags
    if kind == "index":
        return grad, flags.reshape(-1).nonzero().squeeze(1), flags
    if kind == "coo":
        coo = coo_tensor(flags.nonzero().T, grad[flags], SHAPE)
        return coo, None, flags
    if kind == "coo+bool":
        coo = coo_tensor(flags.nonzero().T, grad[flags], SHAPE)
        extra = (torch.rand(SHAPE, generator=gen) < 0.5).to(device)
        return coo, extra, flags & extra
    if kind == "masked_tensor":
        return masked_tensor(grad, flags), None, flags
    if kind == "masked_tensor+index":
        extra = (torch.rand(SHAPE, generator=gen) < 0.5).to(device)
        return masked_tensor(grad, flags), extra.reshape(-1).nonzero().squeeze(1), flags & extra
    raise AssertionError(kind)


KINDS = ["none", "bool", "index", "coo", "coo+bool", "masked_tensor", "masked_tensor+index"]


def force_path(path: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Force one branch of the fast path on small tensors."""
    if path == "unfused":
        monkeypatch.setattr(functional_mod, "_FUSED_ADAGRAD", None)
    elif path == "dense_pass_torch":
        monkeypatch.setattr(specified_mod, "_USE_NUMPY", False)
        monkeypatch.setattr(specified_mod, "_SCAN_MIN", 8)
        monkeypatch.setattr(specified_mod, "_ADAGRAD_DENSE_WORD_OCCUPANCY", -1.0)
    elif path == "dense_pass":
        monkeypatch.setattr(specified_mod, "_SCAN_MIN", 8)
        monkeypatch.setattr(specified_mod, "_DENSE_WORD_OCCUPANCY", -1.0)
        monkeypatch.setattr(specified_mod, "_ADAGRAD_DENSE_WORD_OCCUPANCY", -1.0)
    elif path == "word_scan":
        monkeypatch.setattr(specified_mod, "_USE_NUMPY", False)
        monkeypatch.setattr(specified_mod, "_SCAN_MIN", 8)
        monkeypatch.setattr(specified_mod, "_SKIP_WORDS_BELOW", 2.0)
        monkeypatch.setattr(specified_mod, "_DENSE_WORD_OCCUPANCY", 2.0)
        monkeypatch.setattr(specified_mod, "_ADAGRAD_DENSE_WORD_OCCUPANCY", 2.0)
    elif path in ("windows", "windows_mixed"):
        # Windows of 16 entries on worker threads, index chunks of 3 and the
        # numpy word scan: every boundary of the windowed path is crossed.
        monkeypatch.setattr(specified_mod, "_SCAN_MIN", 8)
        monkeypatch.setattr(specified_mod, "_WINDOW", 16)
        monkeypatch.setattr(specified_mod, "_INDEX_CHUNK", 3)
        monkeypatch.setattr(specified_mod, "_PARALLEL_MIN_HITS", 1)
        monkeypatch.setattr(specified_mod, "_NUMPY_WORD_SCAN_BELOW", 2.0)
        # Mixed: windows with both of their 8-byte words occupied
        # take the masked dense pass, the others gather.
        occupancy = 0.5 if path == "windows_mixed" else 2.0
        monkeypatch.setattr(specified_mod, "_DENSE_WORD_OCCUPANCY", occupancy)
        monkeypatch.setattr(specified_mod, "_ADAGRAD_DENSE_WORD_OCCUPANCY", occupancy)
    elif path == "index_parallel":
        # Index paths split into parts of 2 entries on worker threads, index
        # chunks of 3 within each part.
        monkeypatch.setattr(functional_mod, "_PARALLEL_MIN_PART", 2)
        monkeypatch.setattr(specified_mod, "_INDEX_CHUNK", 3)
        if torch.get_num_threads() < 2:
            # The worker pool's size follows torch's thread count.
            monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    return path


WINDOWED = ["windows", "windows_mixed", "index_parallel"]


@pytest.fixture(params=["gather", "dense_pass", "word_scan", *WINDOWED])
def fast_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    return force_path(request.param, monkeypatch)


@pytest.fixture(
    params=["gather", "dense_pass", "word_scan", "unfused", "dense_pass_torch", *WINDOWED]
)
def adagrad_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Adagrad also has torch's fused kernel and a plain-ops fallback."""
    return force_path(request.param, monkeypatch)


def run_both(
    step: Callable[..., None], n_state: int, kind: str, device: torch.device, **hyper
) -> None:
    """Run `step` on the fast and the reference path for 5 steps; compare everything."""
    gen = torch.Generator().manual_seed(zlib.crc32(kind.encode()))
    p0 = torch.randn(SHAPE, generator=gen, dtype=torch.float64).to(device)
    fast = [p0.clone()] + [torch.zeros_like(p0) for _ in range(n_state)]
    ref = [t.clone() for t in fast]
    extra_fast, extra_ref = hyper.pop("extra_fast"), hyper.pop("extra_ref")
    for _ in range(5):
        grad, mask, flags = make_case(kind, gen, device)
        before = fast[0].clone()
        step(fast, grad, mask, extra_fast, fast=True, **hyper)
        step(ref, grad, mask, extra_ref, fast=False, **hyper)
        torch.testing.assert_close(fast[0][~flags], before[~flags], rtol=0, atol=0)
    for a, b in zip(fast, ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    for a, b in zip(extra_fast, extra_ref):
        if a is not None or b is not None:
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "weight_decay,maximize", [(0.0, False), (0.1, True)], ids=["plain", "wd+maximize"]
)
def test_adagrad_fast_matches_reference(kind, weight_decay, maximize, adagrad_path, device):
    def step(ts, grad, mask, steps, **kw):
        adagrad([ts[0]], [grad], [mask], [ts[1]], steps, **kw)

    run_both(
        step,
        1,
        kind,
        device,
        extra_fast=[torch.tensor(0.0)],
        extra_ref=[torch.tensor(0.0)],
        lr=0.3,
        lr_decay=0.05,
        weight_decay=weight_decay,
        eps=1e-10,
        maximize=maximize,
    )


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "step_counts,weight_decay", [("entry", 0.0), ("parameter", 0.1)], ids=["entry", "param+wd"]
)
def test_adam_fast_matches_reference(kind, step_counts, weight_decay, fast_path, device):
    def steps():
        if step_counts == "entry":
            return [torch.zeros(SHAPE, dtype=torch.int32, device=device)]
        return [torch.tensor(0.0)]

    def step(ts, grad, mask, counts, **kw):
        adam([ts[0]], [grad], [mask], [ts[1]], [ts[2]], counts, **kw)

    run_both(
        step,
        2,
        kind,
        device,
        extra_fast=steps(),
        extra_ref=steps(),
        lr=0.01,
        beta1=0.8,
        beta2=0.9,
        eps=1e-8,
        weight_decay=weight_decay,
        step_counts=step_counts,
    )


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "momentum,dampening,nesterov",
    [(0.0, 0.0, False), (0.9, 0.3, False), (0.9, 0.0, True)],
    ids=["plain", "momentum+dampening", "nesterov"],
)
def test_sgd_fast_matches_reference(kind, momentum, dampening, nesterov, fast_path, device):
    bufs_fast: list = [None, None]
    bufs_ref: list = [None, None]

    def step_keeping(ts, grad, mask, bufs, **kw):
        one, two = [bufs[0]], [bufs[1]]
        sgd([ts[0]], [grad], [mask], one, two, **kw)
        bufs[0], bufs[1] = one[0], two[0]

    run_both(
        step_keeping,
        0,
        kind,
        device,
        extra_fast=bufs_fast,
        extra_ref=bufs_ref,
        lr=0.1,
        momentum=momentum,
        dampening=dampening,
        weight_decay=0.01,
        nesterov=nesterov,
    )


@pytest.mark.parametrize("use_numpy", [True, False], ids=["numpy", "torch-words"])
@pytest.mark.parametrize("density", [0.0, 0.001, 0.02, 0.3, 1.0])
@pytest.mark.parametrize("n", [0, 5, 8, 1 << 16, (1 << 16) + 3])
def test_flat_nonzero_matches_nonzero(density, n, use_numpy, monkeypatch):
    monkeypatch.setattr(specified_mod, "_USE_NUMPY", use_numpy)
    gen = torch.Generator().manual_seed(n)
    flags = torch.rand(n, generator=gen) < density
    assert torch.equal(flat_nonzero(flags), flags.nonzero().squeeze(1))
    # A view at an odd offset takes the plain path and still agrees.
    if n > 1:
        assert torch.equal(flat_nonzero(flags[1:]), flags[1:].nonzero().squeeze(1))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("use_numpy", [True, False], ids=["numpy-bits", "torch-where"])
def test_zero_unspecified_is_exact(dtype, use_numpy, monkeypatch):
    monkeypatch.setattr(specified_mod, "_USE_NUMPY", use_numpy)
    values = torch.tensor([1.5, float("nan"), float("inf"), -2.0, float("nan"), -0.0], dtype=dtype)
    mask = torch.tensor([True, False, False, False, True, True])
    out = functional_mod._zero_unspecified(values, mask)
    expected = torch.where(mask, values, torch.zeros((), dtype=dtype))
    assert out.dtype == dtype
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
    assert torch.equal(out.view(bits), expected.view(bits))  # +0.0 at unspecified, -0.0 kept


def test_hybrid_sparse_grad_specifies_whole_rows():
    param = torch.zeros(4, 3, dtype=torch.float64)
    grad = coo_tensor(torch.tensor([[2, 0, 2]]), torch.ones(3, 3, dtype=torch.float64), (4, 3))
    flags, dense = dense_view(param, grad, None)
    assert flags.tolist() == [[True] * 3, [False] * 3, [True] * 3, [False] * 3]
    assert dense[2].tolist() == [2.0, 2.0, 2.0]  # duplicates summed, as coalesce does
    spec = resolve(param, grad, None)
    assert spec.index is not None
    assert spec.index.tolist() == [0, 1, 2, 6, 7, 8]
    assert spec.values.tolist() == [1.0, 1.0, 1.0, 2.0, 2.0, 2.0]


def test_non_contiguous_parameter_uses_reference_path():
    base = torch.randn(6, 4, dtype=torch.float64)
    p_fast, p_ref = base.clone().T, base.clone().T  # [4, 6], not contiguous
    s_fast, s_ref = torch.zeros(6, 4, dtype=torch.float64).T, torch.zeros(6, 4).double().T
    grad, mask = torch.randn(4, 6, dtype=torch.float64), torch.rand(4, 6) < 0.5
    hyper = dict(lr=0.1, lr_decay=0.0, weight_decay=0.0, eps=1e-10)
    adagrad([p_fast], [grad], [mask], [s_fast], [torch.tensor(0.0)], fast=True, **hyper)
    adagrad([p_ref], [grad], [mask], [s_ref], [torch.tensor(0.0)], fast=False, **hyper)
    torch.testing.assert_close(p_fast, p_ref, rtol=0, atol=0)


# --------------------------------------------------------------------------- errors

P = torch.zeros(2, 3)
ADAGRAD = dict(lr=0.1, lr_decay=0.0, weight_decay=0.0, eps=1e-10)

ERROR_CASES = [
    pytest.param(torch.ones(2, 3), "dtype torch.float32", id="float-mask"),
    pytest.param(torch.ones(3, 2, dtype=torch.bool), r"has shape \(3, 2\)", id="shape"),
    pytest.param(torch.ones(2, 3, dtype=torch.bool, device="meta"), "device", id="device"),
    pytest.param(torch.tensor([0, 6]), r"flat indices from 0 to 6", id="index-range"),
    pytest.param(torch.tensor([3, 1]), "strictly increasing", id="index-order"),
    pytest.param(
        torch.ones(2, 3, dtype=torch.bool).to_sparse(), "layout torch.sparse_coo", id="sparse"
    ),
    pytest.param([True] * 6, "must be a boolean tensor", id="list"),
]


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "reference"])
@pytest.mark.parametrize("mask,match", ERROR_CASES)
def test_bad_masks_are_refused(mask, match, fast):
    with pytest.raises(MaskError, match=match):
        adagrad(
            [P.clone()], [torch.ones(2, 3)], [mask], [P.clone()], [torch.tensor(0.0)],
            fast=fast, **ADAGRAD,
        )  # fmt: skip


def csr(t: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # sparse CSR is in beta
        return t.to_sparse_csr()


@pytest.mark.parametrize(
    "make_grad,match",
    [
        pytest.param(lambda: torch.ones(3, 2), r"gradient has shape \(3, 2\)", id="shape"),
        pytest.param(lambda: torch.ones(2, 3, device="meta"), "gradient is on meta", id="device"),
        pytest.param(lambda: csr(torch.ones(2, 3)), "layout torch.sparse_csr", id="csr"),
        pytest.param(lambda: "grad", "gradient must be a tensor", id="not-tensor"),
    ],
)
def test_bad_gradients_are_refused(make_grad, match):
    grad = make_grad()
    with pytest.raises(MaskError, match=match):
        adagrad([P.clone()], [grad], [None], [P.clone()], [torch.tensor(0.0)], **ADAGRAD)


def test_list_lengths_must_agree():
    with pytest.raises(MaskError, match=r"equal lengths.*`masks`: 0"):
        adagrad([P.clone()], [torch.ones(2, 3)], [], [P.clone()], [torch.tensor(0.0)], **ADAGRAD)


def test_adam_step_count_errors():
    hyper = dict(lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0)
    args = ([P.clone()], [torch.ones(2, 3)], [None], [P.clone()], [P.clone()])
    with pytest.raises(MaskError, match="step_counts='entry' it must have the parameter's"):
        adam(*args, [torch.tensor(0.0)], **hyper)
    with pytest.raises(MaskError, match="step_counts='parameter' it must be a scalar"):
        adam(*args, [torch.zeros(2, 3)], step_counts="parameter", **hyper)
    with pytest.raises(MaskError, match="`step_counts` must be 'entry' or 'parameter'"):
        adam(*args, [torch.tensor(0.0)], step_counts="global", **hyper)  # type: ignore[arg-type]


@pytest.mark.parametrize("density", [0.02, 0.5], ids=["inline-update", "fused-update"])
def test_adagrad_fast_path_matches_reference_on_both_update_kernels(density):
    """Gathered updates below ``_FUSED_MIN_NUMEL`` run inline, above it through the fused kernel.

    A 512 x 256 parameter gives about 2.6k specified entries at 2 % (inline)
    and about 65k at 50 % (fused); both must equal the readable float64 path.
    """
    gen = torch.Generator().manual_seed(3)
    shape = (512, 256)
    mask = torch.rand(shape, generator=gen) < density
    selected = int(mask.sum())
    assert (selected >= functional_mod._FUSED_MIN_NUMEL) == (density > 0.1)
    grad = torch.randn(shape, generator=gen, dtype=torch.float64)
    results = []
    for fast in (True, False):
        param = torch.randn(shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
        state = torch.full(shape, 0.1, dtype=torch.float64)
        step = torch.zeros((), dtype=torch.float64)
        for _ in range(3):
            adagrad(
                [param], [grad], [mask], [state], [step],
                lr=0.1, lr_decay=0.01, weight_decay=0.0, eps=1e-10, fast=fast,
            )  # fmt: skip
        results.append((param, state))
    torch.testing.assert_close(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1])
