"""What each model family is: key rules, fold targets, variants and their shapes, rotary tables.

These are the facts every other part reads (detection, conversion, the model files,
the references, the release pipeline, the docs); nothing here does I/O, and nothing
here imports torch or timm at module level, so reading the tables is instant.

- Key rules: per family, an ordered table of :class:`Rule` s from any accepted layout
  to the ``ls`` layout (``blocks.N.ls1.gamma``) and back to the official ``gamma``
  layout (``blocks.N.gamma_1``); :mod:`timm_layerscale.conversion.keys` applies them.
- :data:`FOLD_TARGETS`: the linear layer each LayerScale folds into.
- :data:`VARIANTS`: every convertible architecture, one row each; the model files
  register their models from it, and detection computes the keys and shapes of each
  variant's state dict from it (:func:`~timm_layerscale.conversion.detect.state_dict_shapes`).
- ViT-5's rotary tables: the official checkpoints store them as buffers;
  :func:`official_rope_buffers` computes them, :func:`check_rope_buffers` checks a file's.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import RemapError

if TYPE_CHECKING:
    import torch

__all__ = [
    "Rule",
    "Family",
    "FAMILIES",
    "KEEP",
    "register_family",
    "get_family",
    "FOLD_TARGETS",
    "CAIT_RELEASE_URL",
    "DEFAULT_NUM_CLASSES",
    "VIT5_HUB_REPO",
    "OFFICIAL_SHA256",
    "VIT5_ROPE_THETA",
    "Variant",
    "VARIANTS",
    "get_variant",
    "variants_of",
    "rope_buffers",
    "official_rope_buffers",
    "check_rope_buffers",
]


# ---- Key rules ----------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """One key rule: a regular expression and what becomes of a key it matches.

    Attributes:
        pattern: Regular expression matched against the whole key (``re.fullmatch``).
        replace: Replacement template (``re`` syntax, ``\\1`` for groups); ``None``
            drops the key; ``"\\g<0>"`` keeps it unchanged.
    """

    pattern: str
    replace: str | None

    def apply(self, key: str) -> tuple[bool, str | None]:
        m = re.fullmatch(self.pattern, key)
        if m is None:
            return False, None
        if self.replace is None:
            return True, None
        return True, m.expand(self.replace)


#: Replacement that keeps a key unchanged.
KEEP = r"\g<0>"


@dataclass(frozen=True)
class Family:
    """The rule tables of one model family.

    Attributes:
        name: Family name (``"cait"``, ``"vit5"``, ``"deit3"``).
        to_layerscale: Rules from any accepted source layout to the ``ls`` layout.
        to_gamma: Rules from the ``ls`` layout back to the official ``gamma`` layout.
        official_prefix: Prefix of every key in the official training code's files
            (``"module."`` for CaiT, saved from DistributedDataParallel).
    """

    name: str
    to_layerscale: tuple[Rule, ...]
    to_gamma: tuple[Rule, ...]
    official_prefix: str = ""


#: The rule tables of every family, by name.
FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    """Add (or replace) a family's rule tables in :data:`FAMILIES`."""
    FAMILIES[family.name] = family
    return family


def get_family(name: str) -> Family:
    """Return the family called ``name``; :class:`~timm_layerscale.errors.RemapError` if there is none."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise RemapError(f"unknown model family {name!r}; choose one of: {', '.join(sorted(FAMILIES))}") from None


_LINEAR = r"\.(?:weight|bias)"


def _family(
    name: str,
    blocks: str,
    keep: tuple[Rule, ...],
    *,
    ls_only: tuple[Rule, ...] = (),
    gamma_only: tuple[Rule, ...] = (),
    official_prefix: str = "",
) -> Family:
    """A family whose LayerScale lives in blocks matching ``blocks`` and whose other keys ``keep`` keeps.

    ``ls_only`` and ``gamma_only`` are rules of one direction only (keys one layout
    has and the other does not).
    """
    gamma, ls = rf"({blocks}\.\d+)\.gamma_([12])", rf"({blocks}\.\d+)\.ls([12])\.gamma"
    return register_family(
        Family(
            name=name,
            to_layerscale=(Rule(gamma, r"\1.ls\2.gamma"), Rule(ls, KEEP), *ls_only, *keep),
            to_gamma=(Rule(ls, r"\1.gamma_\2"), Rule(gamma, KEEP), *gamma_only, *keep),
            official_prefix=official_prefix,
        )
    )


# CaiT (official ``cait_models.py``; timm's ``cait_*``): self-attention blocks with
# talking heads, then class-attention blocks; files saved from DistributedDataParallel.
_family(
    "cait",
    r"blocks(?:_token_only)?",
    (
        Rule(r"cls_token|pos_embed", KEEP),
        Rule(r"(?:patch_embed\.proj|norm|head)" + _LINEAR, KEEP),
        Rule(
            r"blocks\.\d+\.(?:norm1|norm2|attn\.qkv|attn\.proj|attn\.proj_l|attn\.proj_w|mlp\.fc1|mlp\.fc2)" + _LINEAR,
            KEEP,
        ),
        Rule(
            r"blocks_token_only\.\d+\.(?:norm1|norm2|attn\.q|attn\.k|attn\.v|attn\.proj|mlp\.fc1|mlp\.fc2)" + _LINEAR,
            KEEP,
        ),
    ),
    official_prefix="module.",
)

# ViT-5 (official ``models_vit5.py``): RMSNorm (weight only), QK-norm, no qkv bias,
# registers, and per-block rotary frequency buffers that the model computes: the
# ``ls`` layout drops them once they are checked against the computed ones, and a file
# mapped back to the ``gamma`` layout gets them from :func:`official_rope_buffers`.
_ROPE_BUFFER = r"blocks\.\d+\.attn\.rope(?:_reg)?\.freqs"
_family(
    "vit5",
    r"blocks",
    (
        Rule(r"cls_token|reg_token|pos_embed", KEEP),
        Rule(r"patch_embed\.proj" + _LINEAR + r"|norm\.weight|head" + _LINEAR, KEEP),
        Rule(
            r"blocks\.\d+\.(?:(?:norm1|norm2|attn\.q_norm|attn\.k_norm)\.weight|attn\.qkv\.weight"
            r"|(?:attn\.proj|mlp\.fc1|mlp\.fc2)" + _LINEAR + ")",
            KEEP,
        ),
    ),
    ls_only=(Rule(_ROPE_BUFFER, None),),
    gamma_only=(Rule(_ROPE_BUFFER, KEEP),),
)

# DeiT-III (official ``models_v2.py``, files deit_3_*.pth = {'model': state_dict}; timm's
# deit3_*): the same keys apart from LayerScale. The position embedding has no
# class-token slot in both (timm builds deit3 with no_embed_class=True).
_family(
    "deit3",
    r"blocks",
    (
        Rule(r"cls_token|pos_embed", KEEP),
        Rule(r"(?:patch_embed\.proj|norm|head)" + _LINEAR, KEEP),
        Rule(r"blocks\.\d+\.(?:norm1|norm2|attn\.qkv|attn\.proj|mlp\.fc1|mlp\.fc2)" + _LINEAR, KEEP),
    ),
)


# ---- Folding ------------------------------------------------------------------------

#: A LayerScale key in either layout, by full match: the block, and which gate (``g`` in the
#: official ``gamma_1``/``gamma_2``, ``l`` in the module layout's ``ls1.gamma``/``ls2.gamma``).
GATE_KEY = re.compile(r"(?P<block>.+?)\.(?:gamma_(?P<g>[12])|ls(?P<l>[12])\.gamma)")
#: The linear layer each LayerScale folds into, per block, in every family. ``ls1`` scales
#: the attention's output projection, ``ls2`` the MLP's second layer.
FOLD_TARGETS = {"ls1": ("attn", "proj"), "ls2": ("mlp", "fc2")}


# ---- Variants -----------------------------------------------------------------------

#: Classifier outputs of every released model (ImageNet-1k).
DEFAULT_NUM_CLASSES = 1000
#: Where the official CaiT checkpoints are published (``+ Variant.official_file``).
CAIT_RELEASE_URL = "https://dl.fbaipublicfiles.com/deit/"
#: The Hub repository of the official ViT-5 checkpoints.
VIT5_HUB_REPO = "FengWang3211/ViT-5"
#: SHA-256 of official release files, by file name. A model card calls weights "the
#: official weights released with the paper" only when the source matches an entry, and
#: the release pipeline (``python -m convert``) refuses a file that differs from its pin.
#: The releases publish no checksums, so an entry is added only after a file fetched
#: from its official address has been checked; until then cards name the source file
#: and its SHA-256 (every release summary records them).
OFFICIAL_SHA256: dict[str, str] = {}


@dataclass(frozen=True)
class Variant:
    """A convertible architecture: one row of :data:`VARIANTS`.

    Attributes:
        name: Model name in timm's registry (``cait_s24_224_ls``).
        family: Key-rule family (``cait``, ``vit5``, ``deit3``).
        reference: timm model computing the same function from the official
            weights (``cait_s24_224``), or ``None`` when timm has none.
        img_size: Default input resolution (pixels).
        embed_dim: Width.
        depth: Number of (self-attention) blocks.
        num_heads: Attention heads.
        init_value: LayerScale initial value of the released model (``None``: timm's default).
        patch_size: Patch size.
        official_file: File name of the official release, where there is one.
    """

    name: str
    family: str
    reference: str | None
    img_size: int
    embed_dim: int
    depth: int
    num_heads: int
    init_value: float | None
    patch_size: int = 16
    official_file: str | None = None

    @property
    def model_args(self) -> dict[str, Any]:
        """The keyword arguments the model file builds this variant with."""
        args: dict[str, Any] = dict(
            patch_size=self.patch_size, embed_dim=self.embed_dim, depth=self.depth, num_heads=self.num_heads
        )
        if self.init_value is not None:
            args["init_values"] = self.init_value
        return args


def _cait(size: str, img: int, dim: int, depth: int, heads: int, init: float) -> Variant:
    stem = f"{size.upper()}{depth}_{img}"
    ref = f"cait_{size}{depth}_{img}"
    return Variant(f"{ref}_ls", "cait", ref, img, dim, depth, heads, init, official_file=f"{stem}.pth")


def _vit5(size: str, img: int, dim: int, depth: int, heads: int, released: bool = True) -> Variant:
    name = f"vit5_{size}_patch16_{img}"
    return Variant(name, "vit5", None, img, dim, depth, heads, 1e-4, official_file=f"{name}.pth" if released else None)


def _deit3(size: str, img: int, dim: int, depth: int, heads: int, patch: int = 16) -> Variant:
    name = f"deit3_{size}_patch{patch}_{img}"
    return Variant(name, "deit3", name, img, dim, depth, heads, None, patch_size=patch)


#: Every convertible architecture, in this order. The LayerScale CaiT models (the released
#: values of the official checkpoints), ViT-5, then timm's DeiT-III models.
VARIANTS: tuple[Variant, ...] = (
    _cait("xxs", 224, 192, 24, 4, 1e-5),
    _cait("xxs", 384, 192, 24, 4, 1e-5),
    _cait("xxs", 224, 192, 36, 4, 1e-5),
    _cait("xxs", 384, 192, 36, 4, 1e-5),
    _cait("xs", 384, 288, 24, 6, 1e-5),
    _cait("s", 224, 384, 24, 8, 1e-5),
    _cait("s", 384, 384, 24, 8, 1e-5),
    _cait("s", 384, 384, 36, 8, 1e-6),
    _cait("m", 384, 768, 36, 16, 1e-6),
    _cait("m", 448, 768, 48, 16, 1e-6),
    _vit5("small", 224, 384, 12, 6),
    _vit5("base", 224, 768, 12, 12),
    _vit5("base", 384, 768, 12, 12),
    _vit5("large", 224, 1024, 24, 16),
    _vit5("large", 384, 1024, 24, 16),
    _vit5("xlarge", 224, 1152, 28, 16, released=False),
    _deit3("small", 224, 384, 12, 6),
    _deit3("small", 384, 384, 12, 6),
    _deit3("medium", 224, 512, 12, 8),
    _deit3("base", 224, 768, 12, 12),
    _deit3("base", 384, 768, 12, 12),
    _deit3("large", 224, 1024, 24, 16),
    _deit3("large", 384, 1024, 24, 16),
    _deit3("huge", 224, 1280, 32, 16, patch=14),
)


def get_variant(name: str) -> Variant:
    """The variant called ``name`` (a pretrained tag after ``.`` is ignored).

    Raises:
        ArchitectureError: No convertible model has that name; the message lists close names.
    """
    import difflib

    from .errors import ArchitectureError

    base = name.split(".", 1)[0]
    for v in VARIANTS:
        if v.name == base:
            return v
    close = difflib.get_close_matches(base, [v.name for v in VARIANTS], n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}?" if close else "run 'timm-layerscale list' to see them"
    raise ArchitectureError(f"unknown model {name!r}; {hint}")


def variants_of(family: str) -> dict[str, Variant]:
    """The variants of one family, by name, in table order."""
    return {v.name: v for v in VARIANTS if v.family == family}


# ---- ViT-5 rotary tables ------------------------------------------------------------

#: Rotary bases of ViT-5, for the patch tokens and for the register tokens.
VIT5_ROPE_THETA = (10000.0, 100.0)
_ROPE_KEY = re.compile(r"blocks\.(\d+)\.attn\.(rope|rope_reg)\.freqs")


def rope_buffers(depth: int, head_dim: int, thetas: tuple[float, float] = VIT5_ROPE_THETA) -> dict[str, torch.Tensor]:
    """The rotary buffers of the official ViT-5 layout, for ``depth`` blocks of heads ``head_dim`` wide.

    The official model keeps each block's frequencies as persistent buffers
    (``blocks.i.attn.rope.freqs``, ``blocks.i.attn.rope_reg.freqs``), so its
    ``load_state_dict(strict=True)`` needs them; the package's model computes them.

    Returns:
        Key to fp32 tensor ``(head_dim // 4,)``, a separate tensor per key.
    """
    from .layers.rope import rope_bands

    patch, reg = (rope_bands(head_dim, theta) for theta in thetas)
    out: dict[str, torch.Tensor] = {}
    for i in range(depth):
        out[f"blocks.{i}.attn.rope.freqs"] = patch.clone()
        out[f"blocks.{i}.attn.rope_reg.freqs"] = reg.clone()
    return out


def official_rope_buffers(variant: Variant | str) -> dict[str, torch.Tensor]:
    """:func:`rope_buffers` of a ViT-5 variant of :data:`VARIANTS` (or its name; a pretrained tag is ignored)."""
    if isinstance(variant, str):
        found = variants_of("vit5").get(variant.split(".", 1)[0])
        if found is None:
            raise KeyError(f"unknown ViT-5 model {variant!r}; choose one of: {', '.join(variants_of('vit5'))}")
        variant = found
    return rope_buffers(variant.depth, variant.embed_dim // variant.num_heads)


def check_rope_buffers(state_dict: Mapping[str, Any], expected: Mapping[str, torch.Tensor]) -> None:
    """Check an official ViT-5 state dict's ``*.freqs`` buffers against the computed ``expected`` ones.

    Buffers that are absent are fine (a converted file has none). Equality allows one
    or two float32 ulps (relative 1e-6), the spread of ``pow`` across builds.

    Raises:
        RemapError: A buffer has another shape or other values: the checkpoint was made
            with other rotary settings (theta, head width) than the model computes.
    """
    found = {k: v for k, v in state_dict.items() if _ROPE_KEY.fullmatch(k)}
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
