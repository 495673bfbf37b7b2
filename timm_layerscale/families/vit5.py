"""ViT-5 (arXiv 2602.08071): the official ``models_vit5.py`` keeps raw ``gamma_1``/``gamma_2`` and rotary buffers
computed from constants; this package's ``vit5_*`` (:mod:`timm_layerscale.models.vit5`) LayerScale modules. timm has
no ViT-5: :mod:`~timm_layerscale.authors.vit5` reads the official layout."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import RemapError
from . import KEEP, LINEAR, Family, Layout, Rule, Variant, gate_rules, register
from .loaders import own_model
from .vit import VIT, gates

if TYPE_CHECKING:
    import torch


#: The Hub repository of the official checkpoints.
HUB_REPO = "FengWang3211/ViT-5"
#: Rotary bases, for the patch tokens and for the register tokens.
ROPE_THETA = (10000.0, 100.0)
_ROPE_BUFFER = r"blocks\.\d+\.attn\.rope(?:_reg)?\.freqs"


def rope_buffers(variant: Variant) -> dict[str, torch.Tensor]:
    """The official layout's persistent rotary buffers (``blocks.i.attn.rope.freqs`` and ``rope_reg.freqs``, fp32
    ``(head_dim // 4,)`` each), which its strict loading needs and this package's model computes."""
    from ..layers.rope import rope_bands

    patch, reg = (rope_bands(variant.embed_dim // variant.num_heads, theta) for theta in ROPE_THETA)
    out: dict[str, torch.Tensor] = {}
    for i in range(variant.depth):
        out[f"blocks.{i}.attn.rope.freqs"] = patch.clone()
        out[f"blocks.{i}.attn.rope_reg.freqs"] = reg.clone()
    return out


def freqs_computed(key: str, freqs: Any, state_dict: Any) -> str:
    """The proof that an official file's rotary buffer is the table the model computes (within ``pow``'s spread
    across builds, relative 1e-6): ``"freqs computed"``.

    Raises:
        RemapError: It is another table: the checkpoint was trained with other rotary settings.
    """
    import torch

    from ..layers.rope import rope_bands

    got = freqs.detach().to("cpu", torch.float32)
    want = rope_bands(4 * got.numel(), ROPE_THETA[".rope_reg." in key])
    if got.ndim != 1 or not torch.allclose(got, want, rtol=1e-6, atol=0.0):
        raise RemapError(
            f"checkpoint's rotary frequencies {key!r} differ from the ones the model computes; it was trained with "
            "other rotary settings, which this package's ViT-5 does not have"
        )
    return "freqs computed"


def official_model(variant: Variant, **kwargs: Any) -> Any:
    """The authors' model of a ViT-5 variant (:class:`~timm_layerscale.authors.vit5.Vit5Official`) with random
    weights; ``kwargs`` (``num_classes``, ``img_size``) override its arguments."""
    from ..authors.vit5 import Vit5Official

    return Vit5Official(**{"img_size": variant.img_size, **variant.model_args, **kwargs})


def _official(variant: Variant, folded: bool, args: dict[str, Any]) -> Any:
    """The official file's consumer: the official-layout model, with the rotary buffers where the file has none."""
    computed = rope_buffers(variant)
    model_args = {k: v for k, v in args.items() if k in ("num_classes", "img_size")}
    return lambda: official_model(variant, **model_args), lambda sd, model: {**computed, **sd}


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
GATES = gates("official")
LS, RAW, TO_RAW = gate_rules(VIT["blocks"], GATES, _KEEP, "official")

FAMILY = Family(
    "vit5",
    "ViT-5",
    {
        "ls": Layout("ls", LS, LS, own_model),
        # the official training dict: its rotary buffers, proven equal to the computed ones, dropped and written again
        "official": Layout(
            "official",
            (Rule(_ROPE_BUFFER, None, why=freqs_computed), *RAW),
            TO_RAW,
            _official,
            wrapper="model",
            buffers=rope_buffers,
        ),
    },
    exact=False,
    description="a Vision Transformer with RMSNorm, QK-norm, 2-D rotary position embedding and register tokens, "
    "whose residual branches are scaled by LayerScale",
    bibtex=BIBTEX,
    **VIT,
    gates=GATES,
)


def _variant(size: str, img: int, dim: int, depth: int, heads: int, released: bool = True) -> Variant:
    name = f"vit5_{size}_patch16_{img}"
    return Variant(name, FAMILY, None, img, dim, depth, heads, 1e-4, official_file=f"{name}.pth" if released else None)


#: The variants of the paper (XL has no released weights).
VARIANTS = (
    _variant("small", 224, 384, 12, 6),
    _variant("base", 224, 768, 12, 12),
    _variant("base", 384, 768, 12, 12),
    _variant("large", 224, 1024, 24, 16),
    _variant("large", 384, 1024, 24, 16),
    _variant("xlarge", 224, 1152, 28, 16, released=False),
)
register(FAMILY, VARIANTS)
