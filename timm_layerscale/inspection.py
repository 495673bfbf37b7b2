"""The LayerScale gates of any checkpoint, block by block, as a table, JSON or a plot: how much each branch of a
block (attention, MLP, as its family's gates name them) adds to the residual stream across depth. Only the gamma
tensors are read (the file is memory-mapped), of any layout and family; no model is built."""

from __future__ import annotations

import math
import os
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import LayerScaleError
from .families import FAMILIES, Family, gate_family

if TYPE_CHECKING:
    from .conversion.detect import Detection

__all__ = ["MissingPlotDependency", "conversion_plan", "format_plan", "format_gate_table", "gate_profile"]
__all__ += ["inspect_checkpoint"]
__all__ += ["gate_rows", "gate_stats", "gate_summary", "plot_format", "plot_gates"]

_BLOCK = re.compile(r"(?P<stage>.*?)\.?(?P<index>\d+)")  # a stage's path, then the block's number
_STATS = ("mean", "min", "max")
#: The colour and marker of a family's first, second and third gate in a plot.
_STYLES = (("tab:blue", "o"), ("tab:orange", "s"), ("tab:green", "^"))


class MissingPlotDependency(LayerScaleError):
    """matplotlib is needed for a plot and is not installed."""


def gate_stats(gamma: Any) -> dict[str, float]:
    """Mean, min and max of ``|gamma|`` (any shape, any float dtype), as Python floats."""
    a = gamma.detach().float().abs().reshape(-1)
    if a.numel() == 0:
        return {"mean": math.nan, "min": math.nan, "max": math.nan}
    return {"mean": float(a.mean()), "min": float(a.min()), "max": float(a.max())}


def _position(block: str) -> tuple[str, int]:
    """The stage and index of a block path (``blocks.3`` -> ``("blocks", 3)``)."""
    b = _BLOCK.fullmatch(block)
    return (b.group("stage"), int(b.group("index"))) if b else (block, 0)


def _stage_order(stage: str, family: Family) -> tuple[Any, ...]:
    """The family's class-attention stage last; otherwise natural order (``stages.2`` before ``stages.10``)."""
    parts = tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", stage) if p)
    return (bool(re.fullmatch(family.class_stage, stage)), parts)


def gate_labels(rows: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """The gates of the family of :func:`gate_rows`' ``rows``: each module's name (once, where two kinds of block
    hold it) and the branch it scales."""
    gates = FAMILIES[rows[0]["family"]].gates if rows else ()
    return list({gate.name: gate.branch for gate in gates}.items())


def gate_profile(
    source: str | os.PathLike[str] | Mapping[str, Any], *, model: str | None = None, ema: bool = False
) -> list[dict[str, Any]]:
    """The :func:`gate_rows` of a checkpoint file, an exported folder, an ``https://`` URL, ``hf-hub:`` id or a
    state dict (wrapped or not, prefixed or not); ``ema`` reads a training checkpoint's ``'model_ema'``.

    Raises:
        LayerScaleError: The checkpoint cannot be read, holds no gates, or its gates do not fit ``model``.
    """
    from .conversion.checkpoint import state_dict_of
    from .files.read import public_source, read_checkpoint

    if isinstance(source, Mapping):
        return gate_rows(state_dict_of(source, ema), model=model)
    return gate_rows(read_checkpoint(source, ema)[1], model=model, where=public_source(source))


def inspect_checkpoint(
    source: str | os.PathLike[str], *, model: str | None = None, ema: bool = False
) -> dict[str, Any]:
    """What ``timm-layerscale inspect`` shows of a checkpoint file, folder, URL or ``hf-hub:`` id: ``source`` (as
    shown), ``gates`` (:func:`gate_rows`, by the file's own key names, or through its layout's rules where it names
    its gates otherwise: transformers' ``lambda1``) and its conversion plan (:func:`conversion_plan`); where no
    variant is found, ``refused`` (the one-line reason) or ``ambiguous`` (the variants it fits alike) instead.

    Raises:
        LayerScaleError: The checkpoint cannot be read or holds no gates; the message names it.
    """
    from .conversion.detect import Twins, detect
    from .files.read import public_source, read_checkpoint

    _, tensors, container = read_checkpoint(source, ema)
    where, found = public_source(source), None  # type: str, Detection | None
    try:
        found = detect(tensors, model, container)
        plan = conversion_plan(tensors, found)
    except Twins as e:  # the gates read as the first twin's, which holds them alike
        found, plan = detect(tensors, e.names[0], container), {"ambiguous": e.names}
    except LayerScaleError as e:
        plan = {"refused": " ".join(str(e).split())}
    family = found.variant.family if found else None
    named = family is not None and any(family.gate_of(k) for k in tensors)
    rows = gate_rows(found.state_dict if found and not named else tensors, model=model, where=where, family=family)
    return {"source": where, **plan, "gates": rows}


def conversion_plan(tensors: Mapping[str, Any], found: Detection) -> dict[str, Any]:
    """What moving a checkpoint's prefix-free ``tensors`` (detected as ``found``, a
    :class:`~timm_layerscale.conversion.detect.Detection`) would cost, before it is made: its family, variant and
    layout and, for each layout its family writes, how many keys that conversion renames and what it drops, takes
    apart or synthesises, each with its proof (or why it is refused): the conversion's rules and checks run on the
    tensors, as views where they can be; no model runs. ``timm_unused``: what timm's own loader of the architecture
    would leave unused in the file, for a file in a layout timm reads with a filter (``None`` otherwise)."""
    from .conversion.rules import Change, describe_changes, renamed_keys, target_tensors
    from .parity.references import unused_by

    v, layout = found.variant, found.layout
    plans: dict[str, Any] = {}
    for name in v.family.targets():
        same = next((n for n in plans if v.family.layouts[n] is v.family.layouts[name]), None)
        if same is not None:  # DeiT-III's and DINOv2's timm layout is their ls record
            plans[name] = plans[same]
            continue
        read: list[Change] = []
        written: list[Change] = []
        try:
            target_tensors(tensors, v, layout, v.family.layouts[name], changes=read, written=written)
        except LayerScaleError as e:
            plans[name] = {"refused": " ".join(str(e).split())}
            continue
        plans[name] = {"renamed": len(renamed_keys(read, written)), "changes": describe_changes([*read, *written])}
    by_timm = layout.name == "official" and v.reference is not None and not layout.library
    return {
        "family": v.family.title,
        "variant": v.name,
        "layout": layout.name,
        "container": layout.container,
        "conversions": plans,
        "timm_unused": unused_by(v, layout, tensors, **found.overrides) if by_timm else None,
        "timm_model": v.reference if by_timm else None,
    }


def format_plan(plan: Mapping[str, Any]) -> str:
    """:func:`inspect_checkpoint`'s plan as lines: the source, then per layout what converting there would do (or why
    no variant is read)."""
    if "refused" in plan:
        return f"{plan['source']}: refused: {plan['refused']}"
    if "ambiguous" in plan:
        return f"{plan['source']}: ambiguous: fits {' and '.join(plan['ambiguous'])} alike; pass --model NAME"
    lines = [f"{plan['source']}: {plan['family']} {plan['variant']}, {plan['layout']} layout ({plan['container']})"]
    for name, p in plan["conversions"].items():
        did = (
            p.get("refused")
            or f"renames {p['renamed']} key pattern(s); {p['changes'] or 'every value copied as it is'}"
        )
        lines.append(f"  convert --to {name}: {'refused: ' if 'refused' in p else ''}{did}")
    if plan["timm_model"]:
        counts = Counter(re.sub(r"\.\d+\.", ".N.", key) for key in plan["timm_unused"])
        unused = ", ".join(f"{k} x{n}" if n > 1 else k for k, n in counts.items()) or "nothing"
        lines.append(f"  timm's own loader ({plan['timm_model']}, pretrained) would leave unused: {unused}")
    return "\n".join(lines)


def gate_rows(
    tensors: Mapping[str, Any],
    *,
    model: str | None = None,
    where: str = "the state dict",
    family: Family | None = None,
) -> list[dict[str, Any]]:
    """The LayerScale gates of a state dict of ``family`` (default: the family whose gates its keys are; ``where``
    names it in errors), one row per block, the class-attention blocks last; with ``model``, its every gate and no
    other must be there at its width.

    Returns:
        JSON-ready rows: ``depth`` (position across all blocks), ``block`` (key prefix), ``stage``, ``index``,
        ``class_attn``, ``dim`` (channels), ``family``, one entry per gate of the family named as its module
        (``ls1``: ``{"mean", "min", "max"}`` of ``|gamma|``, or ``None``) and ``layout`` (``"gamma"`` for raw
        parameters, ``"ls"`` for modules).
    """
    family = family or gate_family(tensors)
    gammas, raw = family.gates_in(tensors) if family else ({}, False)
    if not gammas:
        if not tensors:
            raise LayerScaleError(f"{where} holds no weights (an empty state dict); pass a checkpoint with weights")
        raise LayerScaleError(
            f"{where} holds no LayerScale gates (no key a registered family names a gate); "
            "pass a LayerScale model's checkpoint (of a folded one, the file from before folding)"
        )
    assert family is not None
    layout = "gamma" if raw else "ls"
    positions = {block: _position(block) for block, _ in gammas}
    blocks = sorted(positions, key=lambda block: (_stage_order(positions[block][0], family), positions[block][1]))
    out = []
    for depth, block in enumerate(blocks):
        stage, index = positions[block]
        class_attn = bool(re.fullmatch(family.class_stage, stage))
        dim = next(gamma.numel() for (owner, _), gamma in gammas.items() if owner == block)
        row = {"depth": depth, "block": block, "stage": stage, "index": index, "class_attn": class_attn, "dim": dim}
        stats = {gate.name: gammas.get((block, gate.name)) for gate in family.gates}
        stats = {name: None if gamma is None else gate_stats(gamma) for name, gamma in stats.items()}
        out.append({**row, "family": family.name, **stats, "layout": layout})
    if model is not None:
        _check_model({gate: int(gamma.numel()) for gate, gamma in gammas.items()}, model)
    return out


def _check_model(have: Mapping[tuple[str, str], int], model: str) -> None:
    """Raise unless the gates ``(block, gate name) -> channels`` are those of ``model``."""
    import timm
    import torch

    from .errors import ArchitectureError
    from .families import get_variant

    try:
        name = get_variant(model).name
    except ArchitectureError:
        if not timm.is_model(model.split(".", 1)[0]):
            raise
        name = model.split(".", 1)[0]
    with torch.device("meta"):
        tensors = timm.create_model(name).state_dict()
    family = gate_family(tensors)
    want = {gate: gamma.numel() for gate, gamma in (family.gates_in(tensors)[0] if family else {}).items()}
    missing = sorted(want.keys() - have.keys())
    extra = sorted(have.keys() - want.keys())
    wrong = sorted(k for k in want.keys() & have.keys() if want[k] != have[k])
    if missing:
        what = f"{len(missing)} missing (first {'.'.join(missing[0])})"
    elif extra:
        what = f"{len(extra)} unexpected (first {'.'.join(extra[0])})"
    elif wrong:
        k = wrong[0]
        what = f"{len(wrong)} of another width (first {'.'.join(k)}: {have[k]} channels, the model's {want[k]})"
    else:
        return
    raise LayerScaleError(f"checkpoint gates do not fit {model}: {what}; check the model name")


def format_gate_table(rows: Sequence[Mapping[str, Any]], title: str | None = None) -> str:
    """The gate profile as an aligned table: per block its key prefix, ``CA`` or ``SA``, the channels and
    mean / min / max ``|gamma|`` of each gate of its family; a footer names the extreme blocks."""
    names = [name for name, _ in gate_labels(rows)]
    header = ["block", "kind", "dim", *(f"{name} {stat}" for name in names for stat in _STATS)]
    body = []
    for r in rows:
        cells = [r["block"], "CA" if r["class_attn"] else "SA", str(r["dim"] if r["dim"] is not None else "-")]
        for which in names:
            s = r[which]
            cells += [f"{s[k]:.3e}" if s else "-" for k in _STATS]  # NaN prints as nan
        body.append(cells)
    widths = [max(len(h), *(len(c[i]) for c in body)) for i, h in enumerate(header)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    out = [title] if title else []
    out += [line(header), line(["-" * w for w in widths]), *map(line, body), "", _footer(rows)]
    return "\n".join(out)


def _footer(rows: Sequence[Mapping[str, Any]]) -> str:
    sa = [r for r in rows if not r["class_attn"]]
    ca = [r for r in rows if r["class_attn"]]
    parts = [f"{len(sa)} self-attention (SA) block(s)"]
    if ca:
        parts.append(f"{len(ca)} class-attention (CA) block(s), depth {ca[0]['depth']}-{ca[-1]['depth']}")
    text = "; ".join(parts) + f"; layout {rows[0]['layout']}; |gamma| over channels"
    for which, label, (lo, hi) in gate_extremes(rows):
        text += f"\n{which} ({label}): mean |gamma| from {lo[0]:.3e} ({lo[1]}) to {hi[0]:.3e} ({hi[1]})"
    return text


def gate_extremes(rows: Sequence[Mapping[str, Any]]) -> list[tuple[str, str, tuple[tuple[float, str], ...]]]:
    """For each gate of the rows' family that has values (``ls1``, attention): the smallest and largest mean
    ``|gamma|``, with their blocks."""
    found: list[tuple[str, str, tuple[tuple[float, str], ...]]] = []
    for which, label in gate_labels(rows):
        means = [(r[which]["mean"], r["block"]) for r in rows if r.get(which) and not math.isnan(r[which]["mean"])]
        if means:
            found.append((which, label, (min(means), max(means))))
    return found


def gate_summary(rows: Sequence[Mapping[str, Any]]) -> str:
    """One markdown sentence on the gates' smallest and largest mean ``|gamma|`` and the blocks counted."""
    parts = [
        f"{label} gates (`{which}`) have mean |gamma| from {lo[0]:.3g} (`{lo[1]}`) to {hi[0]:.3g} (`{hi[1]}`)"
        for which, label, (lo, hi) in gate_extremes(rows)
    ]
    ca = sum(1 for r in rows if r.get("class_attn"))
    where = f"{len(rows) - ca} self-attention and {ca} class-attention blocks" if ca else f"{len(rows)} blocks"
    text = "; ".join(parts) + f" over {where}."
    return text[0].upper() + text[1:]


def require_matplotlib() -> Any:
    """Import and return matplotlib; :class:`MissingPlotDependency` says what to install when it is missing."""
    try:
        import matplotlib
    except ImportError:
        raise MissingPlotDependency("matplotlib is not installed; pip install 'timm-layerscale[plot]'") from None
    return matplotlib


def plot_format(path: str | os.PathLike[str]) -> str:
    """The format :func:`plot_gates` writes to ``path``, from its suffix (``png`` without one); a
    :class:`MissingPlotDependency` without matplotlib, a ``LayerScaleError`` for a format it does not write."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fmt = Path(path).suffix.lower().lstrip(".") or "png"
    if fmt not in FigureCanvasAgg.get_supported_filetypes():
        raise LayerScaleError(f"cannot draw a .{fmt} file: {path}; name the plot .png, .svg or .pdf")
    return fmt


def _depth_ticks(rows: Sequence[Mapping[str, Any]]) -> tuple[list[float], list[str]]:
    """Tick positions and labels: every few self-attention blocks, and ``CA`` under the class-attention ones."""
    sa = [r for r in rows if not r["class_attn"]]
    ca = [r["depth"] for r in rows if r["class_attn"]]
    steps = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 25, 50, 100)
    step = next((s for s in steps if len(sa) <= 12 * s), math.ceil(len(sa) / 12))
    ticks: list[float] = [r["depth"] for i, r in enumerate(sa) if i % step == 0]
    labels = [str(r["index"]) for i, r in enumerate(sa) if i % step == 0]
    if ca:
        ticks.append((min(ca) + max(ca)) / 2)
        labels.append("CA")
    return ticks, labels


def _gate_lines(ax: Any, rows: Sequence[Mapping[str, Any]], floor: float | None) -> list[Any]:
    """Each gate's mean ``|gamma|`` per block as a line on ``ax``, its min-max range shaded (values clipped at
    ``floor`` on a log scale); their legend handles."""
    handles: list[Any] = []
    for (which, branch), (color, marker) in zip(gate_labels(rows), _STYLES, strict=False):
        label = f"{branch} ({which})"
        pts = [(r["depth"], r[which]) for r in rows if r[which]]
        if not pts:
            continue
        xs = [d for d, _ in pts]
        clip = (lambda v: max(v, floor)) if floor is not None else (lambda v: v)
        mean = [clip(s["mean"]) for _, s in pts]
        lo = [clip(s["min"]) for _, s in pts]
        hi = [clip(s["max"]) for _, s in pts]
        (line,) = ax.plot(
            xs, mean, color=color, marker=marker, markersize=4, linewidth=2, label=f"{label}: mean", zorder=3
        )
        band = ax.fill_between(xs, lo, hi, color=color, alpha=0.12, linewidth=0, label=f"{label}: min to max", zorder=1)
        handles += [line, band]
    return handles


def plot_gates(
    rows: Sequence[Mapping[str, Any]],
    path: str | os.PathLike[str],
    *,
    title: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Draw the gate profile across depth into ``path``, written whole or not at all; its suffix names the
    format (:func:`plot_format`). Each gate's mean ``|gamma|`` per block is a line on a log scale with its
    min-max range shaded; class-attention blocks sit on a grey band, and a red cross marks a gate holding
    NaN or Inf. 1200 x 675 pixels as a PNG, legible at a model card's width.

    Raises:
        MissingPlotDependency: matplotlib is not installed.
        OutputExistsError: ``path`` exists and ``overwrite`` is false.
        LayerScaleError: ``rows`` is empty, or the format is unknown.
    """
    from .files.atomic import atomic_output

    fmt = plot_format(path)
    from matplotlib.artist import Artist
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not rows:
        raise LayerScaleError("no gates to plot")
    out = Path(path)
    depth = [r["depth"] for r in rows]
    names = [name for name, _ in gate_labels(rows)]
    positive = [v for r in rows for w in names if r[w] for v in r[w].values() if math.isfinite(v) and v > 0]
    floor = min(positive) if positive else 1e-12
    log = bool(positive)

    fig = Figure(figsize=(8, 4.5), dpi=150, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ca = [r["depth"] for r in rows if r["class_attn"]]
    handles: list[Artist] = []
    if ca:
        handles.append(
            ax.axvspan(min(ca) - 0.5, max(ca) + 0.5, color="0.88", zorder=0, label="class-attention (CA) blocks")
        )
    handles += _gate_lines(ax, rows, floor if log else None)
    diverged = sorted({r["depth"] for r in rows for w in names if r[w] and not all(map(math.isfinite, r[w].values()))})
    if diverged:  # no line can show them: one cross at the top of each such block
        cross = ax.scatter(diverged, [1.0] * len(diverged), transform=ax.get_xaxis_transform(), marker="x")
        cross.set(color="tab:red", clip_on=False, zorder=4, label="a gate holds NaN or inf")
        handles.append(cross)
    if log:
        ax.set_yscale("log")
    ax.set_xlim(min(depth) - 0.5, max(depth) + 0.5)
    ticks, labels = _depth_ticks(rows)
    ax.set_xticks(ticks, labels)
    ax.set_xlabel("block (depth; CA = class-attention block)" if ca else "block (depth)", fontsize=11)
    ax.set_ylabel("|gamma| over channels" + (" (log scale)" if log else ""), fontsize=11)
    ax.set_title(title or f"LayerScale gates across {len(rows)} blocks", fontsize=12)
    ax.tick_params(labelsize=10)
    ax.grid(True, which="major", alpha=0.3)
    order = handles[1:] + handles[:1] if ca else handles  # one column per gate (mean, range), then CA
    fig.legend(handles=order, loc="outside lower center", ncol=3, fontsize=9, frameon=False)
    with atomic_output(out, overwrite) as tmp, open(tmp, "wb") as f:
        fig.savefig(f, format=fmt)
    return out
