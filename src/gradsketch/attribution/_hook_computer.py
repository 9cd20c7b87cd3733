"""Per-example gradients from layer hooks, and factorized projection without them.

One forward and one backward pass of the *batched* model output
``F = sum_b f(z_b; θ)`` give, for every layer, its inputs ``a`` (forward hooks,
stored detached) and the gradients ``g = dF/d(output)`` of its outputs (one
``autograd.grad`` asked for the gradient edge of every layer output, so no
parameter gradient is computed and no output is copied). The out-to-loss
terms Q reuse the logits of that same forward. Examples do not interact
(eval mode, no batch statistics), so
``g[b] = df(z_b)/d(output_b)`` exactly, and each layer's per-example
parameter gradient is a closed form in ``(a[b], g[b])``, given by the rules
of :mod:`gradsketch.attribution._layers` (one file per layer family). Modules
without a rule get per-example gradients of their own parameters from
``torch.func`` on the stored inputs (or, where ``vmap`` cannot trace the
module, from one ``autograd.grad`` per example on its stored inputs).

Rows of a call belong to examples in one of two layouts: the batch on dim 0
(``[B, ...]``), or the batch and a sequence of the batch flattened together,
batch-major (``[B * T, ...]`` with ``T`` a length of the batch's tensors, as
OPT's MLP and the routers of mixture-of-experts layers see them). A module
whose rows fit neither (a computation shared by all examples, as T5's
relative position bias; a data-dependent subset of the tokens, as one expert
of a mixture of experts sees) is handed to the nearest enclosing module that
sees the batch, which then gets its parameters' per-example gradients.

With a :class:`gradsketch.sketch.FactorizedProjector`, Linear and Conv2d
layers hand ``(a, g)`` to the projector, which returns
``sum_t (P_out g_t) ⊗ (P_in a_t)``: per-example gradients of those layers
are never built. With a flat projector (count sketch, JL) each call's
per-example gradient is projected at its parameters' offsets as soon as it
is formed (a weight with Kronecker factors in row chunks, Embedding rows
where they are) and dropped: a linear map of a concatenation is the sum of
its blocks' images, so no ``[batch, grad_dim]`` tensor is ever held.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

from gradsketch.attribution._batch_shared import (
    broadcasts_over_batch,
    expand_shared,
    expand_to_batch,
)
from gradsketch.attribution._capture import (
    CallRecord,
    OutputRouter,
    VmapChoice,
    backward_to_outputs,
    detach_tree,
    model_family,
    module_grads_on_inputs,
    refuse_wrapped,
    release_edges,
    shapes_of,
)
from gradsketch.attribution._gradient_base import AbstractGradientComputer, resolve_grad_wrt
from gradsketch.attribution._layers import (
    GRAD_SAMPLERS,
    LAYER_FACTORS,
    ROW_SPARSE_SAMPLERS,
    WHOLE_MODULES,
    HookComputationError,
    register_optional_rules,
)
from gradsketch.attribution._layers._rows import RowLayout, batch_lengths
from gradsketch.attribution._modelout import (
    LOSS_GRAD_FROM_OUTPUT,
    resolve_batch_output,
)
from gradsketch.errors import WrappedModelError
from gradsketch.sketch import (
    TRANSPOSED_WEIGHT,
    FactorizedLayer,
    FactorizedProjector,
    PlainParam,
    output_dtype,
    param_layout,
)

__all__ = ["HookGradientComputer", "WrappedModelError", "model_family", "refuse_wrapped"]

logger = logging.getLogger(__name__)

#: Bytes of one chunk of a per-example weight gradient formed for the rest block.
REST_CHUNK_BYTES = 64 << 20


# -- the hooked units ----------------------------------------------------------
@dataclass
class _Unit:
    """A hooked module and the parameters whose gradients it produces.

    A fallback unit (no rule) owns its direct parameters and those of the
    children it adopted (whose calls do not map to the examples); a unit of
    :data:`WHOLE_MODULES` owns its whole subtree.
    """

    name: str
    module: nn.Module
    fallback: bool
    params: dict[str, str]  # local name (relative to module) -> full parameter name
    #: Whether ``vmap`` traces a fallback unit (see :class:`VmapChoice`).
    vmap: VmapChoice[dict[str, Tensor]] = field(default_factory=VmapChoice)


@dataclass(kw_only=True)
class _Call(CallRecord):
    """One call of a unit during the hooked forward."""

    unit: _Unit


class _Capture:
    """State of one hooked forward + backward."""

    def __init__(self, layout: RowLayout) -> None:
        self.layout = layout
        self.batch_size = layout.batch_size
        self.calls: list[_Call] = []
        #: Units whose calls' rows do not map to the examples, with a shape they returned.
        self.unmapped: dict[str, str] = {}
        self.router = OutputRouter()
        #: Outputs of the root module's calls (for the out-to-loss terms).
        self.root_outputs: list[Any] = []


def _has_forward(module: nn.Module) -> bool:
    """Whether the module can be called (ModuleList / ModuleDict only hold children)."""
    return type(module).forward is not nn.Module.forward


class HookGradientComputer(AbstractGradientComputer):
    """Per-example gradients from layer hooks, one forward and one backward per batch.

    Modules are visited from the root: a module whose exact type has a rule
    in :data:`GRAD_SAMPLERS` (Linear, Conv2d, Embedding, LayerNorm, RMSNorm,
    Hugging Face's Conv1D and RMSNorm classes, or any type you register) is
    hooked; any other module owning parameters directly is hooked too and its
    own parameters' per-example gradients come from ``torch.func`` (``vmap``
    of ``grad``; one ``autograd.grad`` per example where ``vmap`` cannot trace
    the module) on its stored inputs, while its children are visited in
    turn; parameter-free containers are descended into; a module of
    :data:`WHOLE_MODULES` (mixture-of-experts containers) is hooked as a
    whole. The batched output ``F = sum_b f(z_b)`` comes from
    :func:`resolve_batch_output`; the backward computes only activation
    gradients (never the batch gradient of the parameters), and parameters
    need not require grad.

    Assumptions (as for any per-example method): examples do not interact
    (eval-mode BatchNorm, no cross-example attention, padding masked out),
    and each hooked module's rows are the batch on dim 0 or the batch
    flattened batch-major with one of the batch's lengths (``[B * T, ...]``,
    see :mod:`gradsketch.attribution._layers._rows`). A module whose
    inputs are integer indices only and which returns a leading dim of 1
    (learned position embeddings, ``[1, T, D]``) has its output expanded to
    the batch, so each example's gradient stays its own. A module whose rows
    map to neither (T5's relative position bias, shared by all examples; one
    expert's gathered tokens) is adopted by the nearest enclosing module that
    can be called, which then computes those parameters' per-example
    gradients as a fallback; this is found on the first batch, logged, and
    kept. So is a module never called whose parameters still get a gradient
    (its weight read directly by its parent). A weight used by several
    modules (tied input and output embeddings) gets the sum of its uses'
    gradients, under the parameter's first name in ``named_parameters``.

    :meth:`project` with a :class:`gradsketch.sketch.FactorizedProjector`
    returns projected features without per-example gradients of the factorized
    layers; with any other projector that streams by coordinates (every
    gradsketch projector without a mask) it projects each layer's per-example
    gradient as soon as it is formed and drops it, so peak memory holds one
    layer's (at most :data:`REST_CHUNK_BYTES` of a weight with Kronecker
    factors), never the ``[batch, grad_dim]`` gradient; with others it projects
    :meth:`compute_per_sample_grad`.

    Hooks are installed on construction and stay idle outside this object's
    calls; :meth:`remove_hooks` (idempotent, also ``with`` exit) takes them off.

    Takes :class:`AbstractGradientComputer`'s arguments; ``model`` is the
    plain model (not DDP / FSDP wrapped).

    Raises:
        WrappedModelError: for DataParallel / DDP / FSDP models.

    Example:
        >>> from gradsketch.attribution import ImageClassificationModelOutput
        >>> nn = torch.nn
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        >>> gc = HookGradientComputer(model, ImageClassificationModelOutput())
        >>> grads = gc.compute_per_sample_grad((torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])))
        >>> {k: tuple(v.shape) for k, v in grads.items()}
        {'0.weight': (5, 8, 4), '0.bias': (5, 8), '2.weight': (5, 3, 8), '2.bias': (5, 3)}
        >>> gc.remove_hooks()
    """

    def _setup(self) -> None:
        self._batch_output = resolve_batch_output(self.modelout_fn)
        self._handles: list[RemovableHandle] = []
        self._units_model: nn.Module | None = None
        self._capture: _Capture | None = None
        self._checked_layouts: set[str] = set()
        self._remembered: tuple[tuple[Any, ...], tuple[Any, ...], Any] | None = None
        #: Module name -> names of the descendants it adopted (their rows do not map).
        self._adopted: dict[str, set[str]] = {}
        #: Why torch.func.vmap could not trace the model, when this computer stands in
        #: for a FunctionalGradientComputer (its errors then suggest other ways out).
        self.vmap_failure: str | None = None
        self.load_model_params(self.model)

    # -- set-up --------------------------------------------------------------
    def load_model_params(self, model: nn.Module) -> None:
        """Take a (new) model; hooks move to it if it is another object."""
        refuse_wrapped(model)
        if model is not self._units_model:
            self.remove_hooks()
            self.model = model
            self._names = [n for n, _ in model.named_parameters()]
            self.grad_wrt = resolve_grad_wrt(self._names, self._grad_wrt_arg)
            register_optional_rules(model)
            self._adopted = {}
            self._units = self._find_units(model)
            self._units_model = model
            self._checked_layouts = set()
            self.add_hooks()
        self._remembered = None
        self.func_weights = {n: p.detach() for n, p in model.named_parameters()}
        self.func_buffers = {n: b.detach() for n, b in model.named_buffers()}

    def _wanted(self) -> set[str]:
        return set(self._names if self.grad_wrt is None else self.grad_wrt)

    def _find_units(self, model: nn.Module) -> list[_Unit]:
        # named_parameters' canonical (first) name of each tensor, for tied weights.
        canonical = {id(p): n for n, p in model.named_parameters()}
        wanted = self._wanted()
        merged = {name for names in self._adopted.values() for name in names}
        units: list[_Unit] = []
        seen: set[int] = set()

        def full(prefix: str, local: str) -> str:
            return f"{prefix}.{local}" if prefix else local

        def plan(
            prefix: str, module: nn.Module
        ) -> tuple[bool, dict[str, str], list[tuple[str, nn.Module]]]:
            """``(fallback, {local name: parameter}, children to visit)`` of a module's unit."""
            direct = dict(module.named_parameters(recurse=False))
            adopted = sorted(self._adopted.get(prefix, ()))
            if type(module) in WHOLE_MODULES:
                return True, {k: canonical[id(p)] for k, p in module.named_parameters()}, []
            if type(module) in GRAD_SAMPLERS and not adopted:
                extra = [full(prefix, n) for n, _ in module.named_parameters() if n not in direct]
                if extra:
                    raise HookComputationError(
                        f"module {prefix!r} ({type(module).__name__}) has a grad-sampler rule "
                        f"but its children own parameters {extra[:5]}; register the rule on a "
                        "leaf type."
                    )
                return False, {k: canonical[id(p)] for k, p in direct.items()}, []
            params = {k: canonical[id(p)] for k, p in direct.items()}
            children = []
            for child_name, child in module.named_children():
                if isinstance(child, (nn.ParameterDict, nn.ParameterList)):
                    # Parameters held in a ParameterDict / ParameterList child are read
                    # by this module's forward (the container is never called, so a
                    # hook on it would never fire): they belong to this module (peft's
                    # LoRA embeddings keep their adapters this way).
                    params.update(
                        {f"{child_name}.{k}": canonical[id(p)] for k, p in child.named_parameters()}
                    )
                else:
                    children.append((full(prefix, child_name), child))
            for name in adopted:
                # What the adopted module's unit would own moves here; its children
                # keep their own units.
                local = name[len(prefix) + 1 :] if prefix else name
                _, theirs, _ = plan(name, model.get_submodule(name))
                params.update({f"{local}.{k}": v for k, v in theirs.items()})
            return True, params, children

        def visit(prefix: str, module: nn.Module) -> None:
            if id(module) in seen:
                # The same module object under a second name: one hook serves both.
                return
            seen.add(id(module))
            fallback, params, children = plan(prefix, module)
            if prefix not in merged:
                self._add_unit(units, prefix, module, fallback, params, wanted)
            for name, child in children:
                visit(name, child)

        visit("", model)
        for unit in units:
            if unit.fallback:
                logger.debug(
                    "HookGradientComputer: %r (%s) has no rule; torch.func fallback",
                    unit.name,
                    type(unit.module).__name__,
                )
        return units

    @staticmethod
    def _add_unit(
        units: list[_Unit],
        name: str,
        module: nn.Module,
        fallback: bool,
        params: dict[str, str],
        wanted: set[str],
    ) -> None:
        params = {k: v for k, v in params.items() if v in wanted}
        if params:
            units.append(_Unit(name, module, fallback, params))

    def add_hooks(self) -> None:
        """Install the forward hooks (idempotent)."""
        if self._handles:
            return
        for unit in self._units:
            self._handles.append(
                unit.module.register_forward_hook(self._make_hook(unit), with_kwargs=True)
            )

    def remove_hooks(self) -> None:
        """Remove every hook this computer installed (idempotent)."""
        while self._handles:
            self._handles.pop().remove()

    @property
    def hooks_installed(self) -> bool:
        """Whether hooks are currently installed."""
        return bool(self._handles)

    def __enter__(self) -> HookGradientComputer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove_hooks()

    # -- modules whose rows do not map to the examples ----------------------------
    def _adopter(self, name: str) -> str | None:
        """The nearest callable proper ancestor of module ``name`` (``None``: only the root)."""
        parent = name
        while parent:
            parent = parent.rpartition(".")[0]
            if parent and _has_forward(self.model.get_submodule(parent)):
                return parent
        return None

    def _adopt(self, unmapped: Mapping[str, str], layout: RowLayout) -> None:
        """Hand each unit in ``unmapped`` to its nearest callable ancestor; rebuild the hooks."""
        for name, why in unmapped.items():
            adopter = self._adopter(name)
            if adopter is None:
                raise HookComputationError(self._unmapped_message(name, why, layout))
            self._adopted.setdefault(adopter, set()).add(name)
            logger.info(
                "HookGradientComputer: %r (%s) %s; the per-example gradients of its parameters "
                "now come from %r (%s), run again on each example's inputs",
                name,
                type(self.model.get_submodule(name)).__name__,
                why,
                adopter,
                type(self.model.get_submodule(adopter)).__name__,
            )
        self.remove_hooks()
        self._units = self._find_units(self.model)
        self._checked_layouts = set()
        self.add_hooks()

    def _unmapped_message(self, name: str, why: str, layout: RowLayout) -> str:
        module = self.model.get_submodule(name) if name else self.model
        where = f"module {name!r}" if name else "the model"
        return (
            f"{where} ({type(module).__name__}) {why}; layer hooks need the batch on dim 0 "
            "(use batch_first=True) or the batch flattened batch-major with one of the batch's "
            f"lengths {sorted(layout.lengths)} ([B * T, ...]), and no module enclosing it below "
            f"the root of {model_family(self.model)} sees the examples apart. "
            f"{self._ways_out(name)}"
        )

    def _ways_out(self, name: str) -> str:
        """What to do instead when module ``name``'s per-example gradients cannot be hooked."""
        prefix = f"{name}." if name else ""
        own = [n for n in (self.grad_wrt or self._names) if n.startswith(prefix)]
        keep = [n for n in (self.grad_wrt or self._names) if not n.startswith(prefix)]
        ways = []
        if own and keep:
            ways.append(
                f"leave its parameters ({own[:3]}{' ...' if len(own) > 3 else ''}) out of "
                "`grad_wrt`: grad_wrt=[n for n, _ in model.named_parameters() if not "
                f"n.startswith({prefix!r})]"
            )
        if self.vmap_failure is None:
            ways.append(
                "use FunctionalGradientComputer (torch.func.vmap over the whole model), if vmap "
                "can trace the model"
            )
        else:
            ways.append(
                "FunctionalGradientComputer handed this model to the hooks because "
                f"torch.func.vmap cannot trace it ({self.vmap_failure}), so make the model "
                "traceable (no data-dependent control flow) or register a per-example rule "
                "for the module's type with @register_grad_sampler"
            )
        return "Ways out: " + "; or ".join(ways) + "."

    # -- the hooks -------------------------------------------------------------------
    def _make_hook(self, unit: _Unit) -> Callable[..., Any]:
        def hook(
            module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
        ) -> Any:
            capture = self._capture
            if capture is None:
                return None
            if capture.batch_size > 1 and broadcasts_over_batch(args, kwargs, output):
                # Learned position embeddings return [1, T, D] and let `+`
                # broadcast it; expanded to the batch here, the gradient keeps
                # one row per example and the rule sees per-example inputs.
                args, kwargs, output = expand_to_batch((args, kwargs, output), capture.batch_size)
            rows = capture.layout.call_rows((args, kwargs), output)
            if rows is None and capture.batch_size > 1:
                # T5's attention returns its relative position bias as [1, heads, q, k],
                # made from its parameters alone and broadcast over the batch later:
                # expanded here, its gradient keeps one row per example.
                expanded = expand_shared(args, kwargs, output, capture.batch_size)
                if expanded is not output:
                    rows = capture.layout.call_rows((args, kwargs), expanded)
                    output = expanded if rows is not None else output
            if rows is None:
                capture.unmapped.setdefault(
                    unit.name,
                    f"returned shape {shapes_of(output)} for a batch of {capture.batch_size}",
                )
                return None
            call = _Call(detach_tree(args), detach_tree(kwargs), rows, unit=unit)
            floating = [
                t
                for t in tree_flatten(output)[0]
                if isinstance(t, Tensor) and t.is_floating_point()
            ]
            new_output = capture.router.route(output, call, separate=len(floating) > 1)
            capture.calls.append(call)
            return new_output

        return hook

    @contextmanager
    def _capturing(self, layout: RowLayout) -> Iterator[_Capture]:
        if self._capture is not None:
            raise HookComputationError("a hooked computation is already running (re-entrant call).")
        if not self._handles:
            raise HookComputationError(
                "hooks were removed; call add_hooks() (or build a new HookGradientComputer) first."
            )
        self._capture = _Capture(layout)
        root_hook = self.model.register_forward_hook(self._capture_root)
        try:
            yield self._capture
        finally:
            root_hook.remove()
            self._capture = None

    def _capture_root(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._capture is not None:
            self._capture.root_outputs.append(detach_tree(output))

    def _run(self, batch: Sequence[Tensor]) -> _Capture:
        """Hooked forward of ``F = sum_b f(z_b)`` and backward to every layer output.

        A unit whose rows do not map to the examples, or that was never
        called although its parameters get a gradient, is adopted by its
        parent and the batch runs again (once per level, on the first batch).
        """
        self.check_batch(batch)
        batch_size = int(batch[0].shape[0])
        layout = RowLayout(batch_size, batch_lengths(batch, batch_size))
        self._remembered = None
        # Each pass that does not return adopts a module into a proper ancestor.
        for _ in range(sum(1 for _ in self.model.modules()) + 1):
            with self._capturing(layout) as capture, torch.enable_grad():
                outputs = self._batch_output(self.model, *batch)
                if outputs.shape != (batch_size,):
                    raise HookComputationError(
                        f"the batched output has shape {tuple(outputs.shape)}; expected "
                        f"({batch_size},) (one scalar per example)."
                    )
                if capture.unmapped:
                    self._adopt(capture.unmapped, layout)
                    continue
                stray = self._backward(outputs, capture)
                if stray:
                    self._adopt(stray, layout)
                    continue
            self._remember_output(batch, capture)
            return capture
        raise HookComputationError(  # pragma: no cover - each pass adopts at least one unit
            "the hooked units did not settle; please report this model."
        )

    def _backward(self, outputs: Tensor, capture: _Capture) -> dict[str, str]:
        """Output gradients of every call; returns the uncalled units whose weights got one."""
        called = {id(call.unit) for call in capture.calls}
        covered = {n for call in capture.calls for n in call.unit.params.values()}
        params = dict(self.model.named_parameters())
        # A unit never called whose parameters are not another called unit's
        # (tied) may still have been read directly, by its parent: ask for
        # their gradient too (a few leaves of the same backward).
        suspects = [
            (unit, name)
            for unit in self._units
            if id(unit) not in called
            for name in unit.params.values()
            if name not in covered and params[name].requires_grad
        ]
        got = backward_to_outputs(
            outputs.sum(), capture.calls, extra=[params[name] for _, name in suspects]
        )
        release_edges(capture.calls)
        return {
            unit.name: f"was never called but its parameter {name!r} has a gradient"
            for (unit, name), g in zip(suspects, got)
            if g is not None and bool(g.ne(0).any())
        }

    # -- out-to-loss terms from the hooked forward --------------------------------
    def _state_key(self, batch: Sequence[Tensor]) -> tuple[Any, ...]:
        # In-place changes bump `_version`: new weights or an edited batch
        # invalidate the remembered logits.
        return (
            tuple(t._version if isinstance(t, Tensor) else t for t in batch),
            tuple(p._version for p in self.model.parameters()),
            tuple(b._version for b in self.model.buffers()),
        )

    def _remember_output(self, batch: Sequence[Tensor], capture: _Capture) -> None:
        rule = LOSS_GRAD_FROM_OUTPUT.get(type(self.modelout_fn))
        if rule is None or len(capture.root_outputs) != 1:
            # A root called twice (or not at all) has no single output to reuse.
            self._remembered = None
            return
        self._remembered = (tuple(batch), self._state_key(batch), capture.root_outputs[0])

    def _take_remembered_output(self, batch: Sequence[Tensor]) -> Any:
        remembered, self._remembered = self._remembered, None
        if remembered is None:
            return None
        old_batch, key, output = remembered
        same = len(old_batch) == len(batch) and all(a is b for a, b in zip(old_batch, batch))
        if not same or key != self._state_key(batch):
            return None
        return output

    # -- per-example gradients --------------------------------------------------
    def compute_per_sample_grad(self, batch: Sequence[Tensor]) -> dict[str, Tensor]:
        """``{name: [B, *param.shape]}`` for the differentiated parameters, in model order."""
        capture = self._run(batch)
        grads: dict[str, Tensor] = {}
        for call in capture.calls:
            for name, g in self._call_grads(call, capture.batch_size).items():
                grads[name] = grads[name] + g if name in grads else g
        wanted = self._names if self.grad_wrt is None else self.grad_wrt
        params = dict(self.model.named_parameters())
        out: dict[str, Tensor] = {}
        for name in wanted:
            if name in grads:
                out[name] = grads[name]
            else:
                # Unused in this forward: its gradient is exactly zero.
                p = params[name]
                out[name] = p.new_zeros(capture.batch_size, *p.shape)
        return out

    def _call_grads(self, call: _Call, batch_size: int) -> dict[str, Tensor]:
        unit = call.unit
        if unit.fallback:
            local = module_grads_on_inputs(
                call, unit.module, list(unit.params), batch_size, unit.vmap, unit.name
            )
        else:
            g = _single_grad(call)
            local = (
                {}
                if g is None
                else GRAD_SAMPLERS[type(unit.module)](
                    unit.module, call.rule_inputs(batch_size), call.rule_grad(g, batch_size)
                )
            )
        return {unit.params[k]: v for k, v in local.items() if k in unit.params}

    def compute_loss_grad(self, batch: Sequence[Tensor]) -> Tensor:
        """``[batch, 1]`` out-to-loss terms from the task.

        Right after :meth:`project` / :meth:`compute_per_sample_grad` of the
        same batch objects (unchanged weights, buffers and batch), a task in
        :data:`LOSS_GRAD_FROM_OUTPUT` reuses the model output of that hooked
        forward instead of running another one; the result is the same.
        """
        output = self._take_remembered_output(batch)
        if output is not None:
            return LOSS_GRAD_FROM_OUTPUT[type(self.modelout_fn)](self.modelout_fn, output, batch)
        return self.modelout_fn.get_out_to_loss_grad(
            self.model, self.func_weights, self.func_buffers, batch
        )

    # -- projected features ------------------------------------------------------
    def project(self, batch: Sequence[Tensor], projector: Any, model_id: int | None) -> Tensor:
        """``[batch, proj_dim]`` projected gradients of the model output.

        With a :class:`FactorizedProjector`, Linear / Conv2d layers go through
        their Kronecker factors, Embedding rows are count-sketched where they
        are, and only the remaining parameters' per-example gradients are
        formed (a factorized layer inside a module hooked as a whole, such as
        a mixture-of-experts container, is projected from its per-example
        gradient). With any other projector that streams by coordinates
        (``projector.streams_by_coordinates``: every gradsketch projector
        without a mask), each layer's per-example gradient is projected at its
        parameters' offsets as soon as its call is reached and then dropped:
        the ``[batch, grad_dim]`` gradient never exists, a weight with Kronecker
        factors (a Linear, GPT-2's ``Conv1D``, a tied LM head) is formed
        :data:`REST_CHUNK_BYTES` at a time, and Embedding rows are projected
        where they are (:meth:`~gradsketch.sketch.SparseProjector.project_sparse_into_`).
        By linearity the result is ``projector.project(compute_per_sample_grad(batch))``
        up to the order of float additions. Otherwise that is what is computed.
        """
        if isinstance(projector, FactorizedProjector):
            self._check_layout(projector)
            projector.set_model_id(model_id)
            capture = self._run(batch)
            dtype = output_dtype(next(iter(self.func_weights.values())).dtype)
            out = torch.zeros(
                capture.batch_size, projector.proj_dim, dtype=dtype, device=projector.device
            )
            layout = param_layout(projector)
            for call in _drain(capture):
                self._project_call(call, projector, layout, out, capture.batch_size)
            return out
        if not getattr(projector, "streams_by_coordinates", False):
            return projector.project(self.compute_per_sample_grad(batch), model_id=model_id)
        return self._project_streamed(batch, projector, model_id)

    def _flat_offsets(self) -> dict[str, int]:
        """Each differentiated parameter's first coordinate in the flat gradient (model order)."""
        params = dict(self.model.named_parameters())
        offsets, offset = {}, 0
        for name in self._names if self.grad_wrt is None else self.grad_wrt:
            offsets[name] = offset
            offset += params[name].numel()
        offsets[""] = offset  # the total, under a name no parameter has
        return offsets

    def _project_streamed(
        self, batch: Sequence[Tensor], projector: Any, model_id: int | None
    ) -> Tensor:
        """:meth:`project` through a flat projector, one hooked call at a time."""
        offsets = self._flat_offsets()
        total = offsets.pop("")
        if total != projector.grad_dim:
            raise ValueError(
                f"the model's differentiated parameters have {total} coordinates per example but "
                f"`projector` was built with grad_dim={projector.grad_dim}; build it with "
                f"grad_dim={total} (the same `grad_wrt` as the gradient computer)."
            )
        projector.set_model_id(model_id)
        capture = self._run(batch)
        batch_size = capture.batch_size
        out: Tensor = projector.new_output(batch_size, next(iter(self.func_weights.values())).dtype)

        def dense(block: Tensor, offset: int) -> None:
            projector.project_into_(out, block, offset)

        sparse = projector.project_sparse_into_
        for call in _drain(capture):
            if self._stream_flat(call, batch_size, out, offsets.__getitem__, sparse, dense):
                continue
            for name, grad in self._call_grads(call, batch_size).items():
                dense(grad.reshape(batch_size, -1), offsets[name])
        return out

    def _project_call(
        self,
        call: _Call,
        projector: FactorizedProjector,
        layout: Mapping[str, Any],
        out: Tensor,
        batch_size: int,
    ) -> None:
        unit = call.unit
        module_type = type(unit.module)
        first = layout[next(iter(unit.params.values()))]
        if not unit.fallback and isinstance(first, FactorizedLayer) and first.name == unit.name:
            g = _single_grad(call)
            if g is not None:
                a, g3 = LAYER_FACTORS[module_type](
                    unit.module, call.rule_inputs(batch_size), call.rule_grad(g, batch_size)
                )
                projector.project_layer_into_(out, unit.name, a, g3)
            return

        def rest(block: Tensor, offset: int) -> None:
            projector.project_rest_into_(out, block, offset)

        sparse = projector.project_rest_sparse_into_
        if self._stream_flat(call, batch_size, out, projector.rest_offset_of, sparse, rest):
            return
        _project_dense(self._call_grads(call, batch_size), projector, layout, out, batch_size)

    def _stream_flat(
        self,
        call: _Call,
        batch_size: int,
        out: Tensor,
        offset_of: Callable[[str], int],
        sparse_into: Callable[..., object],
        dense: Callable[[Tensor, int], None],
    ) -> bool:
        """A call's gradient streamed into a flat projection, if its layer allows.

        An embedding's rows go to ``sparse_into``; a layer with Kronecker
        factors hands its weight gradient to ``dense`` in row chunks
        (:meth:`_stream_weight`), each at ``offset_of(parameter name)``.
        Returns False where neither applies (the caller forms the gradients).
        """
        unit = call.unit
        if not unit.fallback and type(unit.module) in ROW_SPARSE_SAMPLERS:
            _project_row_sparse(call, batch_size, offset_of, sparse_into, out)
            return True
        if not _weight_layer(unit):
            return False
        g = _single_grad(call)
        if g is None:
            return True
        params = unit.params
        weight = offset_of(params["weight"])
        bias = offset_of(params["bias"]) if "bias" in params else None
        return self._stream_weight(call, g, dense, weight, bias, batch_size)

    def _stream_weight(
        self,
        call: _Call,
        g: Tensor,
        sink: Callable[[Tensor, int], None],
        weight_offset: int,
        bias_offset: int | None,
        batch_size: int,
    ) -> bool:
        """A layer with Kronecker factors: its weight gradient handed on in row chunks.

        Its per-example gradient ``sum_t g_t a_t^T`` (``[B, vocab, width]`` for
        an LM head) is formed :data:`REST_CHUNK_BYTES` at a time, rows of the
        stored weight in order, and each ``[B, rows * width]`` chunk goes to
        ``sink(chunk, offset)`` at its coordinates; the bias gradient
        ``sum_t g_t`` goes at ``bias_offset``. Returns False, handing on
        nothing, for an instance without factors (a grouped Conv2d).
        """
        unit = call.unit
        try:
            a, g3 = LAYER_FACTORS[type(unit.module)](
                unit.module, call.rule_inputs(batch_size), call.rule_grad(g, batch_size)
            )
        except HookComputationError:
            return False
        a = a.to(g3.dtype)
        # Rows of the stored weight: d_out rows of d_in, or d_in rows of d_out when transposed.
        rows_f, cols_f = (a, g3) if type(unit.module) in TRANSPOSED_WEIGHT else (g3, a)
        n_rows, width = rows_f.shape[-1], cols_f.shape[-1]
        step = max(1, REST_CHUNK_BYTES // max(1, batch_size * width * g3.element_size()))
        rows_t = rows_f.transpose(1, 2)  # [B, rows, T]
        for r0 in range(0, n_rows, step):
            r1 = min(n_rows, r0 + step)
            chunk = torch.bmm(rows_t[:, r0:r1], cols_f)
            sink(chunk.reshape(batch_size, -1), weight_offset + r0 * width)
        if bias_offset is not None:
            sink(g3.sum(1), bias_offset)
        return True

    def _check_layout(self, projector: FactorizedProjector) -> None:
        """The projector must cover exactly this computer's parameters, layer by layer.

        A factorized layer must be a module of a type with Kronecker factors
        owning exactly the layer's parameters; the hooks project it through
        its factors, or, where the module is hooked as part of an enclosing
        one (a mixture-of-experts container), through its per-example gradient.
        """
        key = projector.fingerprint.to_json()
        if key in self._checked_layouts:
            return
        layout = param_layout(projector)
        wanted = self._names if self.grad_wrt is None else self.grad_wrt
        missing = [n for n in wanted if n not in layout]
        extra = [n for n in layout if n not in set(wanted)]
        if missing or extra:
            raise ValueError(
                f"`projector` does not match the model's differentiated parameters: missing "
                f"{missing[:10]}, unexpected {extra[:10]}. Build it with "
                "FactorizedProjector.from_model(model, grad_wrt=<the same grad_wrt>, ...)."
            )
        modules = dict(self.model.named_modules())
        shapes = {n: p.numel() for n, p in self.model.named_parameters()}
        canonical = {id(p): n for n, p in self.model.named_parameters()}
        for seg in projector.segments:
            if isinstance(seg, PlainParam):
                if shapes[seg.name] != seg.numel:
                    raise ValueError(
                        f"`projector` expects {seg.numel} coordinates for {seg.name!r}, the model "
                        f"has {shapes[seg.name]}; rebuild it with FactorizedProjector.from_model."
                    )
                continue
            module = modules.get(seg.name)
            if module is None or type(module) not in LAYER_FACTORS:
                allowed = ", ".join(sorted(t.__name__ for t in LAYER_FACTORS))
                found = "no module" if module is None else f"a {type(module).__name__}"
                raise ValueError(
                    f"`projector` factorizes layer {seg.name!r}, but the model has {found} there "
                    f"(types with Kronecker factors: {allowed}). Build it with "
                    "FactorizedProjector.from_model(model, ...)."
                )
            own = tuple(
                canonical[id(p)]
                for p in module.parameters(recurse=False)
                if canonical[id(p)] in set(wanted)
            )
            if own != seg.param_names:
                raise ValueError(
                    f"layer {seg.name!r}: `projector` expects parameters {seg.param_names}, the "
                    f"model gives {own} (a tied or excluded weight?); factorized layers need "
                    "their own weight."
                )
            actual = sum(shapes[n] for n in seg.param_names)
            if seg.numel != actual:
                raise ValueError(
                    f"layer {seg.name!r}: `projector` expects {seg.numel} coordinates, the model "
                    f"has {actual}; rebuild it with FactorizedProjector.from_model(model, ...)."
                )
        tied = self._tied_factorized(projector)
        if tied:
            raise ValueError(
                f"factorized layers {tied} share their weight with another module; their "
                "gradient is not a single Kronecker product. Untie the weights or use a "
                "CountSketchProjector."
            )
        self._checked_layouts.add(key)

    def _tied_factorized(self, projector: FactorizedProjector) -> list[str]:
        owners: dict[int, int] = {}
        for _, module in self.model.named_modules(remove_duplicate=False):
            for p in module.parameters(recurse=False):
                owners[id(p)] = owners.get(id(p), 0) + 1
        params = dict(self.model.named_parameters())
        return [
            layer.name
            for layer in projector.layers
            if owners.get(id(params[layer.param_names[0]]), 0) > 1
        ]

    def __repr__(self) -> str:
        rules = sum(not u.fallback for u in self._units)
        return (
            f"HookGradientComputer(units={len(self._units)}, rules={rules}, "
            f"fallback={len(self._units) - rules}, hooks_installed={self.hooks_installed})"
        )


def _project_dense(
    grads: Mapping[str, Tensor],
    projector: FactorizedProjector,
    layout: Mapping[str, Any],
    out: Tensor,
    batch_size: int,
) -> None:
    """Project per-example gradients: rest parameters by count sketch, layers densely.

    A factorized layer's parameters come together (one unit's call gives
    them all) and are projected as ``s_l vec(P_out [W | b] P_in^T)``.
    """
    pending: dict[str, dict[str, Tensor]] = {}
    for name, grad in grads.items():
        seg = layout[name]
        if isinstance(seg, PlainParam):
            projector.project_rest_into_(
                out, grad.reshape(batch_size, -1), projector.rest_offset_of(name)
            )
            continue
        parts = pending.setdefault(seg.name, {})
        parts[name] = grad
        if set(parts) == set(seg.param_names):
            flat = torch.cat([parts[n].reshape(batch_size, -1) for n in seg.param_names], 1)
            projector._project_dense_layer(out, seg, flat)
            del pending[seg.name]
    if pending:  # pragma: no cover - a module's weight and bias always share a unit
        raise HookComputationError(f"layers {sorted(pending)} got part of their parameters.")


def _weight_layer(unit: _Unit) -> bool:
    """Whether a unit is a rule's layer with Kronecker factors owning its weight (and bias)."""
    return (
        not unit.fallback
        and type(unit.module) in LAYER_FACTORS
        and set(unit.params) <= {"weight", "bias"}
        and "weight" in unit.params
    )


def _drain(capture: _Capture) -> Iterator[_Call]:
    """The capture's calls in order, each dropped from it once handled (its tensors freed)."""
    calls = capture.calls
    calls.reverse()
    while calls:
        yield calls.pop()


def _project_row_sparse(
    call: _Call,
    batch_size: int,
    offset_of: Callable[[str], int],
    project: Callable[[Tensor, Tensor, Tensor], Any],
    out: Tensor,
) -> None:
    """A row-sparse layer's (an embedding's) per-example gradient, projected as coordinates.

    ``offset_of(name)`` is the flat offset of the parameter ``name``;
    ``project(out, coords, values)`` adds the sparse rows into ``out``.
    """
    g = _single_grad(call)
    if g is None:
        return
    unit = call.unit
    for local, (rows, values) in ROW_SPARSE_SAMPLERS[type(unit.module)](
        unit.module, call.rule_inputs(batch_size), call.rule_grad(g, batch_size)
    ).items():
        if local in unit.params:
            coords = _row_coordinates(rows, values, offset_of(unit.params[local]))
            project(out, coords, values.reshape(batch_size, -1))


def _row_coordinates(rows: Tensor, values: Tensor, base: int) -> Tensor:
    """``[B, n * width]`` flat coordinates of values ``[B, n, width]`` at rows ``[B, n]``."""
    width = values.shape[-1]
    cols = torch.arange(width, device=rows.device)
    return (base + rows.unsqueeze(-1) * width + cols).reshape(rows.shape[0], -1)


def _single_grad(call: _Call) -> Tensor | None:
    """The output gradient of a one-output module (``None``: output unused)."""
    if len(call.grads) != 1:
        raise HookComputationError(
            f"module {call.unit.name!r} ({type(call.unit.module).__name__}) returned "
            f"{len(call.grads)} floating tensors; its rule expects exactly one."
        )
    return call.grads[0]
