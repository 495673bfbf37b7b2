"""The files that describe an exported folder: timm's ``config.json`` and the model card.

:func:`write_config` writes ``config.json`` with timm's own helper, so
``timm.create_model("local-dir:DIR")`` (or ``"hf-hub:ORG/NAME"``) builds the right
architecture. :func:`build_model_card` writes the ``README.md`` text: Hub metadata,
model details, the layout change, provenance, the parity table, a summary of the
LayerScale gates, usage code and the citation. The card's text is the template
``card_template.md`` next to this module; this module computes the values it is
filled in with. Everything here is local: nothing is downloaded or sent.
"""

from __future__ import annotations

import functools
import math
import os
import re
import string
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from .._version import __version__

__all__ = ["build_model_card", "write_config", "WEIGHTS_NAME", "CONFIG_NAME", "CARD_NAME", "PLOT_NAME", "TEMPLATE_NAME"]

#: The files of an exported folder.
WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
CARD_NAME = "README.md"
PLOT_NAME = "gates.png"

#: The model card's template, a data file of this package.
TEMPLATE_NAME = "card_template.md"
_SECTION = re.compile(r"^<!-- section: ([\w-]+) -->\n", re.MULTILINE)

#: The paper of each family, as BibTeX; a card cites its own family's paper only.
BIBTEX = {
    "cait": """\
@inproceedings{touvron2021cait,
  title     = {Going Deeper With Image Transformers},
  author    = {Touvron, Hugo and Cord, Matthieu and Sablayrolles, Alexandre and Synnaeve, Gabriel and J{\\'e}gou, Herv{\\'e}},
  booktitle = {Proceedings of the IEEE/CVF International Conference on Computer Vision (ICCV)},
  pages     = {32--42},
  year      = {2021}
}""",
    "deit3": """\
@inproceedings{touvron2022deit3,
  title     = {{DeiT III}: Revenge of the {ViT}},
  author    = {Touvron, Hugo and Cord, Matthieu and J{\\'e}gou, Herv{\\'e}},
  booktitle = {European Conference on Computer Vision (ECCV)},
  pages     = {516--533},
  publisher = {Springer},
  year      = {2022}
}""",
    "vit5": """\
@article{wang2026vit5,
  title   = {{ViT-5}: Vision Transformers for the Mid-2020s},
  author  = {Wang, Feng and Ren, Sucheng and Zhang, Tiezheng and Neskovic, Predrag and Bhattad, Anand and Xie, Cihang and Yuille, Alan},
  journal = {arXiv preprint arXiv:2602.08071},
  year    = {2026}
}""",
}

_FAMILY_TEXT = {
    "cait": (
        "CaiT (Class-Attention in Image Transformers)",
        "a stack of self-attention blocks with talking-heads attention, then two class-attention "
        "blocks in which only the class token attends to the patch tokens; every residual branch "
        "is scaled by LayerScale",
    ),
    "deit3": ("DeiT III", "a plain Vision Transformer whose residual branches are scaled by LayerScale"),
    "vit5": (
        "ViT-5",
        "a Vision Transformer with RMSNorm, QK-norm, 2-D rotary position embedding and register tokens, "
        "whose residual branches are scaled by LayerScale",
    ),
}

_GENERIC_LAYOUT_ROWS = [
    ("blocks.N.gamma_1", "blocks.N.ls1.gamma", "attention branch gate"),
    ("blocks.N.gamma_2", "blocks.N.ls2.gamma", "MLP branch gate"),
]
_LAYOUT_ROWS = {
    "cait": [
        ("module.<key>", "<key>", "DistributedDataParallel prefix removed"),
        *_GENERIC_LAYOUT_ROWS,
        ("blocks_token_only.N.gamma_1", "blocks_token_only.N.ls1.gamma", "class-attention branch gate"),
        ("blocks_token_only.N.gamma_2", "blocks_token_only.N.ls2.gamma", "class-attention MLP gate"),
    ],
}

_DATASETS = {"in1k": "imagenet-1k", "in22k": "imagenet-22k", "in21k": "imagenet-21k"}


def write_config(
    model_name: str,
    path: str | os.PathLike[str],
    *,
    num_classes: int | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Write timm's ``config.json`` for a registered model, with timm's own helper.

    The model is built on the ``meta`` device (no memory, no weights) and passed to
    ``timm.models.save_config_for_hf``, which records ``architecture``,
    ``num_classes``, ``num_features``, ``model_args`` and the ``pretrained_cfg``
    (input size, crop, mean/std, interpolation).

    Args:
        model_name: Registered model name (``cait_s24_224_ls``).
        path: The ``config.json`` to write.
        num_classes: Classifier size when it differs from the model's default.
        extra: Extra top-level fields (``pretrained_cfg`` entries are merged).

    Returns:
        The written configuration.
    """
    import json

    import timm
    import torch
    from timm.models._hub import save_config_for_hf

    kwargs: dict[str, Any] = {} if num_classes is None else {"num_classes": num_classes}
    with torch.device("meta"):
        model = timm.create_model(model_name, **kwargs)
    save_config_for_hf(model, str(path), model_config=dict(extra or {}))
    return json.loads(Path(path).read_text(encoding="utf-8"))


def _pretrained_field(variant_name: str, name: str) -> Any:
    """A field of the model's default ``pretrained_cfg`` in timm's registry, or ``None``."""
    import timm

    cfg = timm.models.get_pretrained_cfg(variant_name)
    return getattr(cfg, name, None) if cfg is not None else None


def _official_file(variant_name: str) -> str | None:
    url = _pretrained_field(variant_name, "url")
    return os.path.basename(urlparse(url).path) if url else None


def _md_code(text: str) -> str:
    return "`" + text.replace("`", "'") + "`"


def build_model_card(
    conversion: Any,
    *,
    repo_id: str,
    config: Mapping[str, Any],
    num_params: int,
    command: str,
    gates: Sequence[Mapping[str, Any]] | None = None,
    plot: str | None = None,
    reload_checked: bool = True,
) -> Any:
    """Build the model card (a huggingface_hub ``ModelCard``) of an exported folder.

    The text is ``card_template.md`` (shipped with the package) filled in with the
    facts of the conversion.

    Args:
        conversion: The :class:`~timm_layerscale.conversion.pipeline.ConversionResult`.
        repo_id: Hub id used in the usage code.
        config: The written ``config.json``.
        num_params: Number of parameters in the weights.
        command: The command line that made the folder.
        gates: :func:`~timm_layerscale.inspection.gate_profile` rows, summarised in the card.
        plot: File name of the gate plot inside the folder, if one was drawn.
        reload_checked: The folder was reloaded with ``local-dir:`` and matched.

    Returns:
        A ``huggingface_hub.ModelCard``; ``str(card)`` is the README text.
    """
    from huggingface_hub import ModelCard, ModelCardData

    variant = conversion.variant
    family = variant.family
    pcfg = dict(config.get("pretrained_cfg", {}))
    tag = pcfg.get("tag") or _pretrained_field(variant.name, "tag")
    full_name = f"{variant.name}.{tag}" if tag else variant.name
    datasets = sorted({ds for key, ds in _DATASETS.items() if tag and key in tag})
    if family == "cait" and not datasets:
        datasets = ["imagenet-1k"]
    data = ModelCardData(
        library_name="timm",
        license=pcfg.get("license") or ("apache-2.0" if family == "cait" else None),
        tags=["image-classification", "timm", "layerscale", family, "timm-layerscale"],
        datasets=datasets or None,
        pipeline_tag="image-classification",
        model_name=full_name,
    )

    title, description = _FAMILY_TEXT.get(family, (family, "a Vision Transformer with LayerScale"))
    size = pcfg.get("input_size", (3, variant.img_size, variant.img_size))
    source, source_name = conversion.source, conversion.source_path.name
    if source.startswith(("https://", "http://")):
        source_file = f"[{source_name}]({source})"
    else:
        source_file = _md_code(source if source.startswith("hf-hub:") else source_name)
    report = conversion.report
    reference = report.reference if report is not None else variant.reference
    if _official_file(variant.name) == source_name:
        weights = f"These are the official weights released with the paper (`{source_name}`)"
    else:
        weights = f"The weights come from `{source_name}`"
    paper = pcfg.get("paper_name")
    if paper:
        ids = str(pcfg.get("paper_ids", ""))
        if ids.startswith("arXiv:"):
            paper += f", https://arxiv.org/abs/{ids.split(':', 1)[1]}"
    parity = _parity_text(report)
    if reload_checked:
        parity += "\n\n" + _render("reload")
    gate_text = ""
    if gates:
        plot_text = _render("plot", file=plot) + "\n\n" if plot else ""
        gate_text = _render("gates", plot=plot_text, summary=_gate_summary(gates)) + "\n\n"
    if family in BIBTEX:
        citation = _render("bibtex", bibtex=BIBTEX[family])
    else:
        citation = _generic_citation(pcfg)
    text = _render(
        "card",
        metadata=data.to_yaml(),
        full_name=full_name,
        title=title,
        description=description,
        weights=weights,
        architecture=variant.name,
        reference=_reference_text(family, reference) if reference else None,
        params_m=f"{num_params / 1e6:.1f}",
        image_size=f"{size[-2]} x {size[-1]}",
        init_value=f"{variant.init_value:g}" if variant.init_value is not None else None,
        num_classes=config.get("num_classes"),
        datasets=", ".join(datasets) or None,
        paper=paper,
        origin_url=pcfg.get("origin_url"),
        layout_rows="\n".join(
            f"| `{before}` | `{after}` | {note} |"
            for before, after, note in _LAYOUT_ROWS.get(family, _GENERIC_LAYOUT_ROWS)
        ),
        source_file=source_file,
        source_sha256=conversion.source_sha256,
        source_layout=conversion.source_layout,
        version=__version__,
        weights_name=WEIGHTS_NAME,
        command=command,
        parity=parity,
        gates=gate_text,
        repo_id=repo_id,
        citation=citation,
    )
    return ModelCard(text + "\n")


def _parity_text(report: Any) -> str:
    """The Parity section: the verdict and the report's table, or why there is none."""
    if report is None:
        return _render("no-parity")
    if report.bit_exact and report.passed:
        verdict = "**bit-exact**: every output equals the reference's (`torch.equal`)"
    else:
        verdict = (
            f"**within tolerance** `|ref - out| <= {report.atol:g} + {report.rtol:g} * |ref|` "
            f"({report.tolerance_reason}); largest difference {report.max_abs_diff:.3g}"
        )
    weights_check = (
        "identical" if report.weights_equal else "not compared" if report.weights_equal is None else "DIFFERENT"
    )
    return _render(
        "parity", reference=report.reference, verdict=verdict, weights_check=weights_check, table=report.to_markdown()
    )


@functools.cache
def _sections() -> dict[str, str]:
    """The sections of the template, by name, without the blank lines around them."""
    text = resources.files(__package__).joinpath(TEMPLATE_NAME).read_text(encoding="utf-8")
    parts = _SECTION.split(text)[1:]  # the text before the first section describes the format
    return {name: body.strip("\n") for name, body in zip(parts[0::2], parts[1::2], strict=True)}


def _placeholders(line: str) -> list[str]:
    return [m["named"] or m["braced"] for m in string.Template.pattern.finditer(line) if m["named"] or m["braced"]]


def _render(section: str, **values: Any) -> str:
    """Section ``section`` of the template with ``values`` filled in.

    A line starting with ``?`` is kept (without the ``?``) only when every
    placeholder on it has a value other than ``None``; any other placeholder must
    have one.

    Raises:
        KeyError: A placeholder has no value.
    """
    given = {name: str(value) for name, value in values.items() if value is not None}
    lines = []
    for line in _sections()[section].split("\n"):
        if line.startswith("?"):
            line = line[1:]
            if not all(name in given for name in _placeholders(line)):
                continue
        lines.append(line)
    return string.Template("\n".join(lines)).substitute(given)


def _reference_text(family: str, reference: str) -> str:
    """Name a parity reference honestly: timm's model, or this package's own implementation."""
    if family == "vit5":
        name = reference.rsplit("/", 1)[-1]
        return (
            f"the official-layout ViT-5 reference implementation of timm-layerscale "
            f"(`timm_layerscale.parity.vit5_official`, `{name}`; timm has no ViT-5)"
        )
    return f"timm's `{reference}`"


def _generic_citation(pcfg: Mapping[str, Any]) -> str:
    paper = pcfg.get("paper_name")
    ids = pcfg.get("paper_ids") or ""
    return f"Please cite {paper} ({ids})." if paper and ids else "Please cite the paper that introduced this model."


def _gate_summary(gates: Sequence[Mapping[str, Any]]) -> str:
    parts = []
    for which, label in (("ls1", "attention"), ("ls2", "MLP")):
        means = [(r[which]["mean"], r["block"]) for r in gates if r.get(which) and not math.isnan(r[which]["mean"])]
        if means:
            lo, hi = min(means), max(means)
            parts.append(
                f"{label} gates (`{which}`) have mean |gamma| from {lo[0]:.3g} (`{lo[1]}`) to {hi[0]:.3g} (`{hi[1]}`)"
            )
    ca = sum(1 for r in gates if r.get("class_attn"))
    where = (
        f" over {len(gates) - ca} self-attention and {ca} class-attention blocks"
        if ca
        else f" over {len(gates)} blocks"
    )
    text = "; ".join(parts) + where + "."
    return text[0].upper() + text[1:] + " Print the full table with `timm-layerscale inspect hf-hub:...`."
