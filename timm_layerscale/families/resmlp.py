"""ResMLP (arXiv 2105.03404): the authors' files (facebookresearch/deit ``resmlp_models.py``, a plain state dict) keep
raw ``gamma_1``/``gamma_2``, the token-mixing linear as ``attn``, the channel MLP as ``mlp`` and each ``Affine``'s
``alpha``/``beta`` as ``(dim,)``; timm's ``resmlp_*`` (``MlpMixer`` of ``ResBlock`` s) bare ``ls1``/``ls2``,
``linear_tokens``, ``mlp_channels`` and ``(1, 1, dim)``; this package's ``resmlp_*_ls``
(:mod:`timm_layerscale.models.resmlp_ls`) LayerScale modules ``ls1.gamma``/``ls2.gamma``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import KEEP, LINEAR, Family, Gate, Layout, Rule, Variant, gate_rules, register
from .loaders import own_model, timm_filtered, timm_model

#: ``ls1`` scales the token-mixing branch, ``ls2`` the channel MLP's.
GATES = (
    Gate(
        "ls1",
        "token mixing",
        {"timm": "ls1", "official": "gamma_1"},
        no_fold="ResMLP's ls1 scales a token-mixing linear whose bias is per token, which no per-channel fold holds",
    ),
    Gate("ls2", "MLP", {"timm": "ls2", "official": "gamma_2"}, fold="mlp_channels.fc2"),
)
ANY_BLOCK = r"blocks\.\d+"
AFFINE = r"(?:blocks\.\d+\.norm[12]|norm)\.(?:alpha|beta)"
_KEEP = (
    Rule(r"(?:stem\.proj|head)" + LINEAR, KEEP),
    Rule(rf"{ANY_BLOCK}\.(?:linear_tokens|mlp_channels\.fc1|mlp_channels\.fc2)" + LINEAR, KEEP),
    Rule(AFFINE, KEEP),
)
LS, RAW, TO_RAW = gate_rules(ANY_BLOCK, GATES, _KEEP)
_, OFFICIAL_GATES, TO_OFFICIAL_GATES = gate_rules(ANY_BLOCK, GATES, (), "official")


def as_affine(target: str, tensor: Any, key: str, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The authors' ``Affine`` vector ``(dim,)`` as timm's ``(1, 1, dim)`` (a view)."""
    return {target: tensor.reshape(1, 1, -1)}


def as_vector(target: str, tensor: Any, key: str, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """timm's ``Affine`` parameter ``(1, 1, dim)`` as the authors' ``(dim,)`` (a view)."""
    return {target: tensor.reshape(-1)}


#: The authors' names and shapes into the ``ls`` layout (what timm's ``checkpoint_filter_fn`` does), and back.
OFFICIAL = (
    *OFFICIAL_GATES,
    Rule(rf"patch_embed\.proj({LINEAR})", r"stem.proj\1"),
    Rule(rf"({ANY_BLOCK})\.attn({LINEAR})", r"\1.linear_tokens\2"),
    Rule(rf"({ANY_BLOCK})\.mlp\.(fc[12]{LINEAR})", r"\1.mlp_channels.\2"),
    Rule(AFFINE, KEEP, op=as_affine),
    Rule(r"head" + LINEAR, KEEP),
)
TO_OFFICIAL = (
    *TO_OFFICIAL_GATES,
    Rule(rf"stem\.proj({LINEAR})", r"patch_embed.proj\1"),
    Rule(rf"({ANY_BLOCK})\.linear_tokens({LINEAR})", r"\1.attn\2"),
    Rule(rf"({ANY_BLOCK})\.mlp_channels\.(fc[12]{LINEAR})", r"\1.mlp.\2"),
    Rule(AFFINE, KEEP, op=as_vector),
    Rule(r"head" + LINEAR, KEEP),
)

BIBTEX = """\
@article{touvron2022resmlp,
  title   = {{ResMLP}: Feedforward Networks for Image Classification With Data-Efficient Training},
  author  = {Touvron, Hugo and Bojanowski, Piotr and Caron, Mathilde and Cord, Matthieu and El-Nouby, Alaaeldin and
             Grave, Edouard and Izacard, Gautier and Joulin, Armand and Synnaeve, Gabriel and Verbeek, Jakob and
             J{\\'e}gou, Herv{\\'e}},
  journal = {IEEE Transactions on Pattern Analysis and Machine Intelligence},
  volume  = {45},
  number  = {4},
  pages   = {5314--5321},
  year    = {2023}
}"""

FAMILY = Family(
    "resmlp",
    "ResMLP",
    {
        "ls": Layout("ls", LS, LS, own_model),
        "timm": Layout("timm", RAW, TO_RAW, lambda v, folded, args: timm_model(str(v.reference), args)),
        "official": Layout("official", OFFICIAL, TO_OFFICIAL, timm_filtered("mlp_mixer")),
    },
    full_title="ResMLP",
    description="a network of residual MLP blocks, a linear layer mixing the patches then an MLP mixing the "
    "channels, each after an affine norm and scaled by LayerScale",
    bibtex=BIBTEX,
    license="apache-2.0",
    blocks=ANY_BLOCK,
    gates=GATES,
    stem="stem.proj.weight",
    head="head",
)


_ARGS = (("mlp_ratio", 4),)


def _variant(depth: int, dim: int, patch: int, init: float, authors: str) -> Variant:
    ref = f"resmlp_{'big_' if patch == 8 else ''}{depth}_224"
    return Variant(f"{ref}_ls", FAMILY, ref, 224, dim, depth, 0, init, patch, f"{authors}_no_dist.pth", _ARGS)


#: timm's ResMLP architectures (the authors' ``resmlp_12``, ``resmlp_24``, ``resmlp_36`` and ``resmlpB_24``).
VARIANTS = (
    _variant(12, 384, 16, 1e-4, "resmlp_12"),
    _variant(24, 384, 16, 1e-5, "resmlp_24"),
    _variant(36, 384, 16, 1e-6, "resmlp_36"),
    _variant(24, 768, 8, 1e-6, "resmlpB_24"),
)
register(FAMILY, VARIANTS)
