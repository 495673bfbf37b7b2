"""Perception Encoder (arXiv 2504.13181), LayerScale only in its lang-large, lang-gigantic and spatial-gigantic
models: the authors' ``core/vision_encoder/pe.py`` holds ``ls_1.gamma`` modules (``official``); timm's Eva
``vit_pe_*`` raw ``gamma_1``/``gamma_2`` (``timm``; transformers' PerceptionLM holds that model as its vision tower);
this package's ``*_ls`` (:mod:`timm_layerscale.models.pe_ls`) LayerScale modules (``ls``)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ..errors import RemapError
from . import KEEP, LINEAR, Family, Layout, Rule, Variant, gate_rules, register
from .loaders import own_model, timm_filtered, timm_model, without
from .operations import no_head
from .vit import VIT, gates

#: The parts of a PerceptionLM checkpoint beside its vision tower.
PERCEPTION_LM = r"(?:model\.)?(?:language_model|multi_modal_projector)\..+|lm_head\.weight"
_KEEP = (
    Rule(r"cls_token|pos_embed|patch_embed\.proj\.weight|(?:norm_pre|head)" + LINEAR, KEEP),
    Rule(r"blocks\.\d+\.(?:norm1|norm2|attn\.qkv|attn\.proj|mlp\.fc1|mlp\.fc2)" + LINEAR, KEEP),
)
GATES = gates("timm")
LS, RAW, TO_RAW = gate_rules(VIT["blocks"], GATES, _KEEP)


def authors_shape(target: str, tensor: Any, key: str, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """timm's class token ``(1, 1, C)`` and position embedding ``(1, N, C)`` as the authors hold them, ``(C,)`` and
    ``(N, C)``, and back (views)."""
    if key in ("cls_token", "pos_embed"):
        return {target: tensor.reshape(-1) if key == "cls_token" else tensor[0]}
    return {target: tensor.reshape(1, -1, tensor.shape[-1])}


def has_layerscale(target: str, tensor: Any, key: str, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The authors' patch embedding, where their file holds LayerScale gates.

    Raises:
        RemapError: It holds none: a Perception Encoder without LayerScale, which timm's own model reads.
    """
    if not any(k.endswith("ls_1.gamma") for k in state_dict):
        size = {192: "tiny", 384: "small", 768: "base", 1024: "large", 1536: "gigantic"}.get(tensor.shape[0], "")
        grid = state_dict["positional_embedding"].shape[0]
        img = tensor.shape[-1] * int((grid - ("class_embedding" in state_dict)) ** 0.5)
        raise RemapError(
            "checkpoint is a Perception Encoder without LayerScale (no ls_1.gamma); timm reads it as it is: "
            f"timm.create_model('vit_pe_spatial_{size}_patch{tensor.shape[-1]}_{img}', pretrained=True)"
        )
    return {target: tensor}


_BLOCK = r"transformer\.resblocks\.(\d+)"
_NAMES = (
    ("ln_1", "norm1"),
    ("ln_2", "norm2"),
    ("attn.out_proj", "attn.proj"),
    ("mlp.c_fc", "mlp.fc1"),
    ("mlp.c_proj", "mlp.fc2"),
)
#: The authors' ``VisionTransformer`` (no pooling, no projection: the LayerScale models') into this package's names.
OFFICIAL = (
    Rule(r"conv1\.weight", "patch_embed.proj.weight", op=has_layerscale),
    Rule(r"class_embedding", "cls_token", op=authors_shape),
    Rule(r"positional_embedding", "pos_embed", op=authors_shape),
    Rule(rf"ln_pre({LINEAR})", r"norm_pre\1"),
    Rule(rf"{_BLOCK}\.attn\.in_proj_(weight|bias)", r"blocks.\1.attn.qkv.\2"),
    *(Rule(rf"{_BLOCK}\.{re.escape(theirs)}({LINEAR})", rf"blocks.\1.{ours}\2") for theirs, ours in _NAMES),
    Rule(rf"{_BLOCK}\.ls_([12])\.gamma", r"blocks.\1.ls\2.gamma"),
)
#: This package's names into the authors' (no classifier).
TO_OFFICIAL = (
    Rule(r"patch_embed\.proj\.weight", "conv1.weight"),
    Rule(r"cls_token", "class_embedding", op=authors_shape),
    Rule(r"pos_embed", "positional_embedding", op=authors_shape),
    Rule(rf"norm_pre({LINEAR})", r"ln_pre\1"),
    Rule(r"blocks\.(\d+)\.attn\.qkv\.(weight|bias)", r"transformer.resblocks.\1.attn.in_proj_\2"),
    *(
        Rule(rf"blocks\.(\d+)\.{re.escape(ours)}({LINEAR})", rf"transformer.resblocks.\1.{theirs}\2")
        for theirs, ours in _NAMES
    ),
    Rule(r"blocks\.(\d+)\.ls([12])\.gamma", r"transformer.resblocks.\1.ls_\2.gamma"),
    Rule(r"head" + LINEAR, KEEP, op=no_head("the authors' Perception Encoder")),
)


def _timm(variant: Variant, folded: bool, args: dict[str, Any]) -> Any:
    """timm's ``vit_pe_*``, reading its state dict strictly, or a PerceptionLM checkpoint's vision tower."""
    return timm_model(str(variant.reference), args, without(PERCEPTION_LM))


BIBTEX = """\
@article{bolya2025perception,
  title   = {Perception Encoder: The best visual embeddings are not at the output of the network},
  author  = {Bolya, Daniel and Huang, Po-Yao and Sun, Peize and Cho, Jang Hyun and Madotto, Andrea and others},
  journal = {arXiv preprint arXiv:2504.13181},
  year    = {2025}
}"""

FAMILY = Family(
    "pe",
    "Perception Encoder",
    {
        "ls": Layout("ls", LS, LS, own_model),
        "timm": Layout(
            "timm",
            (Rule(PERCEPTION_LM, None, why="not the vision tower: PerceptionLM's projector and language model"), *RAW),
            TO_RAW,
            _timm,
        ),
        # the reference timm's _convert_pe reads, with the authors' attention (fused) kept
        "official": Layout("official", OFFICIAL, TO_OFFICIAL, timm_filtered("eva"), tell=r"conv1\.weight"),
    },
    tokens=True,
    gamma_file="timm",
    description="a Vision Transformer with 2-D rotary position embedding trained contrastively, then aligned to a "
    "language model or to spatial tasks, whose residual branches are scaled by LayerScale",
    bibtex=BIBTEX,
    license="apache-2.0",
    tower="vision_tower.timm_model.",
    **VIT,
    gates=GATES,
)


def _variant(kind: str, size: str, dim: int, depth: int, stem: str, **args: Any) -> Variant:
    ref = f"vit_pe_{kind}_{size}_patch14_448"
    return Variant(f"{ref}_ls", FAMILY, ref, 448, dim, depth, 16, 0.1, 14, f"{stem}.pt", tuple(args.items()))


_GIGANTIC = {"mlp_ratio": 8960 / 1536, "class_token": False}
#: timm's Perception Encoders with LayerScale, the authors' files named (``facebook/<name>`` on the Hub).
VARIANTS = (
    _variant("lang", "large", 1024, 23, "PE-Lang-L14-448", class_token=True, rope_grid_offset=1.0),
    _variant("lang", "gigantic", 1536, 47, "PE-Lang-G14-448", **_GIGANTIC),
    _variant("spatial", "gigantic", 1536, 50, "PE-Spatial-G14-448", **_GIGANTIC),
)
register(FAMILY, VARIANTS)
