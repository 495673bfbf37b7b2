"""ViT-5 (arXiv 2602.08071): the official ``models_vit5.py`` keeps raw ``gamma_1``/``gamma_2`` and rotary buffers
computed from constants; this package's ``vit5_*`` (:mod:`timm_layerscale.models.vit5`) LayerScale modules. timm has
no ViT-5: :mod:`~timm_layerscale.families.vit5_official` reads the official layout."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..errors import RemapError
from . import KEEP, LINEAR, Family, Rule, Variant, get_variant, layerscale_rules, own_model, register

if TYPE_CHECKING:
    import torch


#: The Hub repository of the official checkpoints.
HUB_REPO = "FengWang3211/ViT-5"
#: Rotary bases, for the patch tokens and for the register tokens.
ROPE_THETA = (10000.0, 100.0)
_ROPE_BUFFER = r"blocks\.\d+\.attn\.rope(?:_reg)?\.freqs"


def _variant(size: str, img: int, dim: int, depth: int, heads: int, released: bool = True) -> Variant:
    name = f"vit5_{size}_patch16_{img}"
    return Variant(name, "vit5", None, img, dim, depth, heads, 1e-4, official_file=f"{name}.pth" if released else None)


#: The variants of the paper (XL has no released weights).
VARIANTS = (
    _variant("small", 224, 384, 12, 6),
    _variant("base", 224, 768, 12, 12),
    _variant("base", 384, 768, 12, 12),
    _variant("large", 224, 1024, 24, 16),
    _variant("large", 384, 1024, 24, 16),
    _variant("xlarge", 224, 1152, 28, 16, released=False),
)


def rope_buffers(depth: int, head_dim: int, thetas: tuple[float, float] = ROPE_THETA) -> dict[str, torch.Tensor]:
    """The official layout's persistent rotary buffers (``blocks.i.attn.rope.freqs`` and ``rope_reg.freqs``, fp32
    ``(head_dim // 4,)`` each), which its strict loading needs and this package's model computes."""
    from ..layers.rope import rope_bands

    patch, reg = (rope_bands(head_dim, theta) for theta in thetas)
    out: dict[str, torch.Tensor] = {}
    for i in range(depth):
        out[f"blocks.{i}.attn.rope.freqs"] = patch.clone()
        out[f"blocks.{i}.attn.rope_reg.freqs"] = reg.clone()
    return out


def check_rope_buffers(state_dict: Mapping[str, Any], expected: Mapping[str, torch.Tensor]) -> None:
    """Raise :class:`~timm_layerscale.errors.RemapError` where a ``*.freqs`` buffer of an official state dict
    (absent ones are fine) differs from the computed ``expected`` one by more than ``pow``'s spread across
    builds (relative 1e-6): the checkpoint was made with other rotary settings."""
    found = {k: v for k, v in state_dict.items() if re.fullmatch(_ROPE_BUFFER, k)}
    if not found:
        return
    import torch

    for key, value in found.items():
        want = expected.get(key)
        if want is None:
            raise RemapError(f"checkpoint has a rotary buffer {key!r} for a block the model does not have")
        got = torch.as_tensor(value).detach().to("cpu", torch.float32)
        if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-6, atol=0.0):
            raise RemapError(
                f"checkpoint's rotary frequencies {key!r} differ from the ones the model computes "
                f"(shape {list(got.shape)} vs {list(want.shape)}); it was trained with other rotary settings"
            )


def official_rope_buffers(variant: Variant | str, tensors: Mapping[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """:func:`rope_buffers` of a variant (or its name), checked against those ``tensors`` hold
    (:func:`check_rope_buffers`)."""
    v = get_variant(variant) if isinstance(variant, str) else variant
    computed = rope_buffers(v.depth, v.embed_dim // v.num_heads)
    check_rope_buffers(tensors or {}, computed)
    return computed


def native(variant: Variant, layout: str, folded: bool, args: dict[str, Any]) -> Any:
    """``gamma``: :mod:`~timm_layerscale.families.vit5_official`, with the rotary buffers where the file has none; ``ls``: this package's."""
    if layout == "gamma":
        from .vit5_official import build_official_vit5

        computed = official_rope_buffers(variant)
        model_args = {k: v for k, v in args.items() if k in ("num_classes", "img_size")}
        return lambda: build_official_vit5(variant, **model_args), lambda sd, model: {**computed, **sd}
    return own_model(variant, folded, args)


BIBTEX = """\
@article{wang2026vit5,
  title   = {{ViT-5}: Vision Transformers for the Mid-2020s},
  author  = {Wang, Feng and Ren, Sucheng and Zhang, Tiezheng and Neskovic, Predrag and Bhattad, Anand and Xie, Cihang and Yuille, Alan},
  journal = {arXiv preprint arXiv:2602.08071},
  year    = {2026}
}"""

_BLOCK = (
    r"blocks\.\d+\.(?:(?:norm1|norm2|attn\.q_norm|attn\.k_norm)\.weight|attn\.qkv\.weight|(?:attn\.proj|mlp\.fc[12])"
)
_KEEP = (
    Rule(r"cls_token|reg_token|pos_embed", KEEP),
    Rule(r"patch_embed\.proj" + LINEAR + r"|norm\.weight|head" + LINEAR, KEEP),
    Rule(_BLOCK + LINEAR + ")", KEEP),
)

FAMILY = Family(
    "vit5",
    "ViT-5",
    # the ls layout drops the rotary buffers (checked first), the official layout gets them back
    *layerscale_rules(r"blocks", _KEEP, ls_only=(Rule(_ROPE_BUFFER, None),), gamma_only=(Rule(_ROPE_BUFFER, KEEP),)),
    native=native,
    computed=_ROPE_BUFFER,
    official_buffers=official_rope_buffers,
    exact=False,
    description="a Vision Transformer with RMSNorm, QK-norm, 2-D rotary position embedding and register tokens, "
    "whose residual branches are scaled by LayerScale",
    bibtex=BIBTEX,
)
register(FAMILY, VARIANTS)
