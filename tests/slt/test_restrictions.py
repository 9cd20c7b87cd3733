"""Weight restrictions against masks built entry by entry from the layouts' definitions."""

from __future__ import annotations

import pytest
import torch
from _slt_helpers import tiny_gpt2, tiny_llama, tiny_neox

from gradsketch.masked import ParamMask
from gradsketch.slt import (
    STRUCTURES,
    HeadParam,
    Structure,
    create_param_masks,
    param_masks_dict,
    preview_weight_restriction,
    register_structure,
    to_param_mask,
)


def _selected(mask: ParamMask) -> dict[str, set[tuple[int, ...]]]:
    return {n: {tuple(i) for i in m.nonzero().tolist()} for n, m in mask.items() if m.any()}


@pytest.mark.parametrize("head", [0, 3])
def test_gpt2_head_matches_the_concatenated_qkv_layout(head: int) -> None:
    model = tiny_gpt2()
    d, hd = 32, 8
    q = range(head * hd, (head + 1) * hd)
    qkv = [c + k * d for k in range(3) for c in q]
    p = "transformer.h.1.attn."
    expected = {
        p + "c_attn.weight": {(r, c) for r in range(d) for c in qkv},
        p + "c_attn.bias": {(c,) for c in qkv},
        p + "c_proj.weight": {(r, c) for r in q for c in range(d)},
    }
    assert _selected(create_param_masks(model, f"l1h{head}")) == expected


def test_llama_grouped_query_head_and_group() -> None:
    model = tiny_llama(heads=4, kv_heads=2)
    hd, d = 8, 32
    p = "model.layers.0.self_attn."
    # Head 3 uses key/value head 3 * 2 // 4 = 1.
    head = _selected(create_param_masks(model, "l0h3"))
    assert head == {
        p + "q_proj.weight": {(r, c) for r in range(24, 32) for c in range(d)},
        p + "k_proj.weight": {(r, c) for r in range(8, 16) for c in range(d)},
        p + "v_proj.weight": {(r, c) for r in range(8, 16) for c in range(d)},
        p + "o_proj.weight": {(r, c) for r in range(d) for c in range(24, 32)},
    }
    # Group 1: query heads 2 and 3, key/value head 1.
    group = _selected(create_param_masks(model, "L0 G1"))
    assert group == {
        p + "q_proj.weight": {(r, c) for r in range(2 * hd, 4 * hd) for c in range(d)},
        p + "k_proj.weight": {(r, c) for r in range(8, 16) for c in range(d)},
        p + "v_proj.weight": {(r, c) for r in range(8, 16) for c in range(d)},
        p + "o_proj.weight": {(r, c) for r in range(d) for c in range(2 * hd, 4 * hd)},
    }


def test_neox_head_is_a_block_of_the_interleaved_qkv() -> None:
    model = tiny_neox()
    p = "gpt_neox.layers.1.attention."
    rows = range(2 * 24, 3 * 24)  # head 2: [q, k, v] x head_dim 8 = 24 rows
    assert _selected(create_param_masks(model, "l1h2")) == {
        p + "query_key_value.weight": {(r, c) for r in rows for c in range(32)},
        p + "query_key_value.bias": {(r,) for r in rows},
        p + "dense.weight": {(r, c) for r in range(32) for c in range(16, 24)},
    }


def test_whole_parameter_forms_and_unions() -> None:
    model = tiny_gpt2()
    names = [n for n, _ in model.named_parameters()]
    assert param_masks_dict(create_param_masks(model, "full")) == dict.fromkeys(names)
    assert list(param_masks_dict(create_param_masks(model, "l0"))) == [
        n for n in names if n.startswith("transformer.h.0.")
    ]
    attn = param_masks_dict(create_param_masks(model, "l1 attn"))
    assert list(attn) == [n for n in names if n.startswith("transformer.h.1.attn.")]
    mlp = param_masks_dict(create_param_masks(model, "l1 mlp"))
    assert list(mlp) == [n for n in names if n.startswith("transformer.h.1.mlp.")]
    assert param_masks_dict(create_param_masks(model, "embed")) == {"transformer.wte.weight": None}
    assert param_masks_dict(create_param_masks(model, "transformer.ln_f.bias")) == {
        "transformer.ln_f.bias": None
    }
    union = create_param_masks(model, ["l1h0", "l1 mlp", "l1h1"])
    parts = [create_param_masks(model, r) for r in ("l1h0", "l1 mlp", "l1h1")]
    assert union == (parts[0] | parts[1]) | parts[2]
    assert union.numel == sum(p.numel for p in parts)  # disjoint parts


def test_devinterp_dict_form_round_trips() -> None:
    model = tiny_gpt2()
    mask = create_param_masks(model, ["l0h1", "embed"])
    as_dict = param_masks_dict(mask)
    assert as_dict["transformer.wte.weight"] is None
    assert to_param_mask(model, as_dict) == mask
    assert to_param_mask(model, None).numel == sum(p.numel() for p in model.parameters())


def test_preview_prints_counts(capsys: pytest.CaptureFixture[str]) -> None:
    model = tiny_gpt2()
    preview_weight_restriction(model, create_param_masks(model, "l1h0"))
    out = capsys.readouterr().out
    assert out == (
        "transformer.h.1.attn.c_attn\n"
        "  weight    768 of 3,072 (25.0%)\n"
        "  bias      24 of 96 (25.0%)\n"
        "transformer.h.1.attn.c_proj\n"
        "  weight    256 of 1,024 (25.0%)\n"
    )
    preview_weight_restriction(model, {"transformer.wte.weight": None}, plain=True)
    assert capsys.readouterr().out == "transformer.wte.weight\n"


@pytest.mark.parametrize(
    ("restriction", "error", "match"),
    [
        ("l9", ValueError, r"layer 9, but the model has 2 layers"),
        ("l0h4", ValueError, r"head 4, but the model has 4 attention heads"),
        ("l0g9", ValueError, r"group 9, but the model has 4 key/value head groups"),
        ("layer0", ValueError, r"not a known form; use one of 'full'"),
        (["full", "l0"], ValueError, r"combines 'full' with other"),
        (3, TypeError, r"must be a str or a non-empty list of str"),
        ([], TypeError, r"must be a str or a non-empty list of str"),
        ("unembed", ValueError, r"tied to the input embedding.*Use 'embed'"),
    ],
    ids=["layer", "head", "group", "form", "full-union", "type", "empty", "tied-unembed"],
)
def test_restriction_errors(restriction: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        create_param_masks(tiny_gpt2(), restriction)  # type: ignore[arg-type]


def test_models_without_a_config_are_refused_and_any_model_type_is_read() -> None:
    with pytest.raises(ValueError, match=r"no `config.model_type`"):
        create_param_masks(torch.nn.Linear(2, 2), "l0")
    model = tiny_gpt2()
    reference = create_param_masks(model, "l1h2")
    model.config.model_type = "mystery"  # no table: the layout is read from the modules
    assert create_param_masks(model, "l1h2") == reference


def test_a_registered_structure_takes_precedence() -> None:
    model = tiny_gpt2()
    model.config.model_type = "mystery"
    register_structure(
        "mystery",
        Structure(
            layers="transformer.h",
            embed=("transformer.wte.weight",),
            unembed=(),
            attn=("attn.c_proj.weight",),
            mlp=("mlp.c_fc.weight",),
            heads={"attn.c_proj.weight": HeadParam(0)},
        ),
    )
    try:
        assert param_masks_dict(create_param_masks(model, "l1 attn")) == {
            "transformer.h.1.attn.c_proj.weight": None
        }
        head = create_param_masks(model, "l0h1")["transformer.h.0.attn.c_proj.weight"]
        assert {r for r, _ in head.nonzero().tolist()} == set(range(8, 16))
        assert head.sum() == 8 * 32
    finally:
        STRUCTURES.pop("mystery")
    with pytest.raises(TypeError, match=r"must be a gradsketch.slt.Structure"):
        register_structure("x", {})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`fused`='zip' is not a layout"):
        HeadParam(0, fused="zip")


def test_param_mask_argument_errors() -> None:
    model = tiny_gpt2()
    with pytest.raises(ValueError, match=r"does not have: \['nope'\]"):
        to_param_mask(model, {"nope": None})
    with pytest.raises(ValueError, match=r"has shape \(2,\), but the parameter has shape"):
        to_param_mask(model, {"transformer.ln_f.bias": torch.ones(2, dtype=torch.bool)})
    with pytest.raises(TypeError, match=r"must be None, a gradsketch ParamMask or a dict"):
        to_param_mask(model, ["l0"])  # type: ignore[arg-type]
