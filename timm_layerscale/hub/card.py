"""The model card of an exported folder, rendered from ``card_template.md`` through
``huggingface_hub.ModelCard.from_template``."""

from __future__ import annotations

from collections.abc import Mapping
from importlib import resources
from typing import Any

from .._version import __version__
from ..files.read import CONFIG_NAME, URL_PREFIXES, WEIGHTS_NAME

__all__ = ["CARD_NAME", "CONFIG_NAME", "PLOT_NAME", "build_model_card", "hub_license", "timm_hub_copy"]

CARD_NAME = "README.md"
PLOT_NAME = "gates.png"

_DATASETS = {"in1k": "imagenet-1k", "in22k": "imagenet-22k", "in21k": "imagenet-21k"}


#: Licence identifiers of the Hub's card metadata among those timm's configs name.
_HUB_LICENSES = ("apache-2.0", "mit", "bsd-3-clause", "cc-by-4.0", "cc-by-nc-4.0", "cc-by-sa-4.0", "cc-by-nc-sa-4.0")


def hub_license(name: str | None) -> dict[str, Any]:
    """The card metadata of a licence: its Hub identifier, or ``other`` with ``license_name`` (the Hub's form for a
    licence it has no identifier for, such as timm's ``dinov3-license``); nothing for ``None``."""
    if name is None:
        return {}
    return {"license": name} if name in _HUB_LICENSES else {"license": "other", "license_name": name}


def timm_hub_copy(reference: str | None, tag: str | None) -> str | None:
    """timm's own Hub repository for the reference's weights under ``tag`` (``timm/cait_xxs24_224.fb_dist_in1k``), if any."""
    if not reference or not tag:
        return None
    import timm

    cfg = timm.models.get_pretrained_cfg(f"{reference}.{tag}")
    hub_id = getattr(cfg, "hf_hub_id", None)
    return hub_id if hub_id and hub_id.startswith("timm/") else None


def build_model_card(
    conversion: Any,
    *,
    repo_id: str,
    config: Mapping[str, Any],
    num_params: int,
    command: str,
    gate_summary: str | None = None,
    plot: str | None = None,
) -> Any:
    """The ``huggingface_hub.ModelCard`` (``str(card)`` is the README) of a folder exported from ``conversion``
    (a :class:`~timm_layerscale.converter.ConversionResult`) with ``config`` as its ``config.json``, for the Hub id
    ``repo_id``, made by ``command``, with the :func:`~timm_layerscale.inspection.gate_summary` sentence and
    the gate plot's file name ``plot``. The card says which package loads ``config["architecture"]``; its
    ``base_model`` is timm's Hub copy of the reference's weights, if any, and its ``datasets`` are the tag's
    unless the head has other classes (a fine-tune)."""
    import timm
    from huggingface_hub import ModelCard, ModelCardData

    variant = conversion.variant
    family = variant.family
    architecture, library = config["architecture"], config.get("library", "timm")
    needs_package = library == "timm" and architecture != variant.reference
    layout = conversion.target_layout
    if library == "transformers":
        stored = f"under the names transformers' `{architecture}` saves"
    elif needs_package:
        stored = "in the **LayerScale-module layout** of [timm-layerscale](https://pypi.org/project/timm-layerscale/)"
    else:
        stored = f"in timm's own layout for `{architecture}`"
    source_layout = family.layouts[conversion.source_layout]
    pcfg = dict(config.get("pretrained_cfg", {}))
    tag = str(pcfg.get("tag") or "")
    full_name = f"{architecture}.{tag}" if tag else architecture
    classifier = config.get("num_classes") != 0  # 0: a backbone saved without its head
    # A head of other classes than the tag's weights (a fine-tune) was not trained on the tag's data.
    tag_classes = tag and getattr(timm.models.get_pretrained_cfg(full_name), "num_classes", None)
    trained = bool(tag) and (not classifier or config.get("num_classes") == tag_classes)
    datasets = sorted({ds for key, ds in _DATASETS.items() if trained and key in tag}) or None
    task = "image-classification" if classifier else "image-feature-extraction"
    data = ModelCardData(
        library_name=library,
        **hub_license(pcfg.get("license") or family.license),
        tags=[task, library, "layerscale", family.name, "timm-layerscale"],
        datasets=datasets,
        pipeline_tag=task,
        model_name=full_name,
        base_model=timm_hub_copy(variant.reference, tag),
    )

    source, source_name, sha = conversion.source, conversion.source_path.name, conversion.source_sha256
    if source.startswith(URL_PREFIXES):  # without credentials: ConversionResult.source
        source_file = f"[{source_name}]({source})"
    else:
        source_file = _md_code(source if source.startswith("hf-hub:") else source_name)
    paper = pcfg.get("paper_name")
    ids = str(pcfg.get("paper_ids", ""))
    if paper and ids.startswith("arXiv:"):
        paper += f", https://arxiv.org/abs/{ids.split(':', 1)[1]}"
    report = conversion.report
    reference = report.reference if report is not None else variant.reference
    size = pcfg.get("input_size", (3, variant.img_size, variant.img_size))
    template = resources.files(__package__).joinpath("card_template.md").read_text(encoding="utf-8")
    card = ModelCard.from_template(
        data,
        template_str=template,
        full_name=full_name,
        title=family.full_title or family.title,
        short_title=family.title,
        description=family.description,
        source_code=_md_code(source_name),
        family=family.name,
        in_timm=variant.reference is not None,
        layout=layout,
        needs_package=needs_package,
        architecture=architecture,
        reference=reference,
        params_m=f"{num_params / 1e6:.1f}",
        image_size=f"{size[-2]} x {size[-1]}",
        init_value=f"{variant.init_value:g}" if variant.init_value is not None else None,
        num_classes=config.get("num_classes"),
        classifier=classifier,
        labelled="label_names" in config,
        dataset_names=", ".join(datasets or []),
        paper=paper,
        origin_url=pcfg.get("origin_url"),
        layout_rows=conversion.renamed,
        stored=stored,
        changed=conversion.changed,
        container=source_layout.container if source_layout.wrapper or source_layout.prefix else None,
        source_file=source_file,
        source_sha256=sha,
        source_layout=conversion.source_layout,
        version=__version__,
        weights_name=WEIGHTS_NAME,
        command=command,
        **_parity_values(report),
        gate_summary=gate_summary,
        plot=plot,
        repo_id=repo_id,
        bibtex=family.bibtex,
        paper_name=pcfg.get("paper_name"),
        paper_ids=pcfg.get("paper_ids") or "",
    )
    return card


def _md_code(text: str) -> str:
    return "`" + text.replace("`", "'") + "`"


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
    count = f"{report.weights_compared} tensors of the written file equal to the source's"
    weights = {True: count, None: "not compared", False: "DIFFERENT"}[report.weights_equal]
    return {
        "table": report.to_markdown(),
        "parity_reference": report.reference,
        "verdict": verdict,
        "weights_check": weights,
    }
