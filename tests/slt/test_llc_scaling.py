"""``llc(2 L, n_beta / 2) == llc(L, n_beta)`` bit for bit, as devinterp 2.0.1 gives it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from _slt_helpers import tiny_gpt2, token_data

from gradsketch import slt
from gradsketch.slt import per_token_loss


def _twice(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return 2 * per_token_loss(model, ids)


@pytest.mark.slow  # ~15 s: two slt.llc runs on a tiny GPT-2
@pytest.mark.filterwarnings("ignore::gradsketch.slt.FewChainsWarning")  # bit equality
def test_llc_of_scaled_loss_and_n_beta_is_bit_equal(tmp_path: Path) -> None:
    """The chains see ``(n_beta / 2) (2 grad L)``, the same numbers as ``n_beta grad L``
    (scaling by 2 is exact in binary floating point, the loss is scaled per token before
    any sum), and ``compute_llc`` is ``n_beta (mean L - mean L0)`` computed once, in the
    same order: every per-chain LLC is equal, not just close."""
    from datasets import Dataset

    model = tiny_gpt2()
    ds = Dataset.from_dict({"input_ids": token_data(16).tolist()}).with_format("torch")
    kw = dict(
        lr=1e-4,
        localization=100.0,
        num_chains=2,
        num_draws=3,
        batch_size=4,
        num_init_loss_batches=2,
    )
    a = slt.llc(model, ds, {"train": ds}, n_beta=20.0, output_path=tmp_path / "a.zarr", **kw)
    b = slt.llc(
        model,
        ds,
        {"train": ds},
        n_beta=10.0,
        loss_fn=_twice,
        output_path=tmp_path / "b.zarr",
        **kw,
    )
    assert float(a["llc_mean"]) > 0
    for name in ("llc_mean", "llc_std", "llc_per_chain", "llc_scalar"):
        assert np.array_equal(np.asarray(a[name].values), np.asarray(b[name].values)), name
    assert np.array_equal(2 * a["init_loss"].values, b["init_loss"].values)
