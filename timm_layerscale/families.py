"""The facts every other part reads, without I/O and without importing torch or timm: each family's key
rules (to the ``ls`` layout and back, applied by :mod:`timm_layerscale.conversion.keys`), the table of
convertible variants the model files register and detection reads, and ViT-5's rotary buffers."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import RemapError

if TYPE_CHECKING:
    import torch

__all__ = [
    "CAIT_RELEASE_URL",
    "DEFAULT_NUM_CLASSES",
    "FAMILIES",
    "GATE_KEY",
    "VARIANTS",
    "VIT5_HUB_REPO",
    "Family",
    "Rule",
    "Variant",
    "check_rope_buffers",
    "get_family",
    "get_variant",
    "official_rope_buffers",
    "rope_buffers",
    "variants_of",
]


@dataclass(frozen=True)
class Rule:
    """A regular expression matched against a whole key, and its replacement template (``\\1`` for a group;
    ``KEEP`` keeps the key, ``None`` drops it)."""

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
    """A family's ordered rules to the ``ls`` layout and back to the official ``gamma`` layout, the prefix
    of every key in the official training code's files (``"module."`` for CaiT, saved from DDP), and the keys of
    the buffers a layout computes from constants (ViT-5's rotary frequencies), which stay fp32 in every file."""

    name: str
    to_layerscale: tuple[Rule, ...]
    to_gamma: tuple[Rule, ...]
    official_prefix: str = ""
    computed: str = "(?!)"  # matches no key

    def cast(self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
        """``tensors`` with every floating-point one as ``dtype`` (``None``: as they are), but computed buffers."""
        keep = re.compile(self.computed).fullmatch
        return {k: v.to(dtype) if dtype and v.is_floating_point() and not keep(k) else v for k, v in tensors.items()}


#: The rule tables of every family, by name.
FAMILIES: dict[str, Family] = {}


def get_family(name: str) -> Family:
    """The family called ``name``, or :class:`~timm_layerscale.errors.RemapError`."""
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
    computed: str = "(?!)",
) -> Family:
    """Register a family whose gates live in the blocks ``blocks`` matches and whose other keys ``keep`` keeps;
    ``ls_only`` and ``gamma_only`` hold the keys one layout has and the other does not."""
    gamma, ls = rf"({blocks}\.\d+)\.gamma_([12])", rf"({blocks}\.\d+)\.ls([12])\.gamma"
    to_ls = (Rule(gamma, r"\1.ls\2.gamma"), Rule(ls, KEEP), *ls_only, *keep)
    to_gamma = (Rule(ls, r"\1.gamma_\2"), Rule(gamma, KEEP), *gamma_only, *keep)
    FAMILIES[name] = Family(name, to_ls, to_gamma, official_prefix, computed)
    return FAMILIES[name]


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

# ViT-5 (official ``models_vit5.py``): RMSNorm, QK-norm, no qkv bias, registers, and per-block rotary
# buffers the model computes: the ls layout drops them (checked first), the gamma layout gets them back.
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
    computed=_ROPE_BUFFER,
)

# DeiT-III (official ``models_v2.py``, timm's deit3_*): the same keys apart from LayerScale.
_family(
    "deit3",
    r"blocks",
    (
        Rule(r"cls_token|pos_embed", KEEP),
        Rule(r"(?:patch_embed\.proj|norm|head)" + _LINEAR, KEEP),
        Rule(r"blocks\.\d+\.(?:norm1|norm2|attn\.qkv|attn\.proj|mlp\.fc1|mlp\.fc2)" + _LINEAR, KEEP),
    ),
)


#: Matches a whole LayerScale key of either layout, giving the block and which gate (``g`` in the
#: official ``gamma_1``/``gamma_2``, ``l`` in the module layout's ``ls1.gamma``/``ls2.gamma``).
GATE_KEY = re.compile(r"(?P<block>.+?)\.(?:gamma_(?P<g>[12])|ls(?P<l>[12])\.gamma)")


#: Classifier outputs of every released model (ImageNet-1k).
DEFAULT_NUM_CLASSES = 1000
#: Where the official CaiT checkpoints are published (``+ Variant.official_file``).
CAIT_RELEASE_URL = "https://dl.fbaipublicfiles.com/deit/"
#: The Hub repository of the official ViT-5 checkpoints.
VIT5_HUB_REPO = "FengWang3211/ViT-5"


@dataclass(frozen=True)
class Variant:
    """A convertible architecture, one row of :data:`VARIANTS`: its name in timm's registry, its family, the
    timm model computing the same function from the official weights (``None``: timm has none), its
    resolution, width, depth (self-attention blocks), heads, the released LayerScale initial value
    (``None``: timm's default), patch size, and the official release's file name."""

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
        args = {
            "patch_size": self.patch_size,
            "embed_dim": self.embed_dim,
            "depth": self.depth,
            "num_heads": self.num_heads,
        }
        return {**args, "init_values": self.init_value} if self.init_value is not None else args


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


#: Every convertible architecture, in order the LayerScale CaiT models, ViT-5 and timm's DeiT-III models.
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
    """The variant called ``name`` (a pretrained tag ignored), or an ArchitectureError listing close names."""
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


#: Rotary bases of ViT-5, for the patch tokens and for the register tokens.
VIT5_ROPE_THETA = (10000.0, 100.0)
_ROPE_KEY = re.compile(r"blocks\.(\d+)\.attn\.(rope|rope_reg)\.freqs")


def rope_buffers(depth: int, head_dim: int, thetas: tuple[float, float] = VIT5_ROPE_THETA) -> dict[str, torch.Tensor]:
    """The official ViT-5 layout's persistent rotary buffers (``blocks.i.attn.rope.freqs`` and ``rope_reg.freqs``,
    fp32 ``(head_dim // 4,)`` each), which its strict loading needs and this package's model computes."""
    from .layers.rope import rope_bands

    patch, reg = (rope_bands(head_dim, theta) for theta in thetas)
    out: dict[str, torch.Tensor] = {}
    for i in range(depth):
        out[f"blocks.{i}.attn.rope.freqs"] = patch.clone()
        out[f"blocks.{i}.attn.rope_reg.freqs"] = reg.clone()
    return out


def official_rope_buffers(variant: Variant | str) -> dict[str, torch.Tensor]:
    """:func:`rope_buffers` of a ViT-5 variant (or its name)."""
    v = get_variant(variant) if isinstance(variant, str) else variant
    return rope_buffers(v.depth, v.embed_dim // v.num_heads)


def check_rope_buffers(state_dict: Mapping[str, Any], expected: Mapping[str, torch.Tensor]) -> None:
    """Raise :class:`~timm_layerscale.errors.RemapError` where a ``*.freqs`` buffer of an official ViT-5 state dict
    (absent ones are fine) differs from the computed ``expected`` one by more than ``pow``'s spread across
    builds (relative 1e-6): the checkpoint was made with other rotary settings."""
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
