"""The model card of an exported folder, rendered from ``card_template.md`` through
``huggingface_hub.ModelCard.from_template``. It calls the weights official only when the source's
SHA-256 matches a pinned release (:data:`~timm_layerscale.families.OFFICIAL_SHA256`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from importlib import resources
from typing import Any

from .._version import __version__
from ..files.sources import CONFIG_NAME, URL_PREFIXES, WEIGHTS_NAME

__all__ = ["CARD_NAME", "CONFIG_NAME", "PLOT_NAME", "build_model_card", "timm_hub_copy"]

CARD_NAME = "README.md"
PLOT_NAME = "gates.png"

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
_PREFIX_ROW = ("module.<key>", "<key>", "DistributedDataParallel prefix removed")
_LAYOUT_ROWS = {
    "cait": [
        _PREFIX_ROW,
        *_GENERIC_LAYOUT_ROWS,
        ("blocks_token_only.N.gamma_1", "blocks_token_only.N.ls1.gamma", "class-attention branch gate"),
        ("blocks_token_only.N.gamma_2", "blocks_token_only.N.ls2.gamma", "class-attention MLP gate"),
    ],
}

_DATASETS = {"in1k": "imagenet-1k", "in22k": "imagenet-22k", "in21k": "imagenet-21k"}


def timm_hub_copy(reference: str | None, tag: str | None) -> str | None:
    """timm's own Hub repository for the reference's weights under ``tag`` (``timm/cait_xxs24_224.fb_dist_in1k``), if any."""
    if not reference or not tag:
        return None
    import timm

    cfg = timm.models.get_pretrained_cfg(f"{reference}.{tag}")
    hub_id = getattr(cfg, "hf_hub_id", None)
    return hub_id if hub_id and hub_id.startswith("timm/") else None


def _tag_classes(architecture: str, tag: str) -> int | None:
    """The classes of the weights timm registers for ``architecture`` under ``tag``."""
    import timm

    return getattr(timm.models.get_pretrained_cfg(f"{architecture}.{tag}"), "num_classes", None)


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

    The folder's architecture is ``config["architecture"]``: this package's model
    (``cait_s24_224_ls``, ``vit5_*``), or timm's own (``cait_s24_224`` from
    ``export --to gamma``, ``deit3_*``); the card says which package loads it.
    ``base_model`` names timm's Hub copy of the reference's weights where timm has one.
    ``datasets`` are the tag's (``in1k``: ImageNet-1k), unless the head has other classes than the
    tag's weights (a fine-tune), which were not trained on them.

    Args:
        conversion: The :class:`~timm_layerscale.converter.ConversionResult`.
        repo_id: Hub id used in the usage code.
        config: The written ``config.json``.
        num_params: Number of parameters in the weights.
        command: The command line that made the folder.
        gates: :func:`~timm_layerscale.inspection.gate_profile` rows, summarised in the card.
        plot: File name of the gate plot inside the folder, if one was drawn.
        reload_checked: The folder was loaded back with ``local-dir:`` and matched.

    Returns:
        A ``huggingface_hub.ModelCard``; ``str(card)`` is the README text.
    """
    from huggingface_hub import ModelCard, ModelCardData

    variant = conversion.variant
    family = variant.family
    architecture = config["architecture"]
    needs_package = architecture != variant.reference
    layout = "gamma" if family == "cait" and not needs_package else "ls"
    pcfg = dict(config.get("pretrained_cfg", {}))
    tag = str(pcfg.get("tag") or "")
    full_name = f"{architecture}.{tag}" if tag else architecture
    classifier = config.get("num_classes") != 0  # 0: a backbone saved without its head
    # A head of other classes than the tag's weights (a fine-tune) was not trained on the tag's data.
    trained = bool(tag) and (not classifier or config.get("num_classes") == _tag_classes(architecture, tag))
    datasets = sorted({ds for key, ds in _DATASETS.items() if trained and key in tag}) or None
    task = "image-classification" if classifier else "image-feature-extraction"
    data = ModelCardData(
        library_name="timm",
        license=pcfg.get("license") or ("apache-2.0" if family == "cait" else None),
        tags=[task, "timm", "layerscale", family, "timm-layerscale"],
        datasets=datasets,
        pipeline_tag=task,
        model_name=full_name,
        base_model=timm_hub_copy(variant.reference, tag),
    )

    title, description = _FAMILY_TEXT.get(family, (family, "a Vision Transformer with LayerScale"))
    source, source_name, sha = conversion.source, conversion.source_path.name, conversion.source_sha256
    if source.startswith(URL_PREFIXES):  # without credentials: ConversionResult.source
        source_file = _md_link(source_name, source)
    else:
        source_file = _md_code(source if source.startswith("hf-hub:") else source_name)
    from ..families import OFFICIAL_SHA256

    if OFFICIAL_SHA256.get(source_name) == sha:
        weights = f"These are the official weights released with the paper (`{source_name}`, SHA-256 as pinned)"
    else:
        weights = f"The weights come from {_md_code(source_name)} (SHA-256 `{sha}`)"
    if needs_package and family == "vit5":
        needs = "timm with `timm-layerscale` installed, which registers this architecture (timm has no ViT-5)."
    elif needs_package:
        needs = f"timm with `timm-layerscale` installed, which registers `{architecture}`."
    else:
        needs = f"timm alone (timm's own `{architecture}`); timm-layerscale is not needed."
    needs += " transformers loads it through `TimmWrapper`, in the same environment."
    paper = pcfg.get("paper_name")
    ids = str(pcfg.get("paper_ids", ""))
    if paper and ids.startswith("arXiv:"):
        paper += f", https://arxiv.org/abs/{ids.split(':', 1)[1]}"
    report = conversion.report
    reference = report.reference if report is not None else variant.reference
    size = pcfg.get("input_size", (3, variant.img_size, variant.img_size))
    rows = _LAYOUT_ROWS.get(family, _GENERIC_LAYOUT_ROWS) if layout == "ls" else [_PREFIX_ROW]
    template = resources.files(__package__).joinpath("card_template.md").read_text(encoding="utf-8")
    card = ModelCard.from_template(
        data,
        template_str=template,
        full_name=full_name,
        title=title,
        description=description,
        weights=weights,
        layout=layout,
        needs=needs,
        needs_package=needs_package,
        pip="timm-layerscale" if needs_package else "timm",
        architecture=architecture,
        registered="registered with timm by `import timm_layerscale`" if needs_package else "timm's own architecture",
        reference=_reference_text(family, reference) if reference else None,
        params_m=f"{num_params / 1e6:.1f}",
        image_size=f"{size[-2]} x {size[-1]}",
        init_value=f"{variant.init_value:g}" if variant.init_value is not None else None,
        num_classes=config.get("num_classes"),
        classifier=classifier,
        labelled="label_names" in config,
        dataset_names=", ".join(datasets or []),
        paper=paper,
        origin_url=pcfg.get("origin_url"),
        layout_rows=rows,
        source_file=source_file,
        source_sha256=sha,
        source_layout=conversion.source_layout,
        version=__version__,
        weights_name=WEIGHTS_NAME,
        command=command,
        **_parity_values(report),
        reload_checked=reload_checked,
        gate_summary=_gate_summary(gates) if gates else None,
        plot=plot,
        repo_id=repo_id,
        bibtex=BIBTEX.get(family),
        citation=_generic_citation(pcfg),
    )
    return card


def _md_code(text: str) -> str:
    return "`" + text.replace("`", "'") + "`"


def _md_link(text: str, url: str) -> str:
    """A markdown link that neither its text (a ``]``) nor its address (a ``)``, a space) ends early."""
    text = "".join("\\" + c if c in "\\[]" else c for c in text)
    return f"[{text}]({url.replace('(', '%28').replace(')', '%29').replace(' ', '%20')})"


def _parity_values(report: Any) -> dict[str, Any]:
    """The Parity section's values: the verdict and the report's table (none without a report)."""
    if report is None:
        return {"table": None}
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
    return {
        "table": report.to_markdown(),
        "parity_reference": report.reference,
        "verdict": verdict,
        "weights_check": weights_check,
    }


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
    from ..inspection import gate_extremes

    parts = [
        f"{label} gates (`{which}`) have mean |gamma| from {lo[0]:.3g} (`{lo[1]}`) to {hi[0]:.3g} (`{hi[1]}`)"
        for which, label, (lo, hi) in gate_extremes(gates)
    ]
    ca = sum(1 for r in gates if r.get("class_attn"))
    where = (
        f" over {len(gates) - ca} self-attention and {ca} class-attention blocks"
        if ca
        else f" over {len(gates)} blocks"
    )
    text = "; ".join(parts) + where + "."
    return text[0].upper() + text[1:]
