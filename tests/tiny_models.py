"""Tiny variants of every family, registered with timm on import, for tests that run the commands end to
end in milliseconds; the ``tiny_variants`` fixture (conftest.py) adds their rows to the variant table."""

from __future__ import annotations

from functools import partial
from typing import Any

from timm.models import generate_default_cfgs, register_model
from timm.models.beit import _create_beit
from timm.models.cait import _create_cait
from timm.models.convnext import _create_convnext
from timm.models.deit import _create_deit
from timm.models.eva import _create_eva
from timm.models.mlp_mixer import Affine, ResBlock, _create_mixer
from timm.models.vision_transformer import _create_vision_transformer
from timm.models.xcit import _create_xcit

from timm_layerscale.families import FAMILIES, Variant
from timm_layerscale.models import beit_ls, cait_ls, convnext_ls, dinov3_ls, pe_ls, resmlp_ls, vit5, xcit_ls
from timm_layerscale.models._helpers import build_variant, pretrained_cfg

CAIT = Variant("tinytest_cait_layerscale", FAMILIES["cait"], "tinytest_cait", 32, 32, 3, 4, 1e-5, patch_size=8)
DEIT3 = Variant("tinytest_deit3", FAMILIES["deit3"], "tinytest_deit3", 32, 32, 3, 4, None, patch_size=8)
VIT5 = Variant("tinytest_vit5", FAMILIES["vit5"], None, 32, 64, 3, 2, 1e-4, patch_size=8)
_SWIGLU_QKVB = (("qkv_bias", True), ("swiglu_mlp", True), ("swiglu_align_to", 8))
DINOV3 = Variant(
    "tinytest_dinov3_ls", FAMILIES["dinov3"], "tinytest_dinov3", 32, 32, 3, 2, 1e-5, patch_size=8, args=_SWIGLU_QKVB
)
DINOV2 = Variant("tinytest_dinov2", FAMILIES["dinov2"], "tinytest_dinov2", 32, 32, 3, 2, 1e-5, patch_size=8)
_CONVNEXT = (("depths", (1, 1, 2, 1)), ("dims", (8, 16, 24, 32)))
CONVNEXT = Variant(
    "tinytest_convnext_ls", FAMILIES["convnext"], "tinytest_convnext", 32, 8, 5, 0, 1e-6, 4, args=_CONVNEXT
)
_BEIT = (("use_abs_pos_emb", False), ("use_rel_pos_bias", True))
BEIT = Variant("tinytest_beit_ls", FAMILIES["beit"], "tinytest_beit", 32, 32, 3, 2, 0.1, patch_size=8, args=_BEIT)
RESMLP = Variant(
    "tinytest_resmlp_ls", FAMILIES["resmlp"], "tinytest_resmlp", 32, 32, 3, 0, 1e-4, 8, args=(("mlp_ratio", 4),)
)
XCIT = Variant(
    "tinytest_xcit_ls", FAMILIES["xcit"], "tinytest_xcit", 32, 32, 2, 4, 1.0, 8, args=(("tokens_norm", True),)
)
INTERNVIT = Variant("tinytest_internvit", FAMILIES["internvit"], "tinytest_internvit", 32, 32, 3, 2, 0.1, patch_size=8)
PE = Variant("tinytest_pe_ls", FAMILIES["pe"], "tinytest_pe", 32, 32, 3, 2, 0.1, 8, args=(("class_token", True),))
#: The rows the ``tiny_variants`` fixture adds to the variant table.
TINY = (CAIT, DEIT3, VIT5, DINOV3, DINOV2, CONVNEXT, BEIT, RESMLP, XCIT, INTERNVIT, PE)

_CFGS: dict[str, Any] = {v.name: pretrained_cfg(v, url="") for v in TINY}
default_cfgs = generate_default_cfgs(
    {"tinytest_cait": pretrained_cfg(CAIT, url=""), "tinytest_dinov3": pretrained_cfg(DINOV3, url=""), **_CFGS}
    | {"tinytest_beit": pretrained_cfg(BEIT, url=""), "tinytest_pe": pretrained_cfg(PE, url="")}
    | {n: pretrained_cfg(RESMLP, url="", first_conv="stem.proj") for n in ("tinytest_resmlp", RESMLP.name)}
    | {n: pretrained_cfg(XCIT, url="", first_conv="patch_embed.proj.0.0") for n in ("tinytest_xcit", XCIT.name)}
    | {
        n: pretrained_cfg(CONVNEXT, url="", first_conv="stem.0", classifier="head.fc", fixed_input_size=False)
        for n in ("tinytest_convnext", CONVNEXT.name)
    }
)


def _args(v: Variant, kwargs: dict[str, Any]) -> dict[str, Any]:
    return {**v.model_args, "img_size": v.img_size, **kwargs}


@register_model
def tinytest_cait(pretrained: bool = False, **kwargs: Any) -> Any:
    return _create_cait("tinytest_cait", pretrained, **_args(CAIT, {"init_values": 1e-5, **kwargs}))


@register_model
def tinytest_cait_layerscale(pretrained: bool = False, **kwargs: Any) -> Any:
    return build_variant(cait_ls.CaitLS, cait_ls.checkpoint_filter_fn, CAIT, pretrained, {"img_size": 32, **kwargs})


@register_model
def tinytest_deit3(pretrained: bool = False, **kwargs: Any) -> Any:
    args = _args(DEIT3, {"no_embed_class": True, "init_values": 1e-6, **kwargs})
    return _create_deit("tinytest_deit3", pretrained, **args)


@register_model
def tinytest_vit5(pretrained: bool = False, **kwargs: Any) -> Any:
    return build_variant(vit5.Vit5, vit5.checkpoint_filter_fn, VIT5, pretrained, {"img_size": 32, **kwargs})


@register_model
def tinytest_dinov3(pretrained: bool = False, **kwargs: Any) -> Any:
    return _create_eva("tinytest_dinov3", pretrained, **{**dinov3_ls.DINOV3_ARGS, **_args(DINOV3, kwargs)})


@register_model
def tinytest_dinov3_ls(pretrained: bool = False, **kwargs: Any) -> Any:
    return dinov3_ls.build(DINOV3, pretrained, {"img_size": 32, **kwargs})


@register_model
def tinytest_dinov2(pretrained: bool = False, **kwargs: Any) -> Any:
    args = _args(DINOV2, {"reg_tokens": 4, "no_embed_class": True, "num_classes": 0, **kwargs})
    return _create_vision_transformer("tinytest_dinov2", pretrained, **args)


@register_model
def tinytest_convnext(pretrained: bool = False, **kwargs: Any) -> Any:
    return _create_convnext("tinytest_convnext", pretrained, **{**dict(_CONVNEXT), **kwargs})


@register_model
def tinytest_convnext_ls(pretrained: bool = False, **kwargs: Any) -> Any:
    return convnext_ls.build(CONVNEXT, pretrained, kwargs)


@register_model
def tinytest_beit(pretrained: bool = False, **kwargs: Any) -> Any:
    return _create_beit("tinytest_beit", pretrained, **_args(BEIT, kwargs))


@register_model
def tinytest_beit_ls(pretrained: bool = False, **kwargs: Any) -> Any:
    return beit_ls.build(BEIT, pretrained, {"img_size": 32, **kwargs})


@register_model
def tinytest_resmlp(pretrained: bool = False, **kwargs: Any) -> Any:
    block = partial(ResBlock, init_values=1e-4)
    args = {"patch_size": 8, "num_blocks": 3, "embed_dim": 32, "mlp_ratio": 4, "img_size": 32, **kwargs}
    return _create_mixer("tinytest_resmlp", pretrained, block_layer=block, norm_layer=Affine, **args)


@register_model
def tinytest_resmlp_ls(pretrained: bool = False, **kwargs: Any) -> Any:
    return resmlp_ls.build(RESMLP, pretrained, {"img_size": 32, **kwargs})


@register_model
def tinytest_xcit(pretrained: bool = False, **kwargs: Any) -> Any:
    args = {"patch_size": 8, "embed_dim": 32, "depth": 2, "num_heads": 4, "eta": 1.0, "tokens_norm": True}
    return _create_xcit("tinytest_xcit", pretrained, **{**args, "img_size": 32, **kwargs})


@register_model
def tinytest_xcit_ls(pretrained: bool = False, **kwargs: Any) -> Any:
    return xcit_ls.build(XCIT, pretrained, {"img_size": 32, **kwargs})


@register_model
def tinytest_internvit(pretrained: bool = False, **kwargs: Any) -> Any:
    args = _args(INTERNVIT, {"final_norm": False, "dynamic_img_size": True, "num_classes": 0, **kwargs})
    return _create_vision_transformer("tinytest_internvit", pretrained, **args)


@register_model
def tinytest_pe(pretrained: bool = False, **kwargs: Any) -> Any:
    return _create_eva(
        "tinytest_pe",
        pretrained,
        **{**pe_ls.PE_ARGS, **_args(PE, {"ref_feat_shape": (4, 4), "num_classes": 0, **kwargs})},
    )


@register_model
def tinytest_pe_ls(pretrained: bool = False, **kwargs: Any) -> Any:
    return pe_ls.build(PE, pretrained, {"img_size": 32, "ref_feat_shape": (4, 4), "num_classes": 0, **kwargs})
