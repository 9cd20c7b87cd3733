"""Weight restrictions: which weights of a transformer a sampler may move.

A restriction string names a part of a Hugging Face language model the way
devinterp 2.0 does: ``"full"``, ``"l0"`` (layer 0), ``"l0 attn"``,
``"l0 mlp"``, ``"l0h1"`` (head 1 of layer 0, entry by entry), ``"l0g0"``
(grouped-query group 0: the query heads sharing key/value head 0),
``"embed"``, ``"unembed"``, a parameter name, or a list of these (their
union). :func:`create_param_masks` turns it into a
:class:`~gradsketch.masked.ParamMask`, so the same restriction restricts
samplers, sketches and attribution alike; :func:`param_masks_dict` gives
devinterp's ``{name: mask or None}`` form.

Where each part lives in a model family is a :class:`Structure` in
:data:`STRUCTURES`, keyed by ``config.model_type``; add a family with
:func:`register_structure`.
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
    "STRUCTURES",
    "HeadParam",
    "Structure",
    "create_param_masks",
    "param_masks_dict",
    "preview_weight_restriction",
    "register_structure",
    "to_param_mask",
]


@dataclass(frozen=True)
class HeadParam:
    """How one attention parameter splits into heads.

    Attributes:
        slice_dim: The axis that runs over heads (for a 1-D bias, axis 0).
        fused: ``None`` for a separate projection, ``"concat"`` for
            ``[Q; K; V]`` stacked (GPT-2's ``c_attn``), ``"interleaved"`` for
            ``[head][q, k, v][head_dim]`` (GPT-NeoX's ``query_key_value``).
    """

    slice_dim: int
    fused: str | None = None


@dataclass(frozen=True)
class Structure:
    """Where the parts of one model family live, as parameter-name suffixes.

    Attributes:
        layers: Prefix of the transformer blocks (``"transformer.h"``: block
            ``i`` is ``transformer.h.{i}.``).
        embed: Names (suffixes) of the input embedding.
        unembed: Names (suffixes) of the output head.
        attn: Suffixes, inside a block, of the attention parameters.
        mlp: Suffixes, inside a block, of the MLP parameters.
        heads: Block-relative names of the parameters split by head.
    """

    layers: str
    embed: tuple[str, ...]
    unembed: tuple[str, ...]
    attn: tuple[str, ...]
    mlp: tuple[str, ...]
    heads: Mapping[str, HeadParam] = field(default_factory=dict)


#: Model families by ``config.model_type``; :func:`register_structure` adds one.
STRUCTURES: dict[str, Structure] = {}


def register_structure(model_type: str, structure: Structure) -> None:
    """Add (or replace) the :class:`Structure` of a model family.

    Example:
        >>> s = STRUCTURES["gpt2"]
        >>> register_structure("my_gpt2", s)
        >>> STRUCTURES.pop("my_gpt2") is s
        True
    """
    if not isinstance(structure, Structure):
        raise TypeError(
            f"`structure` must be a gradsketch.slt.Structure, got {type(structure).__name__}."
        )
    STRUCTURES[model_type] = structure


def _separate(
    layers: str,
    attn: dict[str, int],
    mlp: Sequence[str],
    *,
    embed: str,
    unembed: Sequence[str] = ("lm_head.weight",),
    not_heads: Sequence[str] = (),
) -> Structure:
    """A family with separate Q/K/V/O projections; ``attn`` maps suffix -> head axis."""
    return Structure(
        layers=layers,
        embed=(embed,),
        unembed=tuple(unembed),
        attn=tuple(attn),
        mlp=tuple(mlp),
        heads={name: HeadParam(dim) for name, dim in attn.items() if name not in not_heads},
    )


_LLAMA_ATTN = {f"self_attn.{p}_proj.weight": 0 for p in "qkv"} | {"self_attn.o_proj.weight": 1}
_GATED_MLP = ("mlp.down_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight")

register_structure(
    "gpt2",
    Structure(
        layers="transformer.h",
        embed=("transformer.wte.weight",),
        unembed=("lm_head.weight",),
        attn=("attn.c_attn.bias", "attn.c_attn.weight", "attn.c_proj.bias", "attn.c_proj.weight"),
        mlp=("mlp.c_fc.bias", "mlp.c_fc.weight", "mlp.c_proj.bias", "mlp.c_proj.weight"),
        heads={
            "attn.c_attn.bias": HeadParam(0, "concat"),
            "attn.c_attn.weight": HeadParam(1, "concat"),
            "attn.c_proj.weight": HeadParam(0),
        },
    ),
)
register_structure(
    "gpt_neox",
    Structure(
        layers="gpt_neox.layers",
        embed=("gpt_neox.embed_in.weight",),
        unembed=("embed_out.weight",),
        attn=(
            "attention.dense.bias",
            "attention.dense.weight",
            "attention.query_key_value.bias",
            "attention.query_key_value.weight",
        ),
        mlp=(
            "mlp.dense_4h_to_h.bias",
            "mlp.dense_4h_to_h.weight",
            "mlp.dense_h_to_4h.bias",
            "mlp.dense_h_to_4h.weight",
        ),
        heads={
            "attention.dense.weight": HeadParam(1),
            "attention.query_key_value.bias": HeadParam(0, "interleaved"),
            "attention.query_key_value.weight": HeadParam(0, "interleaved"),
        },
    ),
)
for _family in ("llama", "mistral"):
    register_structure(
        _family,
        _separate("model.layers", _LLAMA_ATTN, _GATED_MLP, embed="model.embed_tokens.weight"),
    )
register_structure(
    "qwen2",
    _separate(
        "model.layers",
        _LLAMA_ATTN | {f"self_attn.{p}_proj.bias": 0 for p in "qkv"},
        _GATED_MLP,
        embed="model.embed_tokens.weight",
    ),
)
register_structure(
    "gpt_neo",
    _separate(
        "transformer.h",
        {f"attn.attention.{p}_proj.weight": 0 for p in "qkv"}
        | {"attn.attention.out_proj.weight": 1, "attn.attention.out_proj.bias": 0},
        ("mlp.c_fc.bias", "mlp.c_fc.weight", "mlp.c_proj.bias", "mlp.c_proj.weight"),
        embed="transformer.wte.weight",
        not_heads=("attn.attention.out_proj.bias",),
    ),
)
register_structure(
    "phi",
    _separate(
        "model.layers",
        {f"self_attn.{p}_proj.{t}": 0 for p in "qkv" for t in ("weight", "bias")}
        | {"self_attn.dense.weight": 1, "self_attn.dense.bias": 0},
        ("mlp.fc1.bias", "mlp.fc1.weight", "mlp.fc2.bias", "mlp.fc2.weight"),
        embed="model.embed_tokens.weight",
        unembed=("lm_head.weight", "lm_head.bias"),
        not_heads=("self_attn.dense.bias",),
    ),
)

_HEAD = re.compile(r"l(\d+)\s*h(\d+)$")
_GROUP = re.compile(r"l(\d+)\s*g(\d+)$")
_LAYER = re.compile(r"l(\d+)(?:\s+(attn|mlp))?$")
_FORMS = "'full', 'l0', 'l0h1', 'l0g0', 'l0 attn', 'l0 mlp', 'embed', 'unembed', a parameter name"


def _structure(model: nn.Module) -> Structure:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type is None:
        raise ValueError(
            f"`model` ({type(model).__name__}) has no `config.model_type`, so its layers and "
            "heads cannot be located; pass a Hugging Face model, or build the masks with "
            "gradsketch.masked.ParamMask.from_patterns(model, include=[...])."
        )
    if model_type not in STRUCTURES:
        raise ValueError(
            f"`model` has model_type {model_type!r}, which has no registered structure; "
            f"known: {sorted(STRUCTURES)}. Register one with "
            "gradsketch.slt.register_structure(model_type, Structure(...))."
        )
    return STRUCTURES[model_type]


def _attention_shape(model: nn.Module) -> tuple[int, int, int]:
    """``(n_heads, n_kv_heads, head_dim)`` from the model's config."""
    cfg: Any = model.config
    n_heads = int(cfg.num_attention_heads)
    n_kv = int(getattr(cfg, "num_key_value_heads", None) or n_heads)
    head_dim = int(cfg.hidden_size) // n_heads
    return n_heads, n_kv, head_dim


def _num_layers(names: Sequence[str], structure: Structure) -> int:
    count = 0
    while any(n.startswith(f"{structure.layers}.{count}.") for n in names):
        count += 1
    return count


def _check_index(kind: str, index: int, limit: int, restriction: str, what: str) -> None:
    if index >= limit:
        raise ValueError(
            f"`restriction`={restriction!r} asks for {kind} {index}, but the model has {limit} "
            f"{what} (0 to {limit - 1}); pick an index in range."
        )


def _axis_mask(
    size: int, spec: HeadParam, index: int, *, group: bool, shape: tuple[int, int, int]
) -> torch.Tensor:
    """Which of the ``size`` entries along the head axis belong to head (or group) ``index``."""
    n_heads, n_kv, hd = shape
    mask = torch.zeros(size, dtype=torch.bool)
    kv_index = index if group else index * n_kv // n_heads
    if spec.fused == "interleaved":
        # [head][q, k, v][head_dim]: a group is a run of whole heads.
        if group:
            mask.view(n_kv, -1)[index] = True
        else:
            mask.view(n_heads, 3, hd)[index] = True
    elif spec.fused == "concat":
        q_size = n_heads * hd
        q, kv = mask.split([q_size, size - q_size])
        if group:
            q.view(n_kv, n_heads // n_kv, hd)[index] = True
        else:
            q.view(n_heads, hd)[index] = True
        kv.view(2, n_kv, -1)[:, kv_index] = True
    elif group or size in (n_kv * hd, n_kv):
        # Key/value projections of grouped-query attention (and every
        # projection, for a group: its query heads are consecutive).
        mask.view(n_kv, -1)[kv_index] = True
    else:
        mask.view(n_heads, -1)[index] = True
    return mask


def _head_selection(
    model: nn.Module,
    structure: Structure,
    params: Mapping[str, torch.Tensor],
    layer: int,
    index: int,
    *,
    group: bool,
) -> dict[str, torch.Tensor]:
    shape = _attention_shape(model)
    prefix = f"{structure.layers}.{layer}."
    out: dict[str, torch.Tensor] = {}
    for name, p in params.items():
        spec = structure.heads.get(name[len(prefix) :]) if name.startswith(prefix) else None
        if spec is None:
            continue
        dim = 0 if p.dim() == 1 else spec.slice_dim
        axis = _axis_mask(p.shape[dim], spec, index, group=group, shape=shape)
        view = [1] * p.dim()
        view[dim] = -1
        out[name] = axis.view(view).expand(p.shape).clone()
    return out


def _select(model: nn.Module, restriction: str) -> dict[str, torch.Tensor | None]:
    """One restriction string -> ``{name: entry mask or None (whole parameter)}``."""
    params = dict(model.named_parameters())
    text = restriction.strip()
    if text == "full":
        return dict.fromkeys(params)
    key = text.lower()
    if key in ("embed", "unembed") or _HEAD.match(key) or _GROUP.match(key) or _LAYER.match(key):
        structure = _structure(model)
    elif text in params:
        return {text: None}
    else:
        raise ValueError(
            f"`restriction`={restriction!r} is not a known form; use one of {_FORMS}, or a list "
            "of them (their union)."
        )
    if key in ("embed", "unembed"):
        suffixes = structure.embed if key == "embed" else structure.unembed
        chosen: dict[str, torch.Tensor | None] = {n: None for n in params if n.endswith(suffixes)}
        if not chosen:
            raise ValueError(
                f"`restriction`={restriction!r} selects no parameter of {type(model).__name__}: "
                f"none is named {list(suffixes)} (an output head tied to the input embedding "
                "is one parameter, listed once under 'embed'). Use 'embed' instead."
            )
        return chosen
    n_layers = _num_layers(list(params), structure)
    n_heads, n_kv, _ = _attention_shape(model)
    if m := _HEAD.match(key):
        layer, head = int(m[1]), int(m[2])
        _check_index("layer", layer, n_layers, restriction, "layers")
        _check_index("head", head, n_heads, restriction, "attention heads")
        return dict(_head_selection(model, structure, params, layer, head, group=False))
    if m := _GROUP.match(key):
        layer, grp = int(m[1]), int(m[2])
        _check_index("layer", layer, n_layers, restriction, "layers")
        _check_index("group", grp, n_kv, restriction, "key/value head groups")
        return dict(_head_selection(model, structure, params, layer, grp, group=True))
    m = _LAYER.match(key)
    assert m is not None
    layer = int(m[1])
    _check_index("layer", layer, n_layers, restriction, "layers")
    prefix = f"{structure.layers}.{layer}."
    if m[2] is None:
        return {n: None for n in params if n.startswith(prefix)}
    suffixes = structure.attn if m[2] == "attn" else structure.mlp
    return {n: None for n in params if n.startswith(prefix) and n.endswith(suffixes)}


def create_param_masks(model: nn.Module, restriction: str | list[str]) -> ParamMask:
    """The weights a restriction selects, as a :class:`~gradsketch.masked.ParamMask`.

    Call-compatible with ``devinterp.slt.weight_restrictions.create_param_masks``
    (same forms, same selected entries); the result covers every parameter of
    ``model`` (unselected ones all False). :func:`param_masks_dict` gives
    devinterp's dict form.

    Args:
        model: A Hugging Face language model of a family in :data:`STRUCTURES`
            (only ``"full"`` and parameter names work on any model).
        restriction: ``"full"``, ``"l<i>"``, ``"l<i>h<j>"``, ``"l<i>g<k>"``,
            ``"l<i> attn"``, ``"l<i> mlp"``, ``"embed"``, ``"unembed"``, a
            parameter name, or a list of these (their union; ``"full"`` may
            not be combined).

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
