"""ConvNeXt (arXiv 2201.03545): timm's ``convnext_*`` keep each block's gate as a raw ``gamma`` parameter, this
package's ``convnext_*_ls`` (:mod:`timm_layerscale.models.convnext_ls`) a LayerScale module ``ls.gamma``; the authors'
files (facebookresearch/ConvNeXt ``{'model': ...}``, tiny to xlarge) name the stem and downsampling layers
``downsample_layers`` and the blocks ``stages.S.B``. ConvNeXt-V2's ``grn.gamma`` is a norm's weight: its files are
another family's."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import RemapError, option
from . import KEEP, LINEAR, Family, Gate, Layout, Proof, Rule, Variant, gate_rules, register
from .loaders import own_model, timm_filtered, timm_model, transformers_layout
from .operations import no_head

STAGE_BLOCK = r"stages\.(\d+)\.blocks\.(\d+)"
#: A block's one gate, on its MLP branch (ConvNeXt-V2's ``grn.gamma`` is a norm's weight, no gate).
GATES = (Gate("ls", "MLP", {"timm": "gamma", "official": "gamma"}, fold="mlp.fc2"),)
_KEEP = (
    Rule(r"(?:stem\.\d+|stages\.\d+\.downsample\.\d+|norm_pre|head\.(?:norm|fc|pre_logits\.fc))" + LINEAR, KEEP),
    Rule(rf"{STAGE_BLOCK}\.(?:conv_dw|norm|mlp\.fc[12])" + LINEAR, KEEP),
)
_BLOCKS = r"stages\.\d+\.blocks\.\d+"
LS, RAW, TO_RAW = gate_rules(_BLOCKS, GATES, _KEEP)


def _linear_mlp(target: str, tensor: Any, key: str, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """An MLP weight as the authors' ``Linear`` holds it; a ``conv_mlp`` model's 1x1 convolution is refused in one line
    (the authors released none: atto to nano and ``tiny_hnf`` are timm's own)."""
    if tensor.ndim > 2:
        raise RemapError(
            f"{key!r} is a 1x1 convolution: the authors' and transformers' ConvNeXt have no conv_mlp model; pass {option('to', 'timm')}"
        )
    return {target: tensor}


def final_norm_twice(key: str, tensor: Any, state_dict: Mapping[str, Any]) -> str:
    """The proof that a DINOv3 ConvNeXt file's ``norms.3`` is inert: it is its final ``norm`` (the authors append that
    module to ``norms``), equal value for value.

    Raises:
        RemapError: It differs from ``norm``: not the authors' model.
    """
    twin = state_dict.get(key.replace("norms.3.", "norm."))
    if twin is None or twin.shape != tensor.shape or not twin.equal(tensor):
        raise RemapError(
            f"checkpoint's {key} differs from {key.replace('norms.3.', 'norm.')}; DINOv3's ConvNeXt holds its final "
            "norm under both names, so the file is not one of its"
        )
    return "the final norm itself"


def with_norms_3(target: str, tensor: Any, key: str, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """timm's head norm as the authors' final ``norm``; for a file without a classifier (DINOv3's ConvNeXt, whose
    model holds the final norm as ``norm`` and ``norms.3``) under both names."""
    if any(k.startswith("head.fc.") for k in state_dict):
        return {target: tensor}
    return {target: tensor, target.replace("norm.", "norms.3.", 1): Proof(tensor, "the final norm itself")}


AUTHORS_STAGE_BLOCK = r"stages\.(\d+)\.(\d+)"
TO_STAGE_BLOCK = r"stages.\1.blocks.\2"
#: The authors' names into timm's (what timm's ``checkpoint_filter_fn`` does to them), and back.
OFFICIAL = (
    Rule(rf"downsample_layers\.0\.([01])({LINEAR})", r"stem.\1\2"),
    Rule(rf"downsample_layers\.(\d+)\.([01])({LINEAR})", r"stages.\1.downsample.\2\3"),
    Rule(rf"{AUTHORS_STAGE_BLOCK}\.dwconv({LINEAR})", rf"{TO_STAGE_BLOCK}.conv_dw\3"),
    Rule(rf"{AUTHORS_STAGE_BLOCK}\.norm({LINEAR})", rf"{TO_STAGE_BLOCK}.norm\3"),
    Rule(rf"{AUTHORS_STAGE_BLOCK}\.pwconv([12])({LINEAR})", rf"{TO_STAGE_BLOCK}.mlp.fc\3\4"),
    Rule(rf"{AUTHORS_STAGE_BLOCK}\.gamma", rf"{TO_STAGE_BLOCK}.ls.gamma"),
    Rule(rf"norm({LINEAR})", r"head.norm\1"),
    Rule(r"norms\.3" + LINEAR, None, why=final_norm_twice),
    Rule(rf"head({LINEAR})", r"head.fc\1"),
)
TO_OFFICIAL = (
    Rule(rf"stem\.([01])({LINEAR})", r"downsample_layers.0.\1\2"),
    Rule(rf"stages\.(\d+)\.downsample\.([01])({LINEAR})", r"downsample_layers.\1.\2\3"),
    Rule(rf"{STAGE_BLOCK}\.conv_dw({LINEAR})", r"stages.\1.\2.dwconv\3"),
    Rule(rf"{STAGE_BLOCK}\.norm({LINEAR})", r"stages.\1.\2.norm\3"),
    Rule(rf"{STAGE_BLOCK}\.mlp\.fc([12])({LINEAR})", r"stages.\1.\2.pwconv\3\4", op=_linear_mlp),
    Rule(rf"{STAGE_BLOCK}\.ls\.gamma", r"stages.\1.\2.gamma"),
    Rule(rf"head\.norm({LINEAR})", r"norm\1", op=with_norms_3),
    Rule(rf"head\.fc({LINEAR})", r"head\1"),
)


CLASSIFIER_PREFIX = r"(?:convnext\.)?"  # ConvNextForImageClassification's prefix
HF_STAGE = rf"(?:{CLASSIFIER_PREFIX}encoder\.|(?:model\.)?)stages\.(\d+)"  # ConvNextModel's, DINOv3ConvNextModel's
HF_STAGE_LAYER = rf"{HF_STAGE}\.layers\.(\d+)"
#: transformers' ``ConvNextModel`` names (``ConvNextForImageClassification``'s under ``convnext.``, its classifier)
#: and ``DINOv3ConvNextModel``'s (``stages``, read only) into timm's; back to ``ConvNextModel``'s (the backbone).
TRANSFORMERS = (
    Rule(rf"{CLASSIFIER_PREFIX}embeddings\.patch_embeddings({LINEAR})", r"stem.0\1"),
    Rule(rf"{CLASSIFIER_PREFIX}embeddings\.layernorm({LINEAR})", r"stem.1\1"),
    Rule(rf"(?:model\.)?stages\.0\.downsample_layers\.([01])({LINEAR})", r"stem.\1\2"),
    Rule(rf"{HF_STAGE}\.downsampl(?:ing_layer|e_layers)\.([01])({LINEAR})", r"stages.\1.downsample.\2\3"),
    Rule(rf"{HF_STAGE_LAYER}\.(?:dwconv|depthwise_conv)({LINEAR})", rf"{TO_STAGE_BLOCK}.conv_dw\3"),
    Rule(rf"{HF_STAGE_LAYER}\.(?:layernorm|layer_norm)({LINEAR})", rf"{TO_STAGE_BLOCK}.norm\3"),
    Rule(rf"{HF_STAGE_LAYER}\.(?:pwconv|pointwise_conv)([12])({LINEAR})", rf"{TO_STAGE_BLOCK}.mlp.fc\3\4"),
    Rule(rf"{HF_STAGE_LAYER}\.(?:layer_scale_parameter|gamma)", rf"{TO_STAGE_BLOCK}.ls.gamma"),
    Rule(rf"(?:{CLASSIFIER_PREFIX}layernorm|layer_norm)({LINEAR})", r"head.norm\1"),
    Rule(rf"classifier({LINEAR})", r"head.fc\1"),
)
TO_HF_STAGE = r"encoder.stages.\1"
TO_TRANSFORMERS = (
    Rule(rf"stem\.0({LINEAR})", r"embeddings.patch_embeddings\1"),
    Rule(rf"stem\.1({LINEAR})", r"embeddings.layernorm\1"),
    Rule(rf"stages\.(\d+)\.downsample\.([01])({LINEAR})", rf"{TO_HF_STAGE}.downsampling_layer.\2\3"),
    Rule(rf"{STAGE_BLOCK}\.conv_dw({LINEAR})", rf"{TO_HF_STAGE}.layers.\2.dwconv\3"),
    Rule(rf"{STAGE_BLOCK}\.norm({LINEAR})", rf"{TO_HF_STAGE}.layers.\2.layernorm\3"),
    Rule(rf"{STAGE_BLOCK}\.mlp\.fc([12])({LINEAR})", rf"{TO_HF_STAGE}.layers.\2.pwconv\3\4", op=_linear_mlp),
    Rule(rf"{STAGE_BLOCK}\.ls\.gamma", rf"{TO_HF_STAGE}.layers.\2.layer_scale_parameter"),
    Rule(rf"head\.norm({LINEAR})", r"layernorm\1"),
    Rule(r"head\.fc" + LINEAR, KEEP, op=no_head("transformers' ConvNextModel")),
)

_TELL = rf"{CLASSIFIER_PREFIX}embeddings\.patch_embeddings\.weight|(?:model\.)?stages\.0\.downsample_layers\.0\.weight"  # both


def transformers_config(variant: Variant, shapes: Mapping[str, tuple[int, ...]]) -> Any:
    """transformers' ``ConvNextConfig`` of a variant, its final norm's epsilon the authors' 1e-6 (a folder with
    transformers' default, 1e-12, is verified with the epsilons' measured effect added to the bound).

    Raises:
        RemapError: An architecture transformers' ConvNeXt cannot compute (another stem, norm or epsilon, a head MLP).
    """
    from transformers import ConvNextConfig

    args = dict(variant.args)
    if set(args) - {"depths", "dims"}:
        raise RemapError(
            f"transformers' ConvNextModel has no {variant.reference} (stem, norm or head); pass {option('to', 'timm')}"
        )
    return ConvNextConfig(
        hidden_sizes=list(args["dims"]), depths=list(args["depths"]), image_size=variant.img_size, layer_norm_eps=1e-6
    )


BIBTEX = """\
@inproceedings{liu2022convnet,
  title     = {A {ConvNet} for the 2020s},
  author    = {Liu, Zhuang and Mao, Hanzi and Wu, Chao-Yuan and Feichtenhofer, Christoph and Darrell, Trevor and Xie, Saining},
  booktitle = {Proceedings of the IEEE/CVF Conference on Computer Vision and Pattern Recognition (CVPR)},
  pages     = {11976--11986},
  year      = {2022}
}"""

FAMILY = Family(
    "convnext",
    "ConvNeXt",
    {
        "ls": Layout("ls", LS, LS, own_model),
        "timm": Layout("timm", RAW, TO_RAW, lambda v, folded, args: timm_model(str(v.reference), args)),
        "official": Layout(
            "official",
            OFFICIAL,
            TO_OFFICIAL,
            timm_filtered("convnext"),
            tell=r"downsample_layers\.0\.0\.weight",
            wrapper="model",
        ),
        "transformers": transformers_layout(TRANSFORMERS, TO_TRANSFORMERS, transformers_config, _TELL, True),
    },
    full_title="ConvNeXt",
    description="a convolutional network of depthwise-convolution blocks whose residual branches are scaled by "
    "LayerScale",
    bibtex=BIBTEX,
    license="apache-2.0",
    gamma_file="timm",
    blocks=_BLOCKS,
    gates=GATES,
    head="head.fc",
)


def _variant(size: str, depths: tuple[int, ...], dims: tuple[int, ...], img: int = 224, **args: Any) -> Variant:
    """A ConvNeXt architecture: ``embed_dim`` is its first stage's width (what a file's first gate says), ``depth``
    its blocks, ``patch_size`` its stem's stride; ``args`` are timm's ``ConvNeXt`` arguments."""
    ref = f"convnext_{size}"
    args = {"depths": depths, "dims": dims, **args}
    return Variant(f"{ref}_ls", FAMILY, ref, img, dims[0], sum(depths), 0, 1e-6, patch_size=4, args=tuple(args.items()))


_SMALL, _FEMTO, _ZEPTO = (2, 2, 6, 2), (48, 96, 192, 384), ((2, 2, 4, 2), (32, 64, 128, 256))
#: timm's ConvNeXt architectures (``conv_mlp``: 1x1 convolutions for the MLP; ``_ols``: an overlapping stem).
VARIANTS = (
    _variant("zepto_rms", *_ZEPTO, conv_mlp=True, norm_layer="simplenorm"),
    _variant("zepto_rms_ols", *_ZEPTO, conv_mlp=True, norm_layer="simplenorm", stem_type="overlap_act"),
    _variant("atto", _SMALL, (40, 80, 160, 320), conv_mlp=True),
    _variant("atto_ols", _SMALL, (40, 80, 160, 320), conv_mlp=True, stem_type="overlap_tiered"),
    _variant("atto_rms", _SMALL, (40, 80, 160, 320), conv_mlp=True, norm_layer="rmsnorm2d"),
    _variant("femto", _SMALL, _FEMTO, conv_mlp=True),
    _variant("femto_ols", _SMALL, _FEMTO, conv_mlp=True, stem_type="overlap_tiered"),
    _variant("pico", _SMALL, (64, 128, 256, 512), conv_mlp=True),
    _variant("pico_ols", _SMALL, (64, 128, 256, 512), conv_mlp=True, stem_type="overlap_tiered"),
    _variant("nano", (2, 2, 8, 2), (80, 160, 320, 640), conv_mlp=True),
    _variant("nano_ols", (2, 2, 8, 2), (80, 160, 320, 640), conv_mlp=True, stem_type="overlap"),
    _variant("tiny_hnf", (3, 3, 9, 3), (96, 192, 384, 768), head_norm_first=True, conv_mlp=True),
    _variant("tiny", (3, 3, 9, 3), (96, 192, 384, 768)),
    _variant("small", (3, 3, 27, 3), (96, 192, 384, 768)),
    _variant("base", (3, 3, 27, 3), (128, 256, 512, 1024)),
    _variant("large", (3, 3, 27, 3), (192, 384, 768, 1536)),
    _variant("large_mlp", (3, 3, 27, 3), (192, 384, 768, 1536), img=320, head_hidden_size=1536),
    _variant("xlarge", (3, 3, 27, 3), (256, 512, 1024, 2048)),
    _variant("xxlarge", (3, 4, 30, 3), (384, 768, 1536, 3072), img=256, norm_eps=1e-5),
)
register(FAMILY, VARIANTS)
