"""Weight restrictions: which weights of a transformer a sampler may move.

A restriction string names a part of a Hugging Face language model the way
devinterp 2.0 does: ``"full"``, ``"l0"`` (layer 0), ``"l0 attn"``,
``"l0 mlp"``, ``"l0h1"`` (head 1 of layer 0, entry by entry), ``"l0g0"``
(grouped-query group 0: the query heads sharing key/value head 0),
``"embed"``, ``"unembed"``, a parameter name, or a list of these (their
union); and, for mixture-of-experts models, ``"l0 expert3"`` (expert 3 of
layer 0's MLP). :func:`create_param_masks` turns it into a
:class:`~gradsketch.masked.ParamMask`, so the same restriction restricts
samplers, sketches and attribution alike; :func:`param_masks_dict` gives
devinterp's ``{name: mask or None}`` form.

Where each part lives is read from the model itself, for every decoder family
transformers builds, and through peft wrappers:

- the blocks are the ``nn.ModuleList`` whose every item holds an attention
  module (a module whose class name contains ``Attention``);
- ``attn`` is the attention module's parameters, ``mlp`` the rest of the
  block's; normalisation layers (class name containing ``Norm``) belong to
  neither, only to ``"l<i>"``;
- heads are read from the attention's projections, recognised by name
  (:data:`PROJECTIONS`: ``q_proj``, ``c_attn``, ``query_key_value``, ...), and
  the head counts from the attention module (``num_heads``, ``head_dim``,
  ``num_key_value_heads``, ...) or else the config; the output side of a
  query/key/value projection (rows of a ``Linear``, columns of GPT-2's
  ``Conv1D``, rows of a LoRA ``B``) and the input side of the output
  projection (columns, LoRA ``A``'s columns) are split by head, never their
  biases' shared parts;
- experts are the items of a module named ``experts`` (a ``ModuleList``, or
  stacked parameters whose first axis runs over experts);
- ``embed`` / ``unembed`` are the model's ``get_input_embeddings()`` /
  ``get_output_embeddings()`` (an output head tied to the input embedding is
  one parameter, listed under ``embed``).

A projection named otherwise is added with :func:`register_projection`; a
family laid out some other way entirely is described by a :class:`Structure`
registered under its ``config.model_type`` with :func:`register_structure`
(a registered structure takes precedence over what is read from the model).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gradsketch.masked import ParamMask

__all__ = [
    "PROJECTIONS",
    "STRUCTURES",
    "HeadParam",
    "Structure",
    "create_param_masks",
    "param_masks_dict",
    "preview_weight_restriction",
    "register_projection",
    "register_structure",
    "to_param_mask",
]

_ROLES = ("q", "k", "v", "o")
_LAYOUTS = ("concat", "interleaved", "grouped")


@dataclass(frozen=True)
class HeadParam:
    """How one attention parameter splits into heads.

    Attributes:
        slice_dim: The axis that runs over heads (for a 1-D bias, axis 0).
        fused: ``None`` for a separate projection; for a fused query/key/value
            projection its layout along ``slice_dim``: ``"concat"`` for
            ``[Q; K; V]`` stacked (GPT-2's ``c_attn``, Phi-3's ``qkv_proj``),
            ``"interleaved"`` for ``[head][q, k, v][head_dim]`` (GPT-NeoX's and
            BLOOM's ``query_key_value``), ``"grouped"`` for
            ``[kv_head][its query heads, k, v][head_dim]`` (Falcon's new
            decoder architecture).
        role: For a separate projection, ``"q"``, ``"k"``, ``"v"`` or ``"o"``
            (key/value projections run over key/value heads); ``None`` tells
            them apart by size, as devinterp does.
    """

    slice_dim: int
    fused: str | None = None
    role: str | None = None

    def __post_init__(self) -> None:
        if self.fused is not None and self.fused not in _LAYOUTS:
            raise ValueError(
                f"`fused`={self.fused!r} is not a layout; use None or one of {list(_LAYOUTS)}."
            )
        if self.role is not None and self.role not in _ROLES:
            raise ValueError(f"`role`={self.role!r} is not a role; use None or one of {_ROLES}.")


@dataclass(frozen=True)
class Structure:
    """Where the parts of one model family live, as parameter-name suffixes.

    Only needed for a family whose layout cannot be read from the model (see
    the module docstring); register it with :func:`register_structure`.

    Attributes:
        layers: Prefix of the transformer blocks (``"transformer.h"``: block
            ``i`` is ``transformer.h.{i}.``).
        embed: Names (suffixes) of the input embedding.
        unembed: Names (suffixes) of the output head.
        attn: Suffixes, inside a block, of the attention parameters.
        mlp: Suffixes, inside a block, of the MLP parameters.
        heads: Block-relative names of the parameters split by head.
        experts: Block-relative prefixes of the experts' container
            (``"mlp.experts"``: expert ``e`` is ``mlp.experts.{e}.``, or, for
            stacked parameters, entry ``e`` of their first axis).
    """

    layers: str
    embed: tuple[str, ...]
    unembed: tuple[str, ...]
    attn: tuple[str, ...]
    mlp: tuple[str, ...]
    heads: Mapping[str, HeadParam] = field(default_factory=dict)
    experts: tuple[str, ...] = ()


#: Families registered by ``config.model_type`` (:func:`register_structure`); every
#: other family is read from the model.
STRUCTURES: dict[str, Structure] = {}

#: Attention projections by the name of their module: a role (``"q"``, ``"k"``,
#: ``"v"``, ``"o"``) or a fused query/key/value layout (``"concat"``,
#: ``"interleaved"``); :func:`register_projection` adds one.
PROJECTIONS: dict[str, str] = {
    **dict.fromkeys(("q_proj", "query", "q", "wq", "q_lin", "query_proj"), "q"),
    **dict.fromkeys(("k_proj", "key", "k", "wk", "k_lin", "key_proj"), "k"),
    **dict.fromkeys(("v_proj", "value", "v", "wv", "v_lin", "value_proj"), "v"),
    **dict.fromkeys(("o_proj", "out_proj", "dense", "c_proj", "wo", "out_lin"), "o"),
    **dict.fromkeys(("c_attn", "qkv_proj", "Wqkv", "qkv"), "concat"),
    "query_key_value": "interleaved",
}


def register_structure(model_type: str, structure: Structure) -> None:
    """Describe (or replace) the layout of a model family by hand.

    A registered structure is used for every model of that ``model_type``
    instead of the layout read from the model.

    Example:
        >>> s = Structure("transformer.h", ("wte.weight",), (), ("attn.",), ("mlp.",))
        >>> register_structure("my_gpt", s)
        >>> STRUCTURES.pop("my_gpt") is s
        True
    """
    if not isinstance(structure, Structure):
        raise TypeError(
            f"`structure` must be a gradsketch.slt.Structure, got {type(structure).__name__}."
        )
    STRUCTURES[model_type] = structure


def register_projection(name: str, kind: str) -> None:
    """Recognise attention projection modules named ``name`` as ``kind``.

    ``kind``: ``"q"``, ``"k"``, ``"v"`` (separate query, key, value
    projections), ``"o"`` (the output projection), or the layout of a fused
    query/key/value projection, ``"concat"`` or ``"interleaved"`` (see
    :class:`HeadParam`).

    Example:
        >>> register_projection("my_q", "q")
        >>> PROJECTIONS.pop("my_q")
        'q'
    """
    allowed = (*_ROLES, "concat", "interleaved")
    if kind not in allowed:
        raise ValueError(f"`kind`={kind!r} is not a projection kind; use one of {list(allowed)}.")
    PROJECTIONS[name] = kind


_HEAD = re.compile(r"l(\d+)\s*h(\d+)$")
_GROUP = re.compile(r"l(\d+)\s*g(\d+)$")
_EXPERT = re.compile(r"l(\d+)\s+expert\s*(\d+)$")
_LAYER = re.compile(r"l(\d+)(?:\s+(attn|mlp))?$")
_FORMS = (
    "'full', 'l0', 'l0h1', 'l0g0', 'l0 attn', 'l0 mlp', 'l0 expert1', 'embed', 'unembed', "
    "a parameter name"
)
_FIX = (
    "name its projections with gradsketch.slt.register_projection(name, kind), or describe "
    "the family with gradsketch.slt.register_structure(model_type, Structure(...)); or build "
    "the masks with gradsketch.masked.ParamMask.from_patterns(model, include=[...])"
)


# ------------------------------------------------------------------ the layout of a model
@dataclass(frozen=True)
class _Shape:
    """``(n_heads, n_kv, head_dim)`` of one attention module."""

    n_heads: int
    n_kv: int
    head_dim: int


@dataclass
class _Block:
    """One transformer block, by full parameter names."""

    params: list[str]
    attn: list[str]
    mlp: list[str]
    heads: dict[str, HeadParam] | None  # None: projections not recognised
    why_no_heads: str
    shape: _Shape | None
    experts: list[list[tuple[str, int | None]]]  # [expert] -> (name, index on axis 0 or None)
    why_no_experts: str


@dataclass
class _Layout:
    """What :func:`_layout` found: the blocks, the embeddings, and where from."""

    blocks: list[_Block]
    embed: list[str]
    unembed: list[str]
    unembed_tied: bool
    source: str


def _first(obj: Any, names: Sequence[str]) -> int | None:
    for name in names:
        value = getattr(obj, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _core(model: nn.Module) -> tuple[str, nn.Module]:
    """The Hugging Face model inside ``model`` (itself, or under a peft wrapper): path, module."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # only registered structures then
        return "", model
    for path, module in model.named_modules():
        if isinstance(module, PreTrainedModel):
            return path, module
    return "", model


def _config(model: nn.Module) -> Any:
    config = getattr(_core(model)[1], "config", None)
    if getattr(config, "model_type", None) is None:
        raise ValueError(
            f"`model` ({type(model).__name__}) has no `config.model_type`, so its layers and "
            "heads cannot be located; pass a Hugging Face model, or build the masks with "
            "gradsketch.masked.ParamMask.from_patterns(model, include=[...])."
        )
    return config


def _names_by_id(model: nn.Module) -> dict[int, str]:
    """Each parameter's name in ``model`` (the first, for one shared by several modules)."""
    return {id(p): n for n, p in reversed(list(model.named_parameters()))}


def _module_params(module: nn.Module, names: Mapping[int, str]) -> list[str]:
    return [names[id(p)] for p in module.parameters() if id(p) in names]


def _is_attention(module: nn.Module) -> bool:
    return "attention" in type(module).__name__.lower()


def _is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower()


def _stacks(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """Every ``ModuleList`` whose items each hold an attention module."""
    found = []
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            if all(
                any(_is_attention(m) for m in item.modules() if m is not item) for item in module
            ):
                found.append((path, module))
    return found


def _shallowest_attention(block: nn.Module) -> list[nn.Module]:
    """The block's attention modules not inside another one (self-attention first)."""
    out: list[nn.Module] = []
    inside: set[int] = set()
    for _, module in block.named_modules():
        if id(module) in inside or module is block:
            continue
        if _is_attention(module):
            out.append(module)
            inside.update(id(m) for m in module.modules())
    return out


def _sides(module: nn.Module, names: Mapping[int, str]) -> tuple[list[tuple[str, int]], ...]:
    """A projection's ``(name, axis)`` on its output side and on its input side.

    ``nn.Linear`` (``[out, in]``), transformers' ``Conv1D`` (``[in, out]``), and
    a peft LoRA layer: its base layer, ``B`` (``[out, r]``) on the output side
    and ``A`` (``[r, in]``) on the input side.
    """
    out: list[tuple[str, int]] = []
    inp: list[tuple[str, int]] = []
    base = getattr(module, "base_layer", None)
    if isinstance(base, nn.Module):
        b_out, b_in = _sides(base, names)
        out += b_out
        inp += b_in
        for side, key in ((out, "lora_B"), (inp, "lora_A")):
            adapters = getattr(module, key, None)
            if isinstance(adapters, nn.ModuleDict):
                for adapter in adapters.values():
                    w = getattr(adapter, "weight", None)
                    if isinstance(w, nn.Parameter) and id(w) in names:
                        side.append((names[id(w)], 0 if key == "lora_B" else 1))
                    b = getattr(adapter, "bias", None)
                    if key == "lora_B" and isinstance(b, nn.Parameter) and id(b) in names:
                        out.append((names[id(b)], 0))
        return out, inp
    weight = getattr(module, "weight", None)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 2 or id(weight) not in names:
        return out, inp
    conv1d = not hasattr(module, "out_features") and hasattr(module, "nf")
    out.append((names[id(weight)], 1 if conv1d else 0))
    inp.append((names[id(weight)], 0 if conv1d else 1))
    bias = getattr(module, "bias", None)
    if isinstance(bias, nn.Parameter) and id(bias) in names:
        out.append((names[id(bias)], 0))
    return out, inp


def _attention_shape(attention: nn.Module, config: Any) -> _Shape:
    """Head counts from the attention module's attributes, else from the config."""
    text = getattr(config, "get_text_config", lambda: config)()
    n_heads = _first(attention, ("num_heads", "num_attention_heads", "n_head", "n_heads"))
    n_heads = n_heads or _first(text, ("num_attention_heads", "n_head", "num_heads"))
    if n_heads is None:
        raise ValueError(
            f"the attention module {type(attention).__name__} and the config give no number "
            "of heads (num_heads / num_attention_heads)"
        )
    head_dim = _first(attention, ("head_dim", "head_size")) or _first(text, ("head_dim",))
    if head_dim is None:
        hidden = _first(text, ("hidden_size", "n_embd", "d_model"))
        if hidden is None:
            raise ValueError(
                "neither the attention module nor the config gives head_dim or hidden_size"
            )
        head_dim = hidden // n_heads
    n_kv = _first(attention, ("num_key_value_heads", "num_kv_heads", "kv_heads"))
    groups = _first(attention, ("num_key_value_groups",))
    if n_kv is None and groups is not None:
        n_kv = n_heads // groups
    n_kv = n_kv or _first(text, ("num_key_value_heads",)) or n_heads
    return _Shape(n_heads, n_kv, head_dim)


def _fused_layout(attention: nn.Module, kind: str) -> str:
    """A fused projection's layout: the attention module's flags, else its name's.

    Falcon and GPTBigCode say how they split theirs: multi-query attention
    stacks ``[q heads; k; v]``, multi-head ``[head][q, k, v]``, and Falcon's
    new architecture groups query heads with their key/value head.
    """
    if getattr(attention, "new_decoder_architecture", False):
        return "grouped"
    multi_query = getattr(attention, "multi_query", None)
    if isinstance(multi_query, bool):
        return "concat" if multi_query else "interleaved"
    return kind


def _heads(
    attention: nn.Module, shape: _Shape, names: Mapping[int, str]
) -> tuple[dict[str, HeadParam] | None, str]:
    """The head-split parameters of one attention module, or None and why not."""
    heads: dict[str, HeadParam] = {}
    roles: dict[str, str] = {}
    shapes = {names[id(p)]: tuple(p.shape) for p in attention.parameters() if id(p) in names}
    for path, module in attention.named_modules():
        kind = PROJECTIONS.get(path.rpartition(".")[2])
        if kind is None or not path or ".base_layer" in path or ".lora_" in path:
            continue
        out, inp = _sides(module, names)
        if not out:
            continue
        if kind == "o":
            roles[path] = kind
            heads.update({n: HeadParam(axis, role="o") for n, axis in inp})
            continue
        fused = _fused_layout(attention, kind) if kind in _LAYOUTS else None
        roles[path] = fused or kind
        n_heads, n_kv, hd = shape.n_heads, shape.n_kv, shape.head_dim
        want = {"q": n_heads * hd, "k": n_kv * hd, "v": n_kv * hd}.get(
            kind, (n_heads + 2 * n_kv) * hd
        )
        for name, axis in out:
            param = shapes[name]
            size = param[0] if len(param) == 1 else param[axis]
            if size != want:
                return None, (
                    f"{path} ({kind}) has {size} outputs where {n_heads} heads, {n_kv} key/value "
                    f"heads of width {hd} give {want}"
                )
            heads[name] = HeadParam(axis, fused=fused, role=None if fused else kind)
    found = set(roles.values())
    complete = "o" in found and ({"q", "k", "v"} <= found or found & set(_LAYOUTS))
    if not complete:
        return None, (
            f"the attention module {type(attention).__name__} has projections "
            f"{ {p: r for p, r in roles.items()} or 'none' } recognised by name "
            f"(known: {sorted(PROJECTIONS)}); a query, key, value (or fused) and an output "
            "projection are needed"
        )
    return heads, ""


def _experts(
    block_mlp: Sequence[tuple[str, nn.Module]], names: Mapping[int, str], config: Any
) -> tuple[list[list[tuple[str, int | None]]], str]:
    """Each expert's parameters (``(name, None)``) or entries (``(name, e)`` on axis 0)."""
    for path, module in block_mlp:
        if path.rpartition(".")[2] != "experts":
            continue
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            items = list(module.values() if isinstance(module, nn.ModuleDict) else module)
            return [[(n, None) for n in _module_params(m, names)] for m in items], ""
        text = getattr(config, "get_text_config", lambda: config)()
        count = _first(module, ("num_experts",)) or _first(
            text, ("num_local_experts", "num_experts", "n_routed_experts")
        )
        stacked = [
            (names[id(p)], p.shape[0])
            for p in module.parameters()
            if id(p) in names and p.dim() >= 2
        ]
        if count is None or not stacked or any(rows != count for _, rows in stacked):
            return [], (
                f"its `experts` module {type(module).__name__} holds parameters "
                f"{[(n, rows) for n, rows in stacked]} whose first axis is not the number of "
                f"experts ({count})"
            )
        return [[(n, e) for n, _ in stacked] for e in range(count)], ""
    return [], "its MLP has no module named `experts` (not a mixture of experts)"


def _derive(model: nn.Module, config: Any) -> _Layout:
    """The layout read from the model's module tree and config (see the module docstring)."""
    names = _names_by_id(model)
    stacks = _stacks(model)
    if not stacks:
        raise ValueError(
            f"`model` (model_type {config.model_type!r}) cannot be restricted by layer: no "
            f"stack of transformer blocks was found in {type(model).__name__} (an "
            "nn.ModuleList whose every item holds a module with 'Attention' in its class "
            f"name). To fix it, {_FIX}."
        )
    # Encoder-decoder models: the decoder's blocks, as devinterp.
    path, stack = next(((p, s) for p, s in stacks if "decoder" in p), stacks[0])
    blocks = [_block(item, names, config) for item in stack]
    core = _core(model)[1]
    embed_module = getattr(core, "get_input_embeddings", lambda: None)()
    head_module = getattr(core, "get_output_embeddings", lambda: None)()
    embed = _module_params(embed_module, names) if isinstance(embed_module, nn.Module) else []
    unembed: list[str] = []
    tied = False
    if isinstance(head_module, nn.Module):
        for p in head_module.parameters():
            if id(p) in names and names[id(p)] not in embed:
                unembed.append(names[id(p)])
            elif id(p) in names:
                tied = True
    return _Layout(blocks, embed, unembed, tied, f"read from the model ({path})")


def _block(item: nn.Module, names: Mapping[int, str], config: Any) -> _Block:
    params = _module_params(item, names)
    attentions = _shallowest_attention(item)
    norms = {n for m in item.modules() if _is_norm(m) for n in _module_params(m, names)}
    attention = attentions[0]
    attn_names = [n for n in _module_params(attention, names) if n not in norms]
    others = {n for a in attentions for n in _module_params(a, names)}
    mlp = [n for n in params if n not in others and n not in norms]
    heads: dict[str, HeadParam] | None = None
    shape: _Shape | None = None
    try:
        shape = _attention_shape(attention, config)
        heads, why = _heads(attention, shape, names)
    except ValueError as exc:  # heads unknown: only head restrictions are refused
        why = str(exc)
    inside = {id(m) for a in attentions for m in a.modules()}
    mlp_modules = [(p, m) for p, m in item.named_modules() if id(m) not in inside and p]
    experts, why_experts = _experts(mlp_modules, names, config)
    return _Block(params, attn_names, mlp, heads, why, shape, experts, why_experts)


def _registered(model: nn.Module, structure: Structure, model_type: str) -> _Layout:
    """The layout a registered :class:`Structure` gives (names relative to the HF model)."""
    core_path, core = _core(model)
    prefix = f"{core_path}." if core_path else ""
    names = list(dict(model.named_parameters()))
    params = dict(model.named_parameters())
    blocks: list[_Block] = []
    while True:
        start = f"{prefix}{structure.layers}.{len(blocks)}."
        inside = [n for n in names if n.startswith(start)]
        if not inside:
            break
        rel = {n: n[len(start) :] for n in inside}
        heads = {n: structure.heads[r] for n, r in rel.items() if r in structure.heads}
        experts: dict[int, list[tuple[str, int | None]]] = {}
        for n, r in rel.items():
            for e_prefix in structure.experts:
                rest = r[len(e_prefix) + 1 :] if r.startswith(f"{e_prefix}.") else None
                if rest is None:
                    continue
                head, _, tail = rest.partition(".")
                if head.isdigit() and tail:
                    experts.setdefault(int(head), []).append((n, None))
                elif not tail:
                    for e in range(params[n].shape[0]):
                        experts.setdefault(e, []).append((n, e))
        blocks.append(
            _Block(
                params=inside,
                attn=[n for n, r in rel.items() if r.endswith(structure.attn)],
                mlp=[n for n, r in rel.items() if r.endswith(structure.mlp)],
                heads=heads or None,
                why_no_heads="the registered Structure lists no head parameters",
                shape=_attention_shape(core, core.config) if heads else None,
                experts=[experts[e] for e in sorted(experts)],
                why_no_experts="the registered Structure lists no experts",
            )
        )
    embed = [n for n in names if n.endswith(structure.embed)]
    unembed = [n for n in names if n.endswith(structure.unembed)]
    return _Layout(blocks, embed, unembed, False, f"registered for model_type {model_type!r}")


def _layout(model: nn.Module) -> _Layout:
    config = _config(model)
    model_type = str(config.model_type)
    if model_type in STRUCTURES:
        return _registered(model, STRUCTURES[model_type], model_type)
    return _derive(model, config)


# ------------------------------------------------------------------ masks
def _check_index(kind: str, index: int, limit: int, restriction: str, what: str) -> None:
    if index >= limit:
        raise ValueError(
            f"`restriction`={restriction!r} asks for {kind} {index}, but the model has {limit} "
            f"{what} (0 to {limit - 1}); pick an index in range."
        )


def _axis_mask(
    size: int, spec: HeadParam, index: int, *, group: bool, shape: _Shape
) -> torch.Tensor:
    """Which of the ``size`` entries along the head axis belong to head (or group) ``index``."""
    n_heads, n_kv, hd = shape.n_heads, shape.n_kv, shape.head_dim
    per_group = n_heads // n_kv
    mask = torch.zeros(size, dtype=torch.bool)
    kv_index = index if group else index // per_group
    if spec.fused == "interleaved":
        # [head][q, k, v][head_dim]: a group is a run of whole heads.
        if group:
            mask.view(n_kv, -1)[index] = True
        else:
            mask.view(n_heads, 3, hd)[index] = True
    elif spec.fused == "grouped":
        # [kv head][its query heads, k, v][head_dim].
        blocks = mask.view(n_kv, per_group + 2, hd)
        if group:
            blocks[index] = True
        else:
            blocks[kv_index, index % per_group] = True
            blocks[kv_index, per_group:] = True
    elif spec.fused == "concat":
        q_size = n_heads * hd
        q, kv = mask.split([q_size, size - q_size])
        if group:
            q.view(n_kv, per_group, hd)[index] = True
        else:
            q.view(n_heads, hd)[index] = True
        kv.view(2, n_kv, -1)[:, kv_index] = True
    elif spec.role in ("k", "v") or group or (spec.role is None and size in (n_kv * hd, n_kv)):
        # Key/value projections of grouped-query attention (and every
        # projection, for a group: its query heads are consecutive).
        mask.view(n_kv, -1)[kv_index] = True
    else:
        mask.view(n_heads, -1)[index] = True
    return mask


def _head_selection(
    block: _Block, params: Mapping[str, torch.Tensor], index: int, *, group: bool
) -> dict[str, torch.Tensor | None]:
    assert block.heads is not None and block.shape is not None
    out: dict[str, torch.Tensor | None] = {}
    for name, spec in block.heads.items():
        p = params[name]
        dim = 0 if p.dim() == 1 else spec.slice_dim
        axis = _axis_mask(p.shape[dim], spec, index, group=group, shape=block.shape)
        view = [1] * p.dim()
        view[dim] = -1
        out[name] = axis.view(view).expand(p.shape).clone()
    return out


def _expert_selection(
    block: _Block, params: Mapping[str, torch.Tensor], index: int
) -> dict[str, torch.Tensor | None]:
    out: dict[str, torch.Tensor | None] = {}
    for name, entry in block.experts[index]:
        if entry is None:
            out[name] = None
        else:
            mask = torch.zeros(params[name].shape, dtype=torch.bool)
            mask[entry] = True
            out[name] = mask
    return out


def _select(model: nn.Module, restriction: str) -> dict[str, torch.Tensor | None]:
    """One restriction string -> ``{name: entry mask or None (whole parameter)}``."""
    params = dict(model.named_parameters())
    text = restriction.strip()
    if text == "full":
        return dict.fromkeys(params)
    key = text.lower()
    forms = (_HEAD, _GROUP, _EXPERT, _LAYER)
    if key in ("embed", "unembed") or any(f.match(key) for f in forms):
        layout = _layout(model)
    elif text in params:
        return {text: None}
    else:
        raise ValueError(
            f"`restriction`={restriction!r} is not a known form; use one of {_FORMS}, or a list "
            "of them (their union)."
        )
    if key in ("embed", "unembed"):
        chosen = layout.embed if key == "embed" else layout.unembed
        if not chosen:
            why = (
                "its output head is tied to the input embedding (one parameter, listed once "
                "under 'embed'). Use 'embed' instead."
                if key == "unembed" and layout.unembed_tied
                else f"the model has no {'input' if key == 'embed' else 'output'} embedding "
                f"({layout.source}); name the parameters instead."
            )
            raise ValueError(
                f"`restriction`={restriction!r} selects no parameter of {type(model).__name__}: "
                + why
            )
        return dict.fromkeys(chosen)
    n_layers = len(layout.blocks)
    m = next(match for f in forms if (match := f.match(key)) is not None)
    layer = int(m[1])
    _check_index("layer", layer, n_layers, restriction, "layers")
    block = layout.blocks[layer]
    if m.re is _EXPERT:
        if not block.experts:
            raise ValueError(
                f"`restriction`={restriction!r} asks for an expert, but layer {layer} has none: "
                f"{block.why_no_experts}; use 'l{layer} mlp' for its whole MLP."
            )
        expert = int(m[2])
        _check_index("expert", expert, len(block.experts), restriction, f"experts in layer {layer}")
        return _expert_selection(block, params, expert)
    if m.re in (_HEAD, _GROUP):
        if block.heads is None or block.shape is None:
            config = _config(model)
            raise ValueError(
                f"`restriction`={restriction!r} needs the heads of layer {layer}, but "
                f"`model` (model_type {config.model_type!r}) does not show them: "
                f"{block.why_no_heads}. To fix it, {_FIX}."
            )
        index = int(m[2])
        if m.re is _HEAD:
            _check_index("head", index, block.shape.n_heads, restriction, "attention heads")
        else:
            _check_index("group", index, block.shape.n_kv, restriction, "key/value head groups")
        return _head_selection(block, params, index, group=m.re is _GROUP)
    if m[2] is None:
        return dict.fromkeys(block.params)
    return dict.fromkeys(block.attn if m[2] == "attn" else block.mlp)


def create_param_masks(model: nn.Module, restriction: str | list[str]) -> ParamMask:
    """The weights a restriction selects, as a :class:`~gradsketch.masked.ParamMask`.

    Call-compatible with ``devinterp.slt.weight_restrictions.create_param_masks``
    (same forms, same selected entries); the result covers every parameter of
    ``model`` (unselected ones all False). :func:`param_masks_dict` gives
    devinterp's dict form.

    Args:
        model: A Hugging Face language model (also inside a peft wrapper); its
            layout is read from its modules (see the module docstring) or from
            a :class:`Structure` registered for its ``model_type``. Only
            ``"full"`` and parameter names work on any model.
        restriction: ``"full"``, ``"l<i>"``, ``"l<i>h<j>"``, ``"l<i>g<k>"``,
            ``"l<i> attn"``, ``"l<i> mlp"``, ``"l<i> expert<e>"`` (mixtures of
            experts), ``"embed"``, ``"unembed"``, a parameter name, or a list
            of these (their union; ``"full"`` may not be combined).

    Returns:
        A ParamMask over ``model.named_parameters()``.

    Example:
        >>> from transformers import GPT2Config, GPT2LMHeadModel
        >>> model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=8, n_head=2, vocab_size=16))
        >>> mask = create_param_masks(model, "l1h0")
        >>> mask.numel  # Q, K, V columns and O rows of one 4-wide head, with its 3 bias blocks
        140
        >>> sorted(param_masks_dict(create_param_masks(model, "l0 mlp")))[:2]
        ['transformer.h.0.mlp.c_fc.bias', 'transformer.h.0.mlp.c_fc.weight']
    """
    if isinstance(restriction, str):
        parts = [restriction]
    elif (
        isinstance(restriction, list)
        and restriction
        and all(isinstance(r, str) for r in restriction)
    ):
        parts = list(restriction)
        if len(parts) > 1 and any(r.strip() == "full" for r in parts):
            raise ValueError(
                f"`restriction`={restriction!r} combines 'full' with other restrictions; "
                "'full' already selects everything, pass it alone."
            )
    else:
        raise TypeError(
            f"`restriction` must be a str or a non-empty list of str, got {restriction!r}; "
            "e.g. 'l0h1' or ['l0 attn', 'embed']."
        )
    params = dict(model.named_parameters())
    merged = {n: torch.zeros(p.shape, dtype=torch.bool) for n, p in params.items()}
    for part in parts:
        for name, mask in _select(model, part).items():
            if mask is None:
                merged[name].fill_(True)
            else:
                merged[name] |= mask
    return ParamMask({n: m.to(params[n].device) for n, m in merged.items()})


def to_param_mask(
    model: nn.Module, masks: ParamMask | Mapping[str, torch.Tensor | None] | None
) -> ParamMask:
    """Any accepted form of ``param_masks`` as a ParamMask over every parameter.

    ``None`` selects everything; devinterp's dict ``{name: mask or None}``
    selects the listed parameters (``None``: all of it) and freezes the rest.

    Example:
        >>> model = torch.nn.Linear(2, 2)
        >>> to_param_mask(model, {"bias": None}).numel
        2
    """
    params = dict(model.named_parameters())
    if masks is None:
        return ParamMask({n: torch.ones_like(p, dtype=torch.bool) for n, p in params.items()})
    if isinstance(masks, ParamMask):
        unknown = [n for n in masks.names if n not in params]
        if unknown:
            raise ValueError(
                f"`param_masks` names parameters the model does not have: {unknown[:5]}; build "
                "it from this model (create_param_masks(model, ...))."
            )
        out = {
            n: masks[n].to(p.device) if n in masks else torch.zeros_like(p, dtype=torch.bool)
            for n, p in params.items()
        }
        return ParamMask(out)
    if not isinstance(masks, Mapping):
        raise TypeError(
            "`param_masks` must be None, a gradsketch ParamMask or a dict {name: bool mask or "
            f"None}}, got {type(masks).__name__}."
        )
    unknown = [n for n in masks if n not in params]
    if unknown:
        raise ValueError(
            f"`param_masks` names parameters the model does not have: {unknown[:5]}; the model "
            f"has {list(params)[:5]}..."
        )
    full: dict[str, torch.Tensor] = {}
    for name, p in params.items():
        if name not in masks:
            full[name] = torch.zeros_like(p, dtype=torch.bool)
            continue
        m = masks[name]
        if m is None:
            full[name] = torch.ones_like(p, dtype=torch.bool)
            continue
        m = torch.as_tensor(m)
        if m.shape != p.shape:
            raise ValueError(
                f"`param_masks[{name!r}]` has shape {tuple(m.shape)}, but the parameter has "
                f"shape {tuple(p.shape)}; masks are per entry."
            )
        full[name] = (m != 0).to(p.device)
    return ParamMask(full)


def param_masks_dict(mask: ParamMask) -> dict[str, torch.Tensor | None]:
    """Devinterp's form: ``{name: bool mask, or None when all of it}`` for selected parameters.

    Parameters with no selected entry are left out (devinterp freezes them).

    Example:
        >>> model = torch.nn.Linear(2, 2)
        >>> param_masks_dict(to_param_mask(model, {"bias": None}))
        {'bias': None}
    """
    out: dict[str, torch.Tensor | None] = {}
    for name, m in mask.items():
        if bool(m.all()):
            out[name] = None
        elif bool(m.any()):
            out[name] = m
    return out


def preview_weight_restriction(
    model: nn.Module,
    masks: ParamMask | Mapping[str, torch.Tensor | None],
    *,
    plain: bool = False,
) -> None:
    """Print which parameters a restriction selects, grouped by module, with counts.

    Args:
        model: The model the masks belong to.
        masks: A ParamMask or devinterp's dict form.
        plain: Print only the selected parameter names, one a line (sorted).

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> preview_weight_restriction(model, {"0.bias": None}, plain=True)
        0.bias
        >>> preview_weight_restriction(model, {"0.bias": None})
        0
          bias    2 of 2 (100.0%)
    """
    selected = param_masks_dict(to_param_mask(model, masks))
    if plain:
        for name in sorted(selected):
            print(name)
        return
    params = dict(model.named_parameters())
    groups: dict[str, list[tuple[str, int, int]]] = {}
    for name, m in selected.items():
        total = params[name].numel()
        count = total if m is None else int(m.sum())
        prefix, _, leaf = name.rpartition(".")
        groups.setdefault(prefix, []).append((leaf, count, total))
    width = max((len(leaf) for items in groups.values() for leaf, _, _ in items), default=0)
    for prefix in sorted(groups):
        print(prefix or "(top level)")
        for leaf, count, total in groups[prefix]:
            print(f"  {leaf:<{width}}    {count:,} of {total:,} ({100.0 * count / total:.1f}%)")
