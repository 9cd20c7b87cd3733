"""A store does not depend on what ran earlier in the process; progress bars on request.

:func:`gradsketch.slt.sample` keeps initial losses L(w*) and ``lr="auto"`` steps in a
:class:`~gradsketch.slt.SamplingCache`: a fresh one per call, or one that calls share,
keyed by everything that decides their bits. The test runs a 1-chain call and then a
2-chain call with the same settings in one process (each with a cache of its own, or
both with one shared cache), and compares the 2-chain store with one made by a call
with a fresh cache, variable by variable and bit for bit. A model with dropout makes
L(w*) depend on the dropout stream it is computed with; with ``init_noise`` every
chain computes its own L(w*).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _slt_helpers import tiny_gpt2, token_data

from gradsketch.slt import SamplingCache, sample

KW: dict[str, Any] = dict(
    lr=1e-4,
    n_beta=20.0,
    num_draws=2,
    batch_size=4,
    batches_per_draw=1,
    num_init_loss_batches=2,
)


def _arrays(tree: Any) -> dict[str, np.ndarray]:
    return {name: np.asarray(var.values) for name, var in tree.dataset.data_vars.items()}


@pytest.mark.parametrize("shared", [False, True], ids=["own-cache", "shared-cache"])
@pytest.mark.parametrize("init_noise", [None, 1e-3], ids=["shared-init", "init-noise"])
def test_a_store_is_the_same_whatever_ran_before(
    tmp_path: Path, init_noise: float | None, shared: bool
) -> None:
    model = tiny_gpt2(dropout=0.1)
    data = token_data(16)
    kw = {**KW, "init_noise": init_noise}
    fresh = _arrays(
        sample(
            model,
            data,
            {"d": data},
            num_chains=2,
            output_path=tmp_path / "fresh",
            cache=SamplingCache(),
            **kw,
        )
    )
    cache = SamplingCache() if shared else None
    sample(model, data, {"d": data}, num_chains=1, output_path=tmp_path / "one", cache=cache, **kw)
    if shared:
        assert cache is not None and len(cache.init_losses) == 1
    after = _arrays(
        sample(
            model,
            data,
            {"d": data},
            num_chains=2,
            output_path=tmp_path / "after",
            cache=cache,
            **kw,
        )
    )
    assert sorted(after) == sorted(fresh)
    for name, values in fresh.items():
        assert np.array_equal(after[name], values, equal_nan=True), name
    init = fresh["init_loss"]
    if init_noise is None:  # one L(w*) for every chain: chain 0's stream
        assert np.array_equal(init[0], init[1])
    else:  # each chain its own noisy weights
        assert not np.array_equal(init[0], init[1])


def test_progress_bars_on_request(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tiny_gpt2()
    data = token_data(8)
    kw = {**KW, "num_chains": 1}
    sample(model, data, {"d": data}, output_path=tmp_path / "a", progress=True, **kw)
    err = capsys.readouterr().err
    assert "sampling" in err and "2/2" in err  # 1 chain x 2 draws
    sample(model, data, {"d": data}, output_path=tmp_path / "b", progress=False, **kw)
    assert capsys.readouterr().err == ""
    torch.manual_seed(0)
