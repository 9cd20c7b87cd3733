"""The reverse pass: exact metagradients of a replayed run, back through its steps.

Each segment between the run's checkpoints is recomputed forward, and each
step is reversed with the optimizer's own adjoint rules (:func:`reverse_step`)
and one second-order product through the weighted loss: ``H d̄`` and the
per-example ``∇ℓ_i · d̄`` from one forward-over-reverse ``torch.func.jvp`` of
``torch.func.grad`` (reverse-over-reverse with a batched second backward for
small query blocks and for models ``vmap`` cannot trace). A block of ``m``
queries is carried through one reverse pass as ``[m, ...]`` cotangents.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor
from tqdm.auto import tqdm

from gradsketch.attribution._replay_run import (
    Layout,
    Params,
    ReplayRun,
    ReplaySettings,
    joined,
    opt_step,
    rows_of,
)

#: Query blocks of at least this many are pulled back by ``vmap`` over forward-over-reverse
#: ``jvp``; smaller ones by reverse-over-reverse from the recomputation's kept graphs
#: (on the digits MLP, CPU, one thread, the two tie at 16 queries; the jvp path keeps
#: no graphs, so ties go to it).
JVP_MIN_BLOCK = 16


def reverse_step(
    s: ReplaySettings,
    layout: Layout,
    step: int,
    theta: Tensor,
    state: dict[str, Tensor],
    grad: Tensor | None,
    bar_theta: Tensor,
    bar_state: dict[str, Tensor],
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Adjoints through one step, for ``[m, P]`` cotangent blocks, in place.

    Given the pre-step parameters and state, the step's gradient (read by
    Adam's rules only), and the adjoints of the step's outputs (``bar_theta``
    of θ_{t+1}, ``bar_state`` of the state after the step), returns
    ``(d̄, θ̄_direct, statē_before)``: the adjoint ``d̄`` of the loss gradient
    (to be pulled back through the double backward by the caller, which adds
    ``H d̄`` to θ̄ and ``∂g/∂w ᵀ d̄`` to w̄), the part of θ̄_t that does not
    pass through the gradient, and the state's adjoint before the step.

    The ``[m, P]`` adjoints are parameter-sized times ``m``, so each
    elementwise pass over them costs memory bandwidth: ``bar_theta`` and
    ``bar_state`` are overwritten (they must be the caller's own buffers) and
    the results may alias them. SGD's momentum adjoint is carried unscaled:
    ``bar_state["momentum_buffer"]`` is ``b̄``, the adjoint of the buffer the
    step wrote, and the state adjoint before the step, ``μ·b̄``, is formed
    when the step before reads it.
    """
    lr = s.lr_at(step)
    bar_g: list[Tensor] = []
    for a, b, wd in layout.groups:
        tb = bar_theta[:, a:b]
        if s.optimizer == "sgd":
            # θ' = θ - lr·b,  b = μ·b_prev + g + wd·θ  (b = g + wd·θ without momentum)
            if s.momentum > 0:
                bar_b = bar_state["momentum_buffer"][:, a:b].mul_(s.momentum).add_(tb, alpha=-lr)
            else:
                bar_b = tb * -lr
            bar_g.append(bar_b)
            if wd:
                tb.add_(bar_b, alpha=wd)
            continue
        assert grad is not None
        p, g = theta[a:b], grad[a:b]
        b1, b2 = s.betas
        decay = 1 - lr * wd if s.optimizer == "adamw" else 1.0
        d = g if s.optimizer == "adamw" or not wd else g.add(p, alpha=wd)
        m = state["exp_avg"][a:b].lerp(d, 1 - b1)
        v = state["exp_avg_sq"][a:b] * b2 + d * d * (1 - b2)
        c1, c2 = 1 - b1 ** (step + 1), 1 - b2 ** (step + 1)
        root = v.sqrt() / math.sqrt(c2)
        denom = root + s.eps
        # u = (m / c1) / (√(v / c2) + ε);  θ' = decay·θ - lr·u
        du_dm = 1.0 / (c1 * denom)
        # ∂u/∂v = -(m / c1) / denom² · 1 / (2 √(v c2)); zero where v = 0 (then m = 0 too).
        safe = torch.where(v > 0, v, torch.ones_like(v))
        du_dv = torch.where(
            v > 0, -(m / c1) / (denom * denom) / (2 * torch.sqrt(safe * c2)), torch.zeros_like(v)
        )
        bar_m = bar_state["exp_avg"][:, a:b].addcmul_(tb, du_dm, value=-lr)
        bar_v = bar_state["exp_avg_sq"][:, a:b].addcmul_(tb, du_dv, value=-lr)
        bar_d = (bar_v * ((2 * (1 - b2)) * d)).add_(bar_m, alpha=1 - b1)
        bar_m.mul_(b1)
        bar_v.mul_(b2)
        bar_g.append(bar_d)
        if decay != 1.0:
            tb.mul_(decay)
        if wd and s.optimizer == "adam":
            tb.add_(bar_d, alpha=wd)
    return joined(bar_g), bar_theta, bar_state


_FORWARD_AD_READY = False


def _load_forward_ad_rules() -> None:
    """Load torch's forward-mode decompositions once, quietly.

    The first dual tensor makes torch script its jvp decompositions, which on
    torch >= 2.9 warns that ``torch.jit.script`` is deprecated: torch's own
    internals, nothing the caller can act on.
    """
    global _FORWARD_AD_READY
    if _FORWARD_AD_READY:
        return
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"`torch.jit.script` is deprecated", category=DeprecationWarning
        )
        torch.func.jvp(torch.sin, (torch.zeros(()),), (torch.ones(()),))
    _FORWARD_AD_READY = True


@dataclass
class _StepGraph:
    """One step's leaves and gradient with its graph, kept for the second backward."""

    params: Params
    weights: Tensor
    grads: tuple[Tensor, ...]


@dataclass
class _Saved:
    """One recomputed step of a segment: flat parameters, state and gradient before it."""

    theta: Tensor
    state: dict[str, Tensor]
    grad: Tensor | None
    graph: _StepGraph | None


class ReversePass:
    """Metagradients of a trained :class:`ReplayRun`, back through its recorded steps.

    Args:
        run: the run (trained before :meth:`reverse`).
    """

    def __init__(self, run: ReplayRun) -> None:
        self.run = run
        # Smallest query block pulled back by forward-over-reverse (see pullback).
        self.jvp_min_block = JVP_MIN_BLOCK

    def keeps_graphs(self, m: int) -> bool:
        """Whether a block of ``m`` queries is pulled back by reverse-over-reverse."""
        return m < self.jvp_min_block or self.run.vmap_ok is False

    # -- one step's second-order product ------------------------------------------------
    def pullback(self, theta: Params, idx: Tensor, bar_g: Params) -> tuple[Params, Tensor]:
        """``(H d̄, ∂g/∂w ᵀ d̄)`` for a ``[m, ...]`` block ``d̄``, by forward-over-reverse.

        ``g = ∇L`` so ``(∂g/∂θ)ᵀ = H`` is symmetric and ``H d̄`` is a
        Jacobian-vector product of ``g``; ``∂g/∂w_i ᵀ d̄`` follows from the
        tangents ``∇ℓ_i · d̄`` of the losses ``ℓ_i`` along ``d̄``
        (:meth:`ReplayRun.weight_tangents`). One ``jvp`` gives both.

        Blocks smaller than :data:`JVP_MIN_BLOCK` take the reverse-over-reverse
        path instead: forward-mode AD under ``vmap`` carries a fixed overhead
        per operation that a few tangents do not amortize, and the segment's
        recomputation keeps each step's graph for the second backward (digits
        MLP, one thread, whole reverse pass: 2.8 against 6.8 training runs for
        one query, 11 against 13 for 8, a tie at 16, 36 against 30 for 32).
        Both are exact; they differ by rounding only.
        """
        m = next(iter(bar_g.values())).shape[0]
        if not self.keeps_graphs(m):
            try:
                result = self._pullback_jvp(theta, idx, bar_g)
            except RuntimeError as exc:
                if "vmap" not in str(exc):
                    raise
                self.run.vmap_ok = False
            else:
                self.run.vmap_ok = True
                return result
        return self.second_backward(self.first_backward(theta, idx), bar_g)

    def _pullback_jvp(self, theta: Params, idx: Tensor, bar_g: Params) -> tuple[Params, Tensor]:
        _load_forward_ad_rules()
        run = self.run
        rows = rows_of(run.data, idx)
        weights = run.run_weights(idx)

        def grad_and_losses(params: Params) -> tuple[Params, Tensor]:
            out: tuple[Params, Tensor] = torch.func.grad(run.losses, has_aux=True)(
                params, weights, rows
            )
            return out

        def tangents(d: Params) -> tuple[Params, Tensor]:
            hess, dloss = torch.func.jvp(grad_and_losses, (theta,), (d,))[1]
            return hess, dloss

        hess, dloss = torch.func.vmap(tangents)(bar_g)
        return hess, run.weight_tangents(weights, dloss)

    def first_backward(self, theta: Params, idx: Tensor) -> _StepGraph:
        """One step's forward and gradient, with the graph the second backward needs.

        With :meth:`second_backward` this is the pull-back by reverse-over-reverse,
        vmapping only the second backward: for small blocks and for models whose
        forward ``vmap`` cannot trace (data-dependent control flow, as
        transformers' attention-mask checks), the forward and first backward run
        once, plainly; ``is_grads_batched`` vmaps the backward of the gradient.
        """
        run = self.run
        names = list(theta)
        with torch.enable_grad():
            params = {n: theta[n].detach().requires_grad_(True) for n in names}
            w = run.run_weights(idx).requires_grad_(True)
            loss = run.batch_loss(params, w, rows_of(run.data, idx))
            grads = torch.autograd.grad(loss, [params[n] for n in names], create_graph=True)
        return _StepGraph(params, w, grads)

    def second_backward(self, graph: _StepGraph, bar_g: Params) -> tuple[Params, Tensor]:
        """``(H d̄, ∂g/∂w ᵀ d̄)`` from a kept step graph (which it frees)."""
        names = list(graph.params)
        grads, w = graph.grads, graph.weights
        live = [i for i, g in enumerate(grads) if g.requires_grad]
        single = next(iter(bar_g.values())).shape[0] == 1
        with torch.enable_grad():
            try:
                # One cotangent: a plain second backward (vmap's overhead buys nothing).
                pulled = torch.autograd.grad(
                    [grads[i] for i in live],
                    [*(graph.params[n] for n in names), w],
                    grad_outputs=[bar_g[names[i]][0] if single else bar_g[names[i]] for i in live],
                    is_grads_batched=not single,
                    allow_unused=True,
                )
                if single:
                    pulled = tuple(None if t is None else t.unsqueeze(0) for t in pulled)
            except RuntimeError as exc:
                if "not implemented" not in str(exc):
                    raise
                raise RuntimeError(
                    f"`model` ({type(self.run.model).__name__}) cannot be replayed: an operation "
                    f"in its forward has no second derivative in torch ({exc}), and the replay "
                    "differentiates each training step's gradient. For Hugging Face models "
                    "load them with eager attention (config._attn_implementation = 'eager' or "
                    "attn_implementation='eager' in from_pretrained); otherwise replace that "
                    "operation."
                ) from exc
        m = next(iter(bar_g.values())).shape[0]
        hess = {
            n: (torch.zeros_like(bar_g[n]) if h is None else h.detach())
            for n, h in zip(names, pulled[:-1], strict=True)
        }
        dw = pulled[-1]
        w_part = w.new_zeros(m, w.shape[0]) if dw is None else dw.detach()
        return hess, w_part

    def measure_activations(self) -> tuple[int, int]:
        """Bytes autograd saves for one step: a plain backward, and one kept for a second."""
        run = self.run
        measured = []
        idx = run.order[0]
        for create_graph in (False, True):
            total = 0

            def pack(t: Tensor) -> Tensor:
                nonlocal total
                total += t.numel() * t.element_size()
                return t

            params = {n: p.detach().requires_grad_(True) for n, p in run.params0.items()}
            with (
                torch.enable_grad(),
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
            ):
                weights = run.run_weights(idx).requires_grad_(create_graph)
                loss = run.batch_loss(params, weights, rows_of(run.data, idx))
                grads = torch.autograd.grad(loss, list(params.values()), create_graph=create_graph)
            # A kept graph also holds its gradients.
            total += sum(g.numel() * g.element_size() for g in grads) if create_graph else 0
            measured.append(total)
        return measured[0], measured[1]

    # -- segments and the whole pass ----------------------------------------------------
    def segment(self, start: int, stop: int, graphs: bool = False) -> list[_Saved]:
        """The pre-step states of steps ``start..stop-1``, recomputed from the checkpoint.

        Each entry holds the flat parameters and state before the step and,
        for Adam and AdamW, whose reverse rules recompute the moments, the
        step's flat gradient (computed here anyway, so the reverse pass does
        not run the step's forward and backward again). With ``graphs`` each
        step's forward and first backward are kept with their graph, so that
        reverse-over-reverse pulls back without running them again (memory:
        the segment's graphs, ``k`` steps' activations).
        """
        run = self.run
        saved: list[_Saved] = []
        theta, state = run.checkpoints[start]
        keep_grad = run.settings.optimizer != "sgd"
        if not graphs:

            def keep(t: int, p: Tensor, o: dict[str, Tensor], g: Tensor) -> None:
                saved.append(_Saved(p, o, g if keep_grad else None, None))

            with torch.no_grad():
                run.forward(start, stop, theta, state, None, keep)
            return saved
        for t in range(start, stop):
            graph = self.first_backward(run.layout.views(theta), run.order[t])
            grad = run.layout.flat(
                {n: g.detach() for n, g in zip(graph.params, graph.grads, strict=True)}
            )
            saved.append(_Saved(theta, state, grad if keep_grad else None, graph))
            with torch.no_grad():
                theta, state = opt_step(run.settings, run.layout, t, theta, state, grad)
        return saved

    def reverse(
        self,
        batch: tuple[Tensor, ...],
        *,
        progress: bool = True,
        at_steps: tuple[int, ...] | None = None,
    ) -> Tensor:
        """``[n_train, m]`` metagradients of the ``m`` queries of ``batch``, on the run's device.

        ``at_steps``: the mean over ``t`` in ``at_steps`` of ``∂f_j(θ_t) / ∂w_i``
        (``θ_t`` the parameters after ``t`` steps; default ``(T,)``). The
        metagradient is linear in the cotangent, so one pass carries them all:
        each ``t``'s query gradient joins the adjoint of ``θ_t`` on the way back.
        """
        run = self.run
        s, layout = run.settings, run.layout
        final = run.require_trained()
        m = int(batch[0].shape[0])
        steps = (s.num_steps,) if at_steps is None else at_steps
        share = 1.0 / len(steps)
        # Owned flat buffers: the reverse steps update the adjoints in place.
        bar_theta = layout.flat(run.query_grads(batch, final), batch=m)
        bar_theta.mul_(share if s.num_steps in steps else 0.0)
        bar_state = {k: torch.zeros_like(bar_theta) for k in s.state_names}
        bar_w = bar_theta.new_zeros(m, run.n_train)
        starts = sorted(run.checkpoints, reverse=True)
        bar = tqdm(total=s.num_steps, desc="replay (reverse)", disable=not progress)
        for start in starts:
            stop = min(start + run.every, s.num_steps)
            saved = self.segment(start, stop, graphs=self.keeps_graphs(m))
            for t in range(stop - 1, start - 1, -1):
                step = saved.pop()
                idx = run.order[t]
                bar_g, bar_theta, bar_state = reverse_step(
                    s, layout, t, step.theta, step.state, step.grad, bar_theta, bar_state
                )
                if step.graph is None:
                    hess, w_part = self.pullback(layout.views(step.theta), idx, layout.views(bar_g))
                else:
                    hess, w_part = self.second_backward(step.graph, layout.views(bar_g))
                bar_theta.add_(layout.flat(hess, batch=m))
                bar_w.index_add_(1, idx.to(bar_w.device), w_part)
                if t in steps and t > 0:  # θ_t is this step's input
                    grads = run.query_grads(batch, layout.views(step.theta))
                    bar_theta.add_(layout.flat(grads, batch=m), alpha=share)
                del step
                bar.update(1)
        bar.close()
        return bar_w.T.contiguous()
