"""An exported folder's ``config.json`` and the class names it may carry.

:func:`write_config` writes timm's ``config.json`` with timm's own helper, then keeps
under ``model_args`` only what the architecture's defaults do not give. Both loaders
read that file: ``timm.create_model("local-dir:DIR")`` builds the architecture with
``num_classes`` and ``model_args``, and transformers' ``TimmWrapper`` calls
``timm.create_model(architecture, num_classes=num_labels, **model_args)``, which fails
when ``model_args`` repeats ``num_classes``. :func:`read_label_names` reads a class-name
file for a fine-tuned model's ``label_names``; :func:`read_folder_config` reads what a
source folder's own ``config.json`` says of its classes and tag.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..conversion.detect import timm_args
from ..errors import CheckpointError, option
from ..files.sources import source_config

__all__ = ["write_config", "read_label_names", "read_folder_config", "pretrained_tags"]


def _timm_config(model: Any, model_config: Mapping[str, Any]) -> dict[str, Any]:
    """What ``timm.models.save_config_for_hf`` writes for ``model``, as a dict."""
    from timm.models._hub import save_config_for_hf

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        save_config_for_hf(model, path, model_config=dict(model_config))  # type: ignore[arg-type]  # timm before 1.0.31 calls path.open()
        return json.loads(path.read_text(encoding="utf-8"))


def write_config(
    model_name: str,
    path: str | os.PathLike[str],
    *,
    model_args: Mapping[str, Any] | None = None,
    label_names: Sequence[str] | None = None,
    label_descriptions: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Write timm's ``config.json`` for a registered model.

    The model is built on the ``meta`` device (no memory, no weights) and passed to
    ``timm.models.save_config_for_hf``, which records ``architecture``,
    ``num_classes``, ``num_features`` and the ``pretrained_cfg`` (input size, crop,
    mean/std, interpolation). ``model_args`` keeps only the arguments whose value
    differs from the architecture's default, and never ``num_classes`` (the top-level
    field says it), as timm writes it when a caller passes none; an ``img_size`` is
    always kept there, and the input size follows it.

    Args:
        model_name: Registered model name (``cait_s24_224_ls``), optionally with a
            pretrained tag timm registers for it (``deit3_small_patch16_224.fb_in22k_ft_in1k``).
        path: The ``config.json`` to write.
        model_args: Arguments beyond the architecture's: ``num_classes`` (a classifier
            size that differs from the default), ``img_size`` (another resolution).
        label_names: One name per class (timm's ``label_names``; transformers' ``id2label``).
        label_descriptions: Name to description (timm's ``label_descriptions``).

    Returns:
        The written configuration.

    Raises:
        CheckpointError: ``label_names`` are not unique, non-empty strings, one per class,
            or the tag is unknown.
    """
    import timm
    import torch

    arch, _, tag = model_name.partition(".")
    tags = pretrained_tags(arch)
    if tag and tag not in tags:
        raise CheckpointError(f"{tag!r} is not a pretrained tag of {arch}; choose from: {', '.join(tags) or 'none'}")
    with torch.device("meta"):
        kwargs = timm_args(model_args or {})
        model = timm.create_model(model_name, **kwargs)
        default = timm.create_model(model_name) if kwargs else model
    extra: dict[str, Any] = {}
    if label_names is not None:
        _check_names(label_names, "label_names")
        if len(label_names) != model.num_classes:
            raise CheckpointError(
                f"{len(label_names)} label names for a model with {model.num_classes} classes; give one name per class"
            )
        extra["label_names"] = list(label_names)
    if label_descriptions:
        extra["label_descriptions"] = dict(label_descriptions)
    config = _timm_config(model, extra)
    defaults = _timm_config(default, {}).get("model_args", {})
    args = {k: v for k, v in config.pop("model_args", {}).items() if k != "num_classes" and defaults.get(k) != v}
    if model_args and "img_size" in model_args:  # timm before 1.0.31 does not record it
        args["img_size"] = model_args["img_size"]
    if args:
        config["model_args"] = args
    Path(path).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return config


def pretrained_tags(arch: str) -> list[str]:
    """The pretrained tags timm registers for the architecture ``arch``."""
    import timm

    return [n.partition(".")[2] for n in timm.list_pretrained(f"{arch}.*")]


def read_folder_config(source: str | os.PathLike[str]) -> tuple[Any, dict[str, str] | None, Any]:
    """The class names, their descriptions and the pretrained tag in the ``config.json`` of a
    source folder or Hub repository (:func:`~timm_layerscale.files.sources.source_config`).

    A folder exported by this package or by timm, a Hub model repository or a folder written
    by transformers' ``save_pretrained`` holds one. Other sources (a file, a URL), a folder
    without ``config.json`` and the names transformers gives a head it has no names for
    (``LABEL_0``, ``LABEL_1``, ...) give ``None``.

    Raises:
        CheckpointError: The ``config.json`` is no JSON object.
    """
    path = source_config(source)
    if path is None:
        return None, None, None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
        tag = config.get("pretrained_cfg", {}).get("tag")
    except (OSError, ValueError, AttributeError) as e:
        reason = getattr(e, "strerror", None) or e
        raise CheckpointError(
            f"cannot read {path} ({reason}); fix it, or pass {option('label_names', 'FILE')} and {option('tag', 'TAG')}"
        ) from None
    names = config.get("label_names")
    if not names or names == [f"LABEL_{i}" for i in range(len(names))]:
        return None, None, tag
    descriptions = config.get("label_descriptions")
    return names, descriptions if isinstance(descriptions, dict) else None, tag


def read_label_names(path: str | os.PathLike[str]) -> tuple[list[str], dict[str, str] | None]:
    """Read class names: a JSON list of strings, a JSON object from class index to name
    (transformers' ``id2label``: ``{"0": "tench", "1": "goldfish"}``), or one name per line.

    A line may hold ``name<TAB>description``; the descriptions then become timm's
    ``label_descriptions``. Blank lines at the end are ignored; names must be unique.

    Returns:
        The names in class order, and the descriptions by name (``None`` when the file gives none).

    Raises:
        CheckpointError: The file cannot be read, or its names are empty, not strings or repeated.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8-sig")  # a byte-order mark, as Windows editors write, is not a name
    except (OSError, UnicodeDecodeError) as e:
        reason = getattr(e, "strerror", None) or e
        raise CheckpointError(
            f"cannot read the label file {p} ({reason}); pass a UTF-8 text file, one name per line"
        ) from None
    descriptions: dict[str, str] | None = None
    if text.lstrip().startswith(("[", "{")):
        try:
            names = json.loads(text)
        except json.JSONDecodeError as e:
            raise CheckpointError(
                f"{p} is not valid JSON ({e.msg} at line {e.lineno}); fix it or write one name per line"
            ) from None
        if isinstance(names, dict):
            indices = [str(i) for i in range(len(names))]
            names = [names[i] for i in indices] if sorted(names) == sorted(indices) else None
        if not isinstance(names, list):
            raise CheckpointError(
                f"{p} is neither a list of names nor an object from every class index to a name;"
                ' write ["tench", ...] or {"0": "tench", ...}'
            )
    else:
        names, descriptions = [], {}
        for line in text.rstrip("\r\n").splitlines():
            name, _, description = line.partition("\t")
            names.append(name.strip())
            if description.strip():
                descriptions[name.strip()] = description.strip()
    _check_names(names, str(p))
    return names, descriptions or None


def _check_names(names: Sequence[Any], where: str) -> None:
    """Class names are strings, one per class, none empty and none twice."""
    wrong = [n for n in names if not isinstance(n, str)]
    if wrong:
        raise CheckpointError(f"{where} holds {wrong[0]!r}, not a name; give one string per class")
    empty = [i for i, n in enumerate(names) if not n]
    if empty or not names:
        what = f"no name for class {empty[0]}" if empty else "no class names"
        raise CheckpointError(f"{where} holds {what}; write one name per class")
    repeated = sorted(n for n, count in Counter(names).items() if count > 1)
    if repeated:
        raise CheckpointError(f"{where} names a class twice ({repeated[0]!r}); class names must be unique")
