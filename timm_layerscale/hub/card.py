"""The files that describe an exported folder: timm's ``config.json`` and the model card.

:func:`write_config` writes ``config.json`` with timm's own helper, so
``timm.create_model("local-dir:DIR")`` (or ``"hf-hub:ORG/NAME"``) builds the right
architecture. :func:`build_model_card` writes the ``README.md`` text: Hub metadata,
model details, the layout change, provenance, the parity table, a summary of the
LayerScale gates, usage code and the citation. Everything here is local: nothing
is downloaded or sent.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Mapping, Sequence
from urllib.parse import urlparse

from .._version import __version__

__all__ = ["build_model_card", "write_config", "WEIGHTS_NAME", "CONFIG_NAME", "CARD_NAME", "PLOT_NAME"]

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
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
    model_name: str, path: str | os.PathLike, *, num_classes: int | None = None, extra: Mapping[str, Any] | None = None
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
    license_id = pcfg.get("license") or ("apache-2.0" if family == "cait" else None)
    datasets = sorted({ds for key, ds in _DATASETS.items() if tag and key in tag})
    if family == "cait" and not datasets:
        datasets = ["imagenet-1k"]
    data = ModelCardData(
        library_name="timm",
        license=license_id,
        tags=["image-classification", "timm", "layerscale", family, "timm-layerscale"],
        datasets=datasets or None,
        pipeline_tag="image-classification",
        model_name=full_name,
    )

    title, what = _FAMILY_TEXT.get(family, (family, "a Vision Transformer with LayerScale"))
    size = pcfg.get("input_size", (3, variant.img_size, variant.img_size))
    source = conversion.source
    source_name = conversion.source_path.name
    origin = f"[{source_name}]({source})" if source.startswith(("https://", "http://")) else _md_code(source if source.startswith("hf-hub:") else source_name)
    report = conversion.report
    reference = report.reference if report is not None else variant.reference
    lines: list[str] = []
    add = lines.append
    add(f"# Model card for {full_name}")
    add("")
    official = _official_file(variant.name)
    weights = (
        f"These are the official weights released with the paper (`{source_name}`)"
        if official == source_name
        else f"The weights come from `{source_name}`"
    )
    add(
        f"A {title} image classification model: {what}. {weights}, stored in the **LayerScale-module layout** of "
        f"[timm-layerscale](https://pypi.org/project/timm-layerscale/) (`ls1.gamma` / `ls2.gamma`) instead of the "
        f"original raw `gamma_1` / `gamma_2` parameters. Only key names differ: every tensor value is copied bit for bit."
    )
    add("")
    add("## Model details")
    add("")
    add(f"- **Architecture:** `{variant.name}`, registered with timm by `import timm_layerscale`")
    if reference:
        add(f"- **Reference:** {_reference_text(family, reference)}, which computes the same function from the original layout")
    add("- **Model type:** image classification / feature backbone")
    add(f"- **Params (M):** {num_params / 1e6:.1f}")
    add(f"- **Image size:** {size[-2]} x {size[-1]}")
    if variant.init_value is not None:
        add(f"- **LayerScale init value (training):** {variant.init_value:g}")
    add(f"- **Classes:** {config.get('num_classes')}")
    if datasets:
        add(f"- **Dataset:** {', '.join(datasets)}")
    if pcfg.get("paper_name"):
        paper = pcfg["paper_name"]
        ids = str(pcfg.get("paper_ids", ""))
        link = f"https://arxiv.org/abs/{ids.split(':', 1)[1]}" if ids.startswith("arXiv:") else ""
        add(f"- **Paper:** {paper}" + (f", {link}" if link else ""))
    if pcfg.get("origin_url"):
        add(f"- **Original code:** {pcfg['origin_url']}")
    add("")
    add("## Layout change")
    add("")
    add("| original key | key in this repository | what it is |")
    add("|---|---|---|")
    for before, after, note in _LAYOUT_ROWS.get(family, _GENERIC_LAYOUT_ROWS):
        add(f"| `{before}` | `{after}` | {note} |")
    add("")
    add(
        "Every other key keeps its name; the training checkpoint's wrapper (`{'model': ...}`) is removed. "
        "LayerScale as a module is the layout timm already uses for its ViT and DeiT III models, so the gates "
        "can be found, frozen, fused or excluded from weight decay by module type."
    )
    add("")
    add("## Provenance")
    add("")
    add(f"- **Source file:** {origin}")
    add(f"- **Source sha256:** `{conversion.source_sha256}`")
    add(f"- **Source layout:** `{conversion.source_layout}`")
    add(f"- **Converter:** timm-layerscale {__version__}")
    add(f"- **Weights:** `{WEIGHTS_NAME}` (safetensors; metadata records the source file, its sha256 and both layouts)")
    add("")
    add("Made with:")
    add("")
    add("```bash")
    add(command)
    add("```")
    add("")
    add("## Parity")
    add("")
    if report is not None:
        if report.bit_exact and report.passed:
            verdict = "**bit-exact**: every output equals the reference's (`torch.equal`)"
        else:
            verdict = (
                f"**within tolerance** `|ref - out| <= {report.atol:g} + {report.rtol:g} * |ref|` "
                f"({report.tolerance_reason}); largest difference {report.max_abs_diff:.3g}"
            )
        add(
            f"The converted model was run against the reference `{report.reference}` loaded from the source file, "
            f"on the same inputs. Result: {verdict}. Every converted tensor was compared with its source tensor: "
            f"{'identical' if report.weights_equal else 'not compared' if report.weights_equal is None else 'DIFFERENT'}."
        )
        add("")
        add(report.to_markdown())
    else:
        add("No reference model exists for this family in timm, so no output comparison was made.")
    if reload_checked:
        add("")
        add(
            "After writing, the folder was loaded back with `timm.create_model(\"local-dir:...\", pretrained=True)` "
            "and its weights compared with the verified model: identical."
        )
    add("")
    if gates:
        add("## LayerScale gates")
        add("")
        if plot:
            add(f"![Mean and range of |gamma| per block for the attention (ls1) and MLP (ls2) gates]({plot})")
            add("")
        add(_gate_summary(gates))
        add("")
    add("## Usage")
    add("")
    add("```bash")
    add("pip install timm-layerscale")
    add("```")
    add("")
    add("```python")
    add("import timm_layerscale  # registers the LayerScale models with timm; import it first")
    add("import timm")
    add("import torch")
    add("from PIL import Image")
    add("")
    add(f'model = timm.create_model("hf-hub:{repo_id}", pretrained=True).eval()')
    add("config = timm.data.resolve_data_config({}, model=model)")
    add("transform = timm.data.create_transform(**config)")
    add("")
    add('image = Image.open("image.jpg").convert("RGB")')
    add("with torch.no_grad():")
    add("    probs = model(transform(image).unsqueeze(0)).softmax(dim=-1)")
    add("top5 = probs.topk(5)")
    add("print(top5.indices, top5.values)")
    add("```")
    add("")
    add("## Citation")
    add("")
    if family in BIBTEX:
        add("```bibtex")
        add(BIBTEX[family])
        add("```")
    else:
        add(_generic_citation(pcfg))
    add("")
    body = "\n".join(lines)
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}")


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
            parts.append(f"{label} gates (`{which}`) have mean |gamma| from {lo[0]:.3g} (`{lo[1]}`) to {hi[0]:.3g} (`{hi[1]}`)")
    ca = sum(1 for r in gates if r.get("class_attn"))
    where = f" over {len(gates) - ca} self-attention and {ca} class-attention blocks" if ca else f" over {len(gates)} blocks"
    text = "; ".join(parts) + where + "."
    return text[0].upper() + text[1:] + " Print the full table with `timm-layerscale inspect hf-hub:...`."
