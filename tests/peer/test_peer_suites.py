"""The peer-suite runner's import rewriting, and the scale invariance devinterp's
``test_llc_scaling_invariance`` asserts, on a model of our own.

devinterp's integration test asserts ``llc(loss_fn=2 L, n_beta=N / 2) == llc(L, N)``
exactly, with ``L`` the default per-token cross-entropy and ``2 L`` its own
``log_softmax`` + ``gather`` times ``-2.0``. Scaling by 2 is exact in binary floating
point, so the two runs see the same numbers at every step *if* the default loss rounds
as ``log_softmax`` + ``gather`` does: the sampler's ``(nbeta / 2) (2 grad)`` equals
``nbeta grad`` bit for bit, the stored float32 losses are exactly doubled, and
``n_beta (mean - init)`` halves and doubles back exactly. No tolerance is derived:
every assertion here is bit equality.
"""

from __future__ import annotations

import pytest
import torch
from peer_suites import IMPORT_TABLE, UnmappedImportError, cpu_port, rewrite_imports
from torch import nn
from torch.nn import functional as F


# ------------------------------------------------------------------ import rewriting
@pytest.mark.parametrize("module", sorted(IMPORT_TABLE), ids=sorted(IMPORT_TABLE))
def test_every_mapped_module_is_rewritten_and_exports_the_names(module):
    """Each table entry rewrites ``from <peer> import`` to a gradsketch module that imports."""
    import importlib

    out = rewrite_imports(f"from {module} import (\n    X,\n)\n")
    assert out == f"from {IMPORT_TABLE[module]} import (\n    X,\n)\n"
    importlib.import_module(IMPORT_TABLE[module])


def test_other_imports_and_indented_ones_are_kept_or_rewritten_in_place():
    src = (
        "import torch\nfrom torch import nn\nif True:\n    from devinterp.optim.sgld import SGLD\n"
    )
    want = (
        "import torch\nfrom torch import nn\nif True:\n    from gradsketch.sampling import SGLD\n"
    )
    assert rewrite_imports(src) == want


@pytest.mark.parametrize(
    ("src", "match"),
    [
        ("from devinterp.slt.writing import x\n", r"devinterp\.slt\.writing.*IMPORT_TABLE"),
        ("import devinterp.optim\n", r"`import devinterp.optim` imports a peer package"),
        ("import trak\n", r"`import trak` imports a peer package"),
    ],
    ids=["unmapped-module", "plain-import-devinterp", "plain-import-trak"],
)
def test_unmapped_peer_imports_are_refused_naming_the_fix(src, match):
    with pytest.raises(UnmappedImportError, match=match):
        rewrite_imports(src, name="t.py")


def test_cpu_port_moves_only_cuda_marked_tests_to_the_cpu():
    src = (
        'def test_a():\n    f(device="cuda:0")\n\n'
        '@pytest.mark.cuda\ndef test_b():\n    f(x.cuda(), device="cuda:0")\n'
    )
    want = (
        'def test_a():\n    f(device="cuda:0")\n\n'
        '@pytest.mark.cuda\ndef test_b():\n    f(x, device="cpu")\n'
    )
    assert cpu_port(src) == want


# ---------------------------------------------------------------- LLC scale invariance
class _TinyLM(nn.Module):
    """Embedding -> one linear head: per-token logits ``[batch, seq, vocab]``."""

    def __init__(self, vocab: int = 23, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(ids)))


def _scaled_ce(scale: float):
    """devinterp's own loss order (``log_softmax`` over the logits, ``gather``), times ``scale``."""

    def loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        log_probs = F.log_softmax(model(ids)[..., :-1, :], dim=-1)
        return -scale * log_probs.gather(dim=-1, index=ids[..., 1:].unsqueeze(-1)).squeeze(-1)

    return loss


def _llc(loss_fn, n_beta: float):
    from gradsketch.slt import llc

    torch.manual_seed(3)
    model = _TinyLM()
    ids = torch.randint(0, 23, (8, 12), generator=torch.Generator().manual_seed(1))
    return llc(
        model,
        ids,
        {"self": (ids, 2)},
        lr=1e-3,
        n_beta=n_beta,
        loss_fn=loss_fn,
        num_chains=4,
        num_draws=3,
        batch_size=2,
        num_init_loss_batches=1,
        init_seed=42,
    )


def _assert_bit_equal(base, scaled) -> None:
    for key in ("llc_mean", "llc_std", "llc_per_chain"):
        a, b = (torch.as_tensor(r[key].values) for r in (base, scaled))
        assert torch.equal(a, b), (key, a, b)
    for key in ("loss_trace", "init_loss"):  # the losses themselves are exactly doubled
        a, b = (torch.as_tensor(r[key].values) for r in (base, scaled))
        assert torch.equal(2 * a, b), (key, a, b)


def test_llc_of_a_doubled_loss_fn_at_half_nbeta_is_bit_equal():
    """``llc(2 L, N / 2) == llc(L, N)`` for a ``loss_fn`` given both times: the sampler
    (gradsketch.sampling) and the estimate keep the factor 2 exact."""
    pytest.importorskip("xarray")
    _assert_bit_equal(_llc(_scaled_ce(1.0), 1.0), _llc(_scaled_ce(2.0), 0.5))


def test_llc_of_the_default_loss_scales_as_devinterps_log_softmax_loss():
    """devinterp's ``test_llc_scaling_invariance``: the default loss against ``2 L`` written
    with ``log_softmax`` + ``gather``, bit for bit."""
    pytest.importorskip("xarray")
    _assert_bit_equal(_llc(None, 1.0), _llc(_scaled_ce(2.0), 0.5))
