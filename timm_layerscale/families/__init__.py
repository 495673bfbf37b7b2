"""The interface every other part reads of a family (:class:`Family`, :class:`Variant`, key :class:`Rule` s), and
the registry, without I/O and without torch or timm. Each family is a module here (its variants, key rules, the
loaders of its layouts, tolerance and card facts), its model beside it in ``timm_layerscale.models``."""

from __future__ import annotations

import difflib
import functools
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ArchitectureError, RemapError

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_NUM_CLASSES",
    "FAMILIES",
    "GATE_KEY",
    "KEEP",
    "LAYOUTS",
    "VARIANTS",
    "Family",
    "Rule",
    "Variant",
    "register",
]
__all__ += [
    "get_family",
    "get_variant",
    "state_dict_shapes",
    "variants_of",
    "CAIT_RELEASE_URL",
    "VIT5_HUB_REPO",
    "official_rope_buffers",
]
__all__ += ["check_rope_buffers", "rope_buffers"]

#: Classifier outputs of every released model (ImageNet-1k).
DEFAULT_NUM_CLASSES = 1000
#: Matches a whole LayerScale key of either layout, giving the block and which gate (``g`` in the
#: official ``gamma_1``/``gamma_2``, ``l`` in the module layout's ``ls1.gamma``/``ls2.gamma``).
GATE_KEY = re.compile(r"(?P<block>.+?)\.(?:gamma_(?P<g>[12])|ls(?P<l>[12])\.gamma)")
#: Replacement that keeps a key unchanged.
KEEP = r"\g<0>"
#: The end of a linear layer's keys.
LINEAR = r"\.(?:weight|bias)"


@dataclass(frozen=True)
class Rule:
    """A regular expression matched against a whole key, and its replacement template (``\\1`` for a group;
    ``KEEP`` keeps the key, ``None`` drops it); with ``op``, a value operation: ``op(replacement, tensor, key,
    state_dict)`` gives the keys and tensors the one key becomes (a fused projection split, three fused, or nothing
    where another key's operation takes it), ``state_dict`` being the source's."""

    pattern: str
    replace: str | None
    op: Callable[[str, Any, str, Mapping[str, Any]], dict[str, Any]] | None = None

    def apply(self, key: str) -> tuple[bool, str | None]:
        m = re.fullmatch(self.pattern, key)
        if m is None:
            return False, None
        if self.replace is None:
            return True, None
        return True, m.expand(self.replace)


def layerscale_rules(
    blocks: str, keep: tuple[Rule, ...], ls_only: tuple[Rule, ...] = (), gamma_only: tuple[Rule, ...] = ()
) -> tuple[tuple[Rule, ...], tuple[Rule, ...]]:
    """The rules to the ``ls`` layout and back of a family whose gates live in the ``blocks`` and whose other keys
    ``keep`` keeps; ``ls_only`` and ``gamma_only``: the keys one layout alone has."""
    gamma, ls = rf"({blocks}\.\d+)\.gamma_([12])", rf"({blocks}\.\d+)\.ls([12])\.gamma"
    to_ls = (Rule(gamma, r"\1.ls\2.gamma"), Rule(ls, KEEP), *ls_only, *keep)
    return to_ls, (Rule(ls, r"\1.gamma_\2"), Rule(gamma, KEEP), *gamma_only, *keep)


@dataclass(frozen=True)
class Family:
    """What the shared code knows of a family: its names, key rules both ways, the loaders of its layouts, the facts of
    its tolerance and of its model card."""

    name: str  # "cait"
    title: str  # "CaiT"
    to_layerscale: tuple[Rule, ...]  # the ordered rules to the ls layout
    to_gamma: tuple[Rule, ...]  # and back to the official gamma layout
    # native(variant, layout, folded, timm_kwargs): (build, filter), the builder of the model reading ``layout``
    # (folded: without gates) and the filter its code passes a state dict through, filter(state_dict, model)
    native: Callable[[Variant, str, bool, dict[str, Any]], Any]
    # (layout, pattern): a source with a key matching the pattern is in that layout (its rules are in to_layerscale)
    source_layouts: tuple[tuple[str, str], ...] = ()
    targets: tuple[tuple[str, tuple[Rule, ...]], ...] = ()  # (layout, rules from the ls layout) beyond ls and gamma
    independent: tuple[str, ...] = ()  # layouts whose native model is another implementation: bounds, not equality
    # transformers_config(variant, shapes): transformers' config of a variant from its ls-layout shapes, if it has one
    transformers_config: Callable[[Variant, Mapping[str, tuple[int, ...]]], Any] | None = None
    official_prefix: str = ""  # of every key in the official training code's files (CaiT's "module.", from DDP)
    computed: str = "(?!)"  # keys of buffers a layout computes from constants (fp32 in every file); none
    optional_zero: str = "(?!)"  # keys (ls layout) a variant may lack where they are zero: its model computes the same
    # the official layout's computed buffers of a variant, checked against those ``tensors`` hold
    official_buffers: Callable[[Variant, Mapping[str, Any]], dict[str, torch.Tensor]] = lambda variant, tensors: {}
    official_layout: str = "gamma"  # the layout official_buffers are written into
    exact: bool = True  # the converted model makes the reference's kernel calls: outputs torch.equal
    tokens: bool = False  # verification compares forward_features' tokens (a pooled output would hide some)
    extra_blocks: int = 0  # blocks beyond a variant's depth (CaiT's class attention), which the bounds count
    full_title: str = ""  # the card's: what the model is, the paper, key renames beyond gamma_1/gamma_2, licence
    description: str = "a Vision Transformer with LayerScale"
    bibtex: str | None = None
    layout_rows: tuple[tuple[str, str, str], ...] = ()
    license: str | None = None

    def layout_of(self, keys: Iterable[str], gates: str) -> str:
        """The layout of a source with these ``keys``: the first of ``source_layouts`` one matches, else ``gates``
        (``"gamma"`` or ``"ls"``, told by its LayerScale keys)."""
        keys = list(keys)
        return next((name for name, p in self.source_layouts if any(re.fullmatch(p, k) for k in keys)), gates)

    def rules(self, to: str) -> tuple[Rule, ...]:
        """The rules to layout ``to`` (from the ``ls`` layout for one of ``targets``)."""
        table = {"ls": self.to_layerscale, "gamma": self.to_gamma, **dict(self.targets)}
        if to not in table:
            layouts = ", ".join(table)
            raise RemapError(f"{self.title} has no layout {to!r}; its layouts: {layouts}")
        return table[to]

    def cast(self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
        """``tensors`` with every floating-point one as ``dtype`` (``None``: as they are), but computed buffers."""
        keep = re.compile(self.computed).fullmatch
        return {k: v.to(dtype) if dtype and v.is_floating_point() and not keep(k) else v for k, v in tensors.items()}


@dataclass(frozen=True)
class Variant:
    """A convertible architecture, one row of :data:`VARIANTS`: its name in timm's registry, its family, the
    timm model computing the same function from the official weights (``None``: timm has none), its
    resolution, width, depth (self-attention blocks), heads, the released LayerScale initial value
    (``None``: timm's default), patch size, the official release's file name and the model's other arguments."""

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
    args: tuple[tuple[str, Any], ...] = ()

    @property
    def model_args(self) -> dict[str, Any]:
        """The keyword arguments the model file builds this variant with."""
        args = dict(patch_size=self.patch_size, embed_dim=self.embed_dim, depth=self.depth, num_heads=self.num_heads)
        args.update(self.args)
        return {**args, "init_values": self.init_value} if self.init_value is not None else args


#: Every target layout (each family takes ``ls``, ``gamma`` and those of its ``targets``).
LAYOUTS = ("ls", "gamma", "official", "transformers")
#: Every family, by name, in registration order.
FAMILIES: dict[str, Family] = {}
#: Every convertible architecture, family by family in registration order.
VARIANTS: tuple[Variant, ...] = ()


def register(family: Family, variants: tuple[Variant, ...]) -> None:
    """Add a family and its variants to the registry."""
    global VARIANTS
    FAMILIES[family.name], VARIANTS = family, (*VARIANTS, *variants)


def own_model(variant: Variant, folded: bool, args: dict[str, Any]) -> Any:
    """The ``native`` loader of this package's own layout: its registered model, read strictly."""
    import timm

    kwargs = {**args, **({"folded_layerscale": True} if folded else {})}
    return lambda: timm.create_model(variant.name, **kwargs), lambda sd, model: sd


def state_dict_shapes(
    variant: Variant, num_classes: int | None = None, img_size: int | None = None
) -> dict[str, tuple[int, ...]]:
    """Keys and shapes of the state dict of ``variant``'s registered model (the ``ls`` layout) with ``num_classes``
    outputs (default 1000, 0: none) at ``img_size`` (default the variant's), built on the meta device."""
    return dict(_shapes(variant, num_classes, img_size))


@functools.lru_cache(maxsize=256)
def _shapes(variant: Variant, num_classes: int | None, img_size: int | None) -> dict[str, tuple[int, ...]]:
    import timm
    import torch

    args: dict[str, Any] = {k: v for k, v in (("num_classes", num_classes), ("img_size", img_size)) if v is not None}
    with torch.device("meta"):
        model = timm.create_model(variant.name, **args)
    return {k: tuple(t.shape) for k, t in model.state_dict().items()}


def get_family(name: str) -> Family:
    """The family called ``name``, or :class:`~timm_layerscale.errors.RemapError`."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise RemapError(f"unknown model family {name!r}; choose one of: {', '.join(sorted(FAMILIES))}") from None


def get_variant(name: str) -> Variant:
    """The variant called ``name`` (a pretrained tag ignored), or an ArchitectureError listing close names."""
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


from . import cait, vit5, deit3, dinov3, dinov2  # noqa: E402, F401, I001  (the registry: each registers its family)
from .cait import RELEASE_URL as CAIT_RELEASE_URL  # noqa: E402  (where these names were)
from .vit5 import HUB_REPO as VIT5_HUB_REPO, check_rope_buffers, official_rope_buffers, rope_buffers  # noqa: E402
