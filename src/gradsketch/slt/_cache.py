"""Initial losses and ``lr="auto"`` steps that calls of :func:`~gradsketch.slt.sample` share."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["SamplingCache"]


class SamplingCache:
    """Initial losses L(w*) and ``lr="auto"`` steps that calls of :func:`sample` may share.

    Each :func:`sample` call makes a fresh one unless it is given one;
    :func:`~gradsketch.slt.susceptibilities` gives one to all its
    restrictions' calls, so that L(w*) (which ignores the restriction, as
    devinterp's does) and the ``lr="auto"`` pilots run once. Every entry is
    keyed by everything that decides its bits, so a store made with a cache
    that earlier calls filled is bit for bit the store made with a fresh one.

    Keys:
        ``init_losses``: ``(model digest, modules' repr digest, data digest,
        loss_fn, batch_size, gradient_accumulation_steps,
        num_init_loss_batches, init_seed, init_noise, shuffle,
        match_sampling_input_ids_across_chains, device, threads, chains in
        threads, fast-path record, chain)`` -> ``[token_pos]`` float32, with
        chain 0 for every chain when all chains share one L(w*) (same
        batches, no ``init_noise``: chain 0's dropout stream).
        ``auto_lrs``: ``(model digest, data digest, loss_fn, n_beta,
        localization, batch_size, init_seed, device, threads, fast_path)`` ->
        the calibrated step.

    Example:
        >>> cache = SamplingCache()
        >>> cache.auto_lrs[("model", "data")] = 1e-4
        >>> len(cache), cache.clear(), len(cache)
        (1, None, 0)
    """

    def __init__(self) -> None:
        self.init_losses: dict[tuple[Any, ...], np.ndarray] = {}
        self.auto_lrs: dict[tuple[Any, ...], float] = {}

    def __len__(self) -> int:
        return len(self.init_losses) + len(self.auto_lrs)

    def __repr__(self) -> str:
        return (
            f"SamplingCache({len(self.init_losses)} initial losses, "
            f"{len(self.auto_lrs)} lr='auto' steps)"
        )

    def clear(self) -> None:
        """Forget every entry."""
        self.init_losses.clear()
        self.auto_lrs.clear()
