"""The interface every other part reads of a family (:class:`Family`, its :class:`Layout` records, :class:`Variant`,
key :class:`Rule` s) and the registry, without I/O and without torch or timm. Each family is a module here (its
variants, its layouts with their rules and loaders, tolerance and card facts), its model in ``timm_layerscale.models``.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import hashlib
import json
import logging
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from ..errors import ArchitectureError, RemapError, option

__all__ = ["ALIAS", "LAYOUT_NAMES", "DEFAULT_NUM_CLASSES", "FAMILIES", "KEEP", "VARIANTS", "Family", "Gate"]
__all__ += ["Layout", "Proof", "Rule", "Variant", "gate_family", "get_family", "get_variant", "register"]
__all__ += ["model_holders", "state_dict_shapes", "variants_of"]

#: Classifier outputs of every released model (ImageNet-1k).
DEFAULT_NUM_CLASSES = 1000
#: The word of one release for the layout with raw ``gamma_1``/``gamma_2`` gates: :meth:`Family.alias` resolves it.
ALIAS = "gamma"
#: Every layout name ``--to`` takes, of any family, and the release word.
LAYOUT_NAMES = ("ls", "timm", "official", "transformers", ALIAS)
V = TypeVar("V")
#: Replacement that keeps a key unchanged.
KEEP = r"\g<0>"
#: The end of a linear layer's keys.
LINEAR = r"\.(?:weight|bias)"

#: A rule's value operation: ``op(replacement, tensor, key, state_dict)`` gives what the one key becomes.
Op = Callable[[str, Any, str, Mapping[str, Any]], dict[str, Any]]


class Proof(NamedTuple):
    """A value of an operation's result that is no plain tensor: a part of the source dropped (``tensor`` ``None``)
    or a tensor synthesised, with ``why`` it changes nothing (``"k third zero"``, ``"unused at inference"``)."""

    tensor: Any
    why: str


@dataclass(frozen=True)
class Rule:
    """A regular expression matched against a whole key, and its replacement template (``\\1`` for a group;
    ``KEEP`` keeps the key, ``None`` drops it). ``op``: a value operation (``Op``), whose result maps each key
    the one becomes to a tensor or a :class:`Proof`; ``state_dict`` is the source's. ``why``: a drop's proof that the
    tensor is inert, a sentence, or ``why(key, tensor, state_dict)`` checking its values and giving the sentence
    (raising :class:`~timm_layerscale.errors.RemapError` where it is not inert)."""

    pattern: str
    replace: str | None
    op: Op | None = None
    why: str | Callable[[str, Any, Mapping[str, Any]], str] = ""


@dataclass(frozen=True)
class Gate:
    """One LayerScale gate of a family's blocks.

    Attributes:
        name: The module that holds it in the ``ls`` layout, in its block (``ls1``: the parameter ``ls1.gamma``).
        branch: What it scales, in words (``"attention"``): the gate table's and the plot's label.
        raw: Its parameter's name in its block, by layout, where a layout holds it bare (no ``.gamma``).
        fold: The layer of its block that it folds into (a weight whose first axis is the gate's channels).
        no_fold: Why it cannot fold (``fold`` empty), one sentence.
        blocks: The blocks that hold this gate, a pattern of their paths (default: every block of the family).
    """

    name: str
    branch: str
    raw: Mapping[str, str]
    fold: str = ""
    no_fold: str = ""
    blocks: str = ".+"


#: ``native(variant, folded, args)``: ``(build, filter)``, the builder of the model reading a layout (``folded``:
#: without gates) and the filter its loading passes a state dict through, ``filter(state_dict, model)``.
Native = Callable[["Variant", bool, dict[str, Any]], Any]


@dataclass(frozen=True, eq=False)
class Layout:
    """One layout of a family's files, as one consumer reads them.

    Attributes:
        name: ``"ls"`` (this package's modules), ``"timm"`` (the state dict of timm's own model), ``"official"``
            (the authors' release file) or ``"transformers"`` (a folder transformers' ``AutoModel`` loads).
        read: The ordered rules from this layout to the ``ls`` layout.
        write: The rules from the ``ls`` layout to this one; empty: read, never written.
        native: The loader of its consumer (``Native``): the model that reads such a file, and its filter.
        tell: A source with a key matching this is in this layout (else the first whose rules cover its keys).
        library: Its consumer is another library's implementation: outputs within a bound, not equal.
        wrapper, prefix: Its container: a file's state dict under ``{wrapper: ...}``, every key with ``prefix``.
        buffers: ``buffers(variant)``: what its files store that the ``ls`` layout does not hold.
        optional_zero: Keys (``ls`` layout) a variant may lack where they are zero: its model computes the same.
        config: ``config(variant, shapes)``: transformers' config of a variant from its ``ls``-layout shapes.
    """

    name: str
    read: tuple[Rule, ...]
    write: tuple[Rule, ...] = ()
    native: Native | None = None
    tell: str = "(?!)"
    library: bool = False
    wrapper: str | None = None
    prefix: str = ""
    buffers: Callable[[Variant], dict[str, Any]] | None = None
    optional_zero: str = "(?!)"
    config: Callable[[Variant, Mapping[str, tuple[int, ...]]], Any] | None = None

    def computed(self, variant: Variant) -> set[str]:
        """The keys of the buffers this layout's files store that the model computes from constants (never cast;
        those its ``buffers`` give as a :class:`Proof` are tensors it synthesises, cast as the rest)."""
        buffers = self.buffers(variant) if self.buffers else {}
        return {k for k, v in buffers.items() if not isinstance(v, Proof)}

    def wrap(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        """``state_dict`` in this layout's container, as its consumer's code saves it."""
        keys = {self.prefix + k: v for k, v in state_dict.items()}
        return {self.wrapper: keys} if self.wrapper else keys

    @property
    def container(self) -> str:
        """The container in words, such as ``"{'model': {'module.' + key: tensor}}"``, or ``"state dict"``."""
        inner = f"{{{self.prefix!r} + key: tensor}}" if self.prefix else "state dict"
        return f"{{{self.wrapper!r}: {inner}}}" if self.wrapper else inner


@dataclass(frozen=True, eq=False)
class Family:
    """What the shared code knows of a family: its names, its layouts (``ls`` first; where timm's own model already
    holds LayerScale modules, ``timm`` is the ``ls`` record itself), and the facts of its tolerance and model card."""

    name: str  # "cait"
    title: str  # "CaiT"
    layouts: Mapping[str, Layout]
    exact: bool = True  # the converted model makes the reference's kernel calls: outputs torch.equal
    tokens: bool = False  # verification compares forward_features' tokens (a pooled output would hide some)
    extra_blocks: int = 0  # blocks beyond a variant's depth (CaiT's class attention), which the bounds count
    full_title: str = ""  # the card's title of the model (default: title)
    description: str = "a Vision Transformer with LayerScale"
    bibtex: str | None = None
    license: str | None = None
    gamma_file: str = "official"  # the layout the release word ALIAS named for a .pth file
    blocks: str = "(?!)"  # the path of a block that holds gates, a pattern ending in its number
    gates: tuple[Gate, ...] = ()
    class_stage: str = "(?!)"  # the path of the class-attention stage (whose blocks come last)
    stem: str = ""  # the ls layout's patch embedding weight: the width on its first axis, the patch on its last
    positions: str = ""  # the ls layout's learned position embedding (1, tokens, width): the grid it was trained at
    head: str = ""  # the ls layout's classifier, its keys without ".weight"/".bias"
    tower: str = ""  # where a multimodal checkpoint holds the model beside its other parts (a key prefix's end)

    def layout(self, name: str, written: bool = False) -> Layout:
        """The layout called ``name`` (one this family ``written``: writes; :data:`ALIAS`: the one it names for a
        ``.pth``), or a one-line :class:`~timm_layerscale.errors.RemapError` naming those it has."""
        name = self.alias("pth") if name == ALIAS else name
        have = self.targets() if written else list(self.layouts)
        if name not in have:
            raise RemapError(
                f"{self.title} has no layout {name!r}{' to write' * written}; its layouts: {', '.join(have)}"
            )
        return self.layouts[name]

    def targets(self) -> list[str]:
        """The names of the layouts this family writes."""
        return [name for name, layout in self.layouts.items() if layout.write]

    def alias(self, fmt: str, wrapped: bool = True) -> str:
        """The layout :data:`ALIAS` names for an output of format ``fmt``: ``gamma_file`` for a ``.pth`` file
        (``wrapped``: in its container), else ``timm``.

        Raises:
            RemapError: The family has no such layout (ViT-5 has no timm layout); the message says what to write.
        """
        name = self.gamma_file if fmt == "pth" and wrapped else "timm"
        if name not in self.layouts:
            raise RemapError(
                f"{self.title} has no {name} layout to write as {ALIAS!r}; pass {option('to', 'official')} and a .pth output"
            )
        return name

    def gate_of(self, key: str) -> tuple[str, Gate, bool] | None:
        """The block, the gate and whether it is raw (no ``.gamma``) of a key holding one of this family's gates in
        a layout whose gates sit in the blocks (``blocks.3.gamma_1``: ``("blocks.3", ls1, True)``); else ``None``."""
        m = re.fullmatch(rf"({self.blocks})\.(.+)", key)
        if m is None:
            return None
        block, name = m.groups()
        for gate in self.gates:
            if name in (f"{gate.name}.gamma", *gate.raw.values()) and re.fullmatch(gate.blocks, block):
                return block, gate, name != f"{gate.name}.gamma"
        return None

    def gates_in(self, tensors: Mapping[str, V]) -> tuple[dict[tuple[str, str], V], bool]:
        """This family's gates among ``tensors`` by block and gate name (``("blocks.3", "ls1")``), and whether they
        are raw parameters (``blocks.3.gamma_1``) rather than LayerScale modules (``blocks.3.ls1.gamma``).

        Raises:
            RemapError: Both kinds are present.
        """
        found = {key: gate for key in tensors if (gate := self.gate_of(key))}
        kinds = {raw: key for key, (_, _, raw) in found.items()}
        if len(kinds) > 1:
            raise RemapError(
                f"checkpoint mixes raw gates ({kinds[True]}) and LayerScale modules ({kinds[False]}); "
                "it is not a layout this tool knows"
            )
        return {(block, gate.name): tensors[key] for key, (block, gate, _) in found.items()}, True in kinds

    def source_layouts(self) -> list[Layout]:
        """Each layout once, in the order a source whose keys match no ``tell`` is matched against them: those without
        a ``tell`` first (a file lacking the key that tells a layout is more likely another's)."""
        unique = list({id(v): v for v in self.layouts.values()}.values())
        return sorted(unique, key=lambda layout: layout.tell != "(?!)")


@dataclass(frozen=True)
class Variant:
    """A convertible architecture, one row of :data:`VARIANTS`: its name in timm's registry, its :class:`Family`,
    the timm model computing the same function from the official weights (``None``: timm has none), its
    resolution, width, depth (self-attention blocks), heads, the released LayerScale initial value
    (``None``: timm's default), patch size, the official release's file name and the model's other arguments."""

    name: str
    family: Family
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


#: Every family, by name, in registration order.
FAMILIES: dict[str, Family] = {}
#: Every convertible architecture, family by family in registration order.
VARIANTS: tuple[Variant, ...] = ()


def register(family: Family, variants: tuple[Variant, ...]) -> None:
    """Add a family and its variants to the registry."""
    global VARIANTS
    FAMILIES[family.name], VARIANTS = family, (*VARIANTS, *variants)


def model_holders(keys: Iterable[str]) -> list[str]:
    """The names of the modules holding a model among ``keys``: the prefixes of a family's patch embedding weight
    (``'model.'`` where ``model.`` comes before it)."""
    stems = {family.stem for family in FAMILIES.values() if family.stem}
    return sorted(k.removesuffix(stem) for k in keys for stem in stems if k.endswith(f".{stem}"))


def state_dict_shapes(
    variant: Variant, num_classes: int | None = None, img_size: int | None = None
) -> dict[str, tuple[int, ...]]:
    """Keys and shapes of the state dict of ``variant``'s registered model (the ``ls`` layout) with ``num_classes``
    outputs (default 1000, 0: none) at ``img_size`` (default the variant's), built on the meta device once and kept
    in a shape table on disk (``shape_table()``), so that a conversion without verification imports no timm."""
    return dict(_shapes(variant, num_classes, img_size))


def shape_table() -> Path:
    """The shape table's file: one per version of this package's source (its files' sizes and times), timm and
    torch, in ``$TIMM_LAYERSCALE_CACHE`` (default ``~/.cache/timm-layerscale``); a table that cannot be read or
    written is rebuilt or skipped, never trusted half."""
    from importlib.metadata import version

    files = [(f, f.stat()) for f in sorted(Path(__file__).parents[1].rglob("*.py"))]
    stamp = "\n".join([*(f"{f}:{s.st_size}:{s.st_mtime_ns}" for f, s in files), version("timm"), version("torch")])
    root = os.environ.get("TIMM_LAYERSCALE_CACHE") or os.path.expanduser("~/.cache/timm-layerscale")
    return Path(root) / f"shapes-{hashlib.sha256(stamp.encode()).hexdigest()[:16]}.json"


def _valid_entry(entry: Any) -> bool:
    """Whether a table entry is a mapping of key to a shape (a list of whole numbers)."""
    return isinstance(entry, dict) and all(
        isinstance(s, list) and all(type(n) is int for n in s) for s in entry.values()
    )


def _read_table(path: Path) -> dict[str, Any]:
    """The shape table at ``path``; empty (to be rebuilt) where it is missing, unreadable or of another shape."""
    try:
        table = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        table = None
    if isinstance(table, dict) and all(_valid_entry(e) for e in table.values()):
        return table
    if path.exists():
        logging.getLogger(__name__).debug("shape table %s is not a table of shapes; rebuilding it", path)
    return {}


@functools.lru_cache(maxsize=256)
def _shapes(variant: Variant, num_classes: int | None, img_size: int | None) -> dict[str, tuple[int, ...]]:
    path, key = shape_table(), f"{variant.name}/{num_classes}/{img_size}"
    if key in (table := _read_table(path)):
        return {k: tuple(s) for k, s in table[key].items()}
    import timm
    import torch

    args: dict[str, Any] = {k: v for k, v in (("num_classes", num_classes), ("img_size", img_size)) if v is not None}
    with torch.device("meta"):
        model = timm.create_model(variant.name, **args)
    shapes = {k: tuple(t.shape) for k, t in model.state_dict().items()}
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:  # written whole under another name, then renamed: a reader sees the old table or the new one
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({**_read_table(path), key: shapes}))
        os.replace(tmp, path)
    except OSError:  # a read-only cache, or a folder in the table's place: the shapes are built in each process
        with contextlib.suppress(OSError):
            tmp.unlink()
    return shapes


def get_family(name: str | Family) -> Family:
    """The family called ``name`` (a :class:`Family` itself), or :class:`~timm_layerscale.errors.RemapError`."""
    if isinstance(name, Family):
        return name
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
    return {v.name: v for v in VARIANTS if v.family.name == family}


def gate_rules(
    blocks: str, gates: tuple[Gate, ...], keep: tuple[Rule, ...], layout: str = "timm"
) -> tuple[tuple[Rule, ...], tuple[Rule, ...], tuple[Rule, ...]]:
    """The rules of a family whose ``gates`` live in the ``blocks`` (a pattern of their paths) and whose other keys
    ``keep`` keeps: reading the ``ls`` layout (as it is), reading ``layout``'s raw gates into it, and writing them
    back."""
    ls = tuple(Rule(rf"({blocks})\.{gate.name}\.gamma", KEEP) for gate in gates)
    read = tuple(Rule(rf"({blocks})\.{gate.raw[layout]}", rf"\1.{gate.name}.gamma") for gate in gates)
    write = tuple(Rule(rf"({blocks})\.{gate.name}\.gamma", rf"\1.{gate.raw[layout]}") for gate in gates)
    return (*ls, *keep), (*read, *keep), (*write, *keep)


def gate_family(keys: Iterable[str]) -> Family | None:
    """The family whose gates the most of ``keys`` hold (the first registered of those alike), or ``None``."""
    keys = list(keys)
    counts = {family: sum(family.gate_of(k) is not None for k in keys) for family in FAMILIES.values()}
    best = max(counts, key=counts.__getitem__)
    return best if counts[best] else None


from . import cait, vit5, deit3, dinov3, dinov2, convnext, beit, resmlp, xcit, internvit, pe  # noqa: E402, F401, I001  (the registry: each registers its family)
