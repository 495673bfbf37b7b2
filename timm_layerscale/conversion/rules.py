"""The rule engine: a state dict read from one of its family's layouts (:class:`~timm_layerscale.families.Layout`)
into the ``ls`` layout and written into another, by the layouts' ordered rules. No I/O; tensors pass through
unchanged (the same objects, or views where a rule's value operation splits one), so a memory-mapped checkpoint stays
unread but where an operation checks values.

A key is matched against the rules in order; the first match renames, keeps or drops it (a drop with its proof that
the tensor is inert), and a key no rule matches is an error that names it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

from ..errors import RemapError
from ..families import Family, Layout, Proof, Rule, get_family
from .checkpoint import strip_prefixes

__all__ = ["Change", "UncoveredKeys", "check_floating", "check_state_dict", "describe_changes", "detect_gates"]
__all__ += ["mismatches"]
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
        for rule in rules:
            hit, new_key = rule.apply(key)
            if hit:
                matched.append((key, value, rule, new_key))
                break
        else:
            unknown.append(key)
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


def detect_gates(state_dict: Mapping[str, Any], family: Family) -> str:
    """``"raw"`` (parameters: ``blocks.3.gamma_1``), ``"modules"`` (``blocks.3.ls1.gamma``) or ``"none"``: how a
    prefix-free state dict holds ``family``'s LayerScale gates.

    Raises:
        RemapError: Both kinds are present.
    """
    kinds = {found[2]: key for key in state_dict if (found := family.gate_of(key))}
    if len(kinds) > 1:
        raise RemapError(
            f"checkpoint mixes raw gates ({kinds[True]}) and LayerScale modules ({kinds[False]}); "
            "it is not a layout this tool knows"
        )
    return "none" if not kinds else "raw" if True in kinds else "modules"


def read_layout(
    state_dict: Mapping[str, V],
    family: str | Family,
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
    fam = get_family(family)
    detect_gates(state_dict, fam)
    layouts = fam.source_layouts()
    told = [layout for layout in layouts if any(re.fullmatch(layout.tell, k) for k in state_dict)]
    found: list[tuple[Layout, dict[str, V], list[Change]]] = []
    errors: list[tuple[int, bool, UncoveredKeys]] = []
    for layout in told or layouts:
        record: list[Change] = []
        try:
            found.append(
                (layout, remap(state_dict, layout.read, f"{fam.title} ({layout.name} layout)", record), record)
            )
        except UncoveredKeys as e:
            errors.append((e.count, (layout.wrapper, layout.prefix) != container, e))
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
    return read_layout(strip_prefixes(state_dict), family, changes=changes)[1]


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
