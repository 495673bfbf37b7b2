"""The rule engine: a state dict read from one of its family's layouts (:class:`~timm_layerscale.families.Layout`)
into the ``ls`` layout and written into another, by the layouts' ordered rules. No I/O; tensors pass through
unchanged (the same objects, or views where a rule's value operation splits one), so a memory-mapped checkpoint stays
unread but where an operation checks values.

A key is matched against the rules in order; the first match renames, keeps or drops it (a drop with its proof that
the tensor is inert), and a key no rule matches is an error that names it. A conversion's tensors
(:func:`target_tensors`) are a source's read into the ``ls`` layout (zero optional biases left out, gates folded where
asked) and written into the target layout with the buffers its consumer stores.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Container, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from .. import families
from ..errors import RemapError
from ..families import KEEP, Family, Layout, Proof, Rule, Variant, get_family, state_dict_shapes
from .checkpoint import strip_prefixes

if TYPE_CHECKING:
    import torch

__all__ = ["Cast", "Change", "UncoveredKeys", "cast_tensors", "check_floating", "check_state_dict", "describe_changes"]
__all__ += ["mismatches", "target_tensors", "without_zero_optional"]
__all__ += ["read_layout", "remap", "renamed_keys", "to_gamma", "to_layerscale", "to_layout"]

V = TypeVar("V")
#: What a conversion did to one source key, ``(source key, key it became ('': dropped), how)``, ``how`` being ``''``
#: (renamed or kept), a value operation's name, or a drop's or a synthesised tensor's proof.
Change = tuple[str, str, str]


class UncoveredKeys(RemapError):
    """Keys of a state dict that no rule of a layout covers: the state dict is not in that layout."""

    def __init__(self, message: str, count: int = 0) -> None:
        super().__init__(message)
        self.count = count


def remap(
    state_dict: Mapping[str, V], rules: Sequence[Rule], what: str, changes: list[Change] | None = None
) -> dict[str, V]:
    """``state_dict`` (prefix-free) mapped by ``rules``; ``what`` names the layout in errors, ``changes`` gets what
    each key became (:data:`Change`).

    Raises:
        UncoveredKeys: Keys no rule covers (before any value is read).
        RemapError: Keys that collide, or a drop or operation whose tensor is not inert.
    """
    matched: list[tuple[str, V, Rule, str | None]] = []
    unknown: list[str] = []
    for key, value in state_dict.items():
        rule = next((r for r in rules if _anchored(r.pattern).match(key)), None)
        if rule is None:
            unknown.append(key)
        elif rule.replace is None or rule.replace == KEEP:
            matched.append((key, value, rule, None if rule.replace is None else key))
        else:  # re caches the parsed template, Match.expand does not
            matched.append((key, value, rule, _anchored(rule.pattern).sub(rule.replace, key, count=1)))
    if unknown:  # before any operation checks a value: a state dict of another layout is no error of its values
        shown = ", ".join(unknown[:5]) + (", ..." if len(unknown) > 5 else "")
        raise UncoveredKeys(
            f"{len(unknown)} key(s) are not part of a {what} checkpoint: {shown}; "
            "check that the file is a checkpoint of this model family",
            len(unknown),
        )
    out: dict[str, V] = {}
    for key, value, rule, new_key in matched:
        if new_key is None:
            why = rule.why(key, value, state_dict) if callable(rule.why) else rule.why
            if changes is not None:
                changes.append((key, "", why))
            continue
        result = rule.op(new_key, value, key, state_dict) if rule.op else {new_key: value}
        kept = [t for t in result.values() if not isinstance(t, Proof)]  # besides the parts dropped or synthesised
        changed = rule.op is not None and not (len(kept) == 1 and kept[0] is value)
        for name, tensor in result.items():
            if isinstance(tensor, Proof):  # a part dropped, or a tensor synthesised, with its proof
                gone = tensor.tensor is None
                if changes is not None:
                    changes.append((name, "", tensor.why) if gone else (key, name, f"synthesised, {tensor.why}"))
                if gone:
                    continue
                tensor = tensor.tensor
            elif changes is not None:
                changes.append((key, name, rule.op.__name__ if changed and rule.op else ""))
            if name in out:
                raise RemapError(f"keys collide on {name!r} in a {what} checkpoint")
            out[name] = tensor
    return out


@functools.cache
def _anchored(pattern: str) -> re.Pattern[str]:
    return re.compile(rf"(?:{pattern})\Z")


def read_layout(
    state_dict: Mapping[str, V],
    family: Family,
    container: tuple[str | None, str] | None = None,
    changes: list[Change] | None = None,
) -> tuple[Layout, dict[str, V]]:
    """The layout of a prefix-free state dict and its tensors in the ``ls`` layout: the layouts whose ``tell`` one of
    its keys matches, else every layout in :meth:`~timm_layerscale.families.Family.source_layouts`' order (timm's
    DINOv2 state dict is the authors' without ``mask_token``); of those whose rules cover every key, the one whose
    container is ``container`` (``(wrapper, prefix)`` of the file), else the first.

    Raises:
        UncoveredKeys: No layout's rules cover the keys; the error of the closest.
        RemapError: A covering layout's rule finds a tensor it drops not inert, or keys collide.
    """
    layouts = family.source_layouts()
    told = [layout for layout in layouts if any(re.fullmatch(layout.tell, k) for k in state_dict)]
    found: list[tuple[Layout, dict[str, V], list[Change]]] = []
    errors: list[tuple[int, bool, UncoveredKeys]] = []
    for layout in told or layouts:
        record: list[Change] = []
        try:
            found.append(
                (layout, remap(state_dict, layout.read, f"{family.title} ({layout.name} layout)", record), record)
            )
        except UncoveredKeys as e:
            errors.append((e.count, (layout.wrapper, layout.prefix) != container, e))
    family.gates_in(state_dict)  # both kinds of gate: no layout
    if not found:  # the closest layout's error, of those in the file's container first
        raise min(errors, key=lambda e: e[:2])[2]
    exact = [f for f in found if container is not None and (f[0].wrapper, f[0].prefix) == container]
    layout, out, record = (exact or found)[0]
    if changes is not None:
        changes.extend(record)
    return layout, out


def to_layerscale(
    state_dict: Mapping[str, V], family: str | Family, changes: list[Change] | None = None
) -> dict[str, V]:
    """A state dict in any layout of its family (prefixes stripped here, wrappers already removed) in the ``ls``
    layout, the same tensors in source order; idempotent. ``changes`` gets what each source key became.

    Raises:
        RemapError: No layout of the family covers the keys, or keys collide.
    """
    return read_layout(strip_prefixes(state_dict), get_family(family), changes=changes)[1]


def to_layout(
    state_dict: Mapping[str, V], family: str | Family, layout: str, changes: list[Change] | None = None
) -> dict[str, V]:
    """An ``ls``-layout state dict in its family's ``layout`` (one the family writes), by that layout's rules.

    Raises:
        RemapError: The family does not write that layout, a key is not covered by its rules, or keys collide.
    """
    fam = get_family(family)
    return remap(state_dict, fam.layout(layout, written=True).write, f"{fam.title} ({layout} layout)", changes)


def to_gamma(state_dict: Mapping[str, V], family: str | Family) -> dict[str, V]:
    """A state dict of any layout in the one ``gamma`` names for a ``.pth`` file (:meth:`~timm_layerscale.families.Family.alias`: the official
    file's keys, timm's for DINOv3), without its container; ``to_gamma(to_layerscale(sd)) == sd`` for such keys.

    Raises:
        RemapError: A key is not covered by the family's rules, or keys collide.
    """
    fam = get_family(family)
    return to_layout(to_layerscale(state_dict, fam), fam, fam.alias("pth"))


def describe_changes(changes: Iterable[Change]) -> str:
    """What a conversion dropped, took apart or synthesised, with each proof (renames and kept keys left out), block
    numbers as ``N`` with a count (``'mask_token (unused at inference), blocks.N.attn.qkv.bias (split_qkv_bias) x12'``),
    ``''`` for nothing."""
    seen = {(key, new if how.startswith("synthesised") else "", how) for key, new, how in changes if how}
    found: dict[str, int] = {}
    for key, new, how in seen:
        name = re.sub(r"\.\d+\.", ".N.", new or key) + f" ({how})"
        found[name] = found.get(name, 0) + 1
    return ", ".join(f"{k} x{n}" if n > 1 else k for k, n in sorted(found.items()))


def renamed_keys(read: Iterable[Change], write: Iterable[Change] = ()) -> list[tuple[str, str]]:
    """The source keys whose names a conversion changed, with the names written (``read`` then ``write`` changes
    composed through the ``ls`` layout), block numbers as ``N``, each pair once, in source order."""
    written: dict[str, list[str]] = {}
    for key, new, _ in write:
        if new:
            written.setdefault(key, []).append(new)
    pairs: dict[tuple[str, str], None] = {}
    for key, new, _ in read:
        for name in written.get(new, [new]) if new else []:
            if name != key:
                pairs[(re.sub(r"\.\d+\.", ".N.", key), re.sub(r"\.\d+\.", ".N.", name))] = None
    return list(pairs)


def _shape(t: Any) -> list[int]:
    return list(t) if isinstance(t, (tuple, list)) else list(getattr(t, "shape", []))


def mismatches(state_dict: Mapping[str, Any], expected: Mapping[str, Any], limit: int = 5) -> tuple[int, str]:
    """How many keys of ``state_dict`` are missing, unexpected or mis-shaped against ``expected``
    (keys to tensors or shapes), and the first ``limit`` of each kind with their shapes."""
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    common = [k for k in expected if k in state_dict]
    misshaped = [k for k in common if _shape(state_dict[k]) != _shape(expected[k])]
    parts = []
    for what, keys, show in (
        ("missing", missing, lambda k: f"{k} {_shape(expected[k])}"),
        ("unexpected", unexpected, lambda k: f"{k} {_shape(state_dict[k])}"),
        ("mis-shaped", misshaped, lambda k: f"{k} {_shape(state_dict[k])} != {_shape(expected[k])}"),
    ):
        if keys:
            parts.append(
                f"{len(keys)} {what} ({', '.join(map(show, keys[:limit]))}{', ...' if len(keys) > limit else ''})"
            )
    return len(missing) + len(unexpected) + len(misshaped), "; ".join(parts)


def check_state_dict(state_dict: Mapping[str, Any], expected: Mapping[str, Any], what: str = "model") -> None:
    """Raise :class:`~timm_layerscale.errors.RemapError` listing :func:`mismatches` unless there are none."""
    count, detail = mismatches(state_dict, expected)
    if count:
        raise RemapError(f"checkpoint does not fit {what}: {detail}")


def check_floating(state_dict: Mapping[str, Any], what: str = "model", limit: int = 5) -> None:
    """Raise :class:`~timm_layerscale.errors.RemapError` naming the tensors that are not floating point, as every
    weight and buffer of these models is but a scalar counter (a batch norm's ``num_batches_tracked``)."""
    bad = [(k, v.dtype) for k, v in state_dict.items() if not v.is_floating_point() and v.ndim]
    if bad:
        shown = ", ".join(f"{k} is {str(dtype).removeprefix('torch.')}" for k, dtype in bad[:limit])
        raise RemapError(
            f"checkpoint does not fit {what}: {len(bad)} tensor(s) not floating point ({shown}"
            f"{', ...' if len(bad) > limit else ''}); every weight must be float32, bfloat16 or float16, "
            "check how the file was written"
        )


def target_tensors(
    tensors: Mapping[str, torch.Tensor],
    variant: Variant,
    source: Layout,
    to: Layout,
    fold: bool = False,
    dtype: torch.dtype | None = None,
    changes: list[Change] | None = None,
    written: list[Change] | None = None,
) -> dict[str, torch.Tensor]:
    """A source's tensors (in their ``source`` layout) mapped by the rules to layout ``to`` (folded with ``fold``, the
    folds rounded once to ``dtype``), with the buffers ``to`` stores; ``changes`` gets what reading became of each
    source key, ``written`` (default ``changes``) what writing made of each ``ls`` key. A layout written to itself
    keeps the source's stored values of what the rules drop and synthesise (rotary periods, masks, tokens: its
    consumer sees the same numbers), those that differ from what the rules would write recorded as
    ``"kept as stored"``."""
    family, written = variant.family, changes if written is None else written
    read: list[Change] = []
    ls = remap(tensors, source.read, f"{family.title} ({source.name} layout)", read)
    ls = without_zero_optional(ls, family, state_dict_shapes(variant), variant.name, read)
    if to is family.layouts["ls"]:
        if changes is not None:
            changes.extend(read)
        from .fold import fold_gates  # torch: not on importing the package

        return fold_gates(ls, family, dtype) if fold else ls
    made: list[Change] = []
    out = remap(ls, to.write, f"{family.title} ({to.name} layout)", made)
    for key, value in (to.buffers(variant) if to.buffers else {}).items():  # what its consumer stores besides
        proof = value if isinstance(value, Proof) else Proof(value, "computed")
        out[key] = proof.tensor
        made.append((key, key, f"synthesised, {proof.why}"))
    if to is source:  # to itself: each key kept holds its stored value; only what is left out is said
        stored = {k: tensors[k] for k, t in out.items() if k in tensors and t is not tensors[k]}
        made = [(k, k, "kept as stored") for k, t in stored.items() if t.dtype != out[k].dtype or not t.equal(out[k])]
        read = [c for c in read if not c[1] and c[0].split("[")[0] not in out]  # a training head, say
        out.update(stored)
    if changes is not None:
        changes.extend(read)
    if written is not None:
        written.extend(made)
    return out


def cast_tensors(
    tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None, keep: set[str]
) -> Mapping[str, torch.Tensor]:
    """``tensors`` with every floating-point one but those in ``keep`` (computed buffers, fp32 in every file) as
    ``dtype`` (``None``: ``tensors`` themselves). Each tensor is cast as it is read and not kept, so that a model's
    worth of cast copies never exists at once (verification one block at a time reads a block's and frees them)."""
    return tensors if dtype is None else Cast(tensors, dtype, keep)


class Cast(Mapping[str, "torch.Tensor"]):
    """The view :func:`cast_tensors` returns: ``tensors``' keys, each value cast as it is read."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype, keep: set[str]) -> None:
        self.tensors, self.dtype, self.keep = tensors, dtype, keep

    def __getitem__(self, key: str) -> torch.Tensor:
        tensor = self.tensors[key]
        return tensor.to(self.dtype) if tensor.is_floating_point() and key not in self.keep else tensor

    def __contains__(self, key: object) -> bool:  # Mapping's would read (cast) the tensor
        return key in self.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


def without_zero_optional(
    state_dict: Mapping[str, Any],
    family: Family,
    expected: Container[str],
    name: str,
    changes: list[Change] | None = None,
) -> dict[str, Any]:
    """An ``ls``-layout state dict without the keys that a model (called ``name``, its state dict's keys
    ``expected``) lacks and its ``family`` leaves out where they are zero
    (its ``ls`` layout's ``optional_zero``: DINOv3's q and v biases); ``changes`` gets them.

    Raises:
        RemapError: Such a key is not zero; the message names the variant of that width and depth that has it.
    """
    optional = family.layouts["ls"].optional_zero
    extra = [k for k in state_dict if k not in expected and re.fullmatch(optional, k)]
    nonzero = [k for k in extra if state_dict[k].any()]
    if nonzero:  # a bias as wide as its model
        width = state_dict[nonzero[0]].shape[-1]
        alike = (v for v in families.VARIANTS if v.family is family and v.embed_dim == width)
        having = next((v.name for v in alike if nonzero[0] in state_dict_shapes(v)), "a model with them")
        raise RemapError(
            f"checkpoint has non-zero {nonzero[0]} ({len(nonzero)} such tensors), which {name} has no place for; "
            f"read it as {having}"
        )
    if changes is not None:
        changes.extend((k, "", "zero") for k in extra)
    return {k: v for k, v in state_dict.items() if k not in extra}
