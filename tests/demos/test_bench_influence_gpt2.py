"""The GPT-2 protocol's gradsketch runner (benchmarks/bench_influence.py runs it)."""

from __future__ import annotations

import numpy as np
import torch

from gradsketch.demos.lm import LMDemoSettings, build_lm
from gradsketch.demos.protocols.influence import run_lm_influence


def test_lm_runner_ensembles_checkpoints_without_changing_them(tmp_path) -> None:
    """Two checkpoints' scores are the mean of each one's, and the models keep their weights."""
    s = LMDemoSettings(width=8, n_head=2, n_layer=1, chunk_len=8)
    models = [build_lm(s, seed=seed).eval() for seed in (0, 1)]
    before = [{k: v.clone() for k, v in m.state_dict().items()} for m in models]
    ids = torch.randint(0, 200, (10, 8), generator=torch.Generator().manual_seed(0))
    train, queries = ids[:8], ids[8:]
    kwargs = {"method": "kfac", "lambda_reg": "auto"}  # sampled draws depend on the model id
    both = run_lm_influence(models, train, queries, s, str(tmp_path), **kwargs)
    for model, state in zip(models, before):
        assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    each = [run_lm_influence([m], train, queries, s, str(tmp_path), **kwargs) for m in models]
    np.testing.assert_allclose(both, (each[0] + each[1]) / 2, rtol=1e-5, atol=1e-6)
