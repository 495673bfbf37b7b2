"""The loaders native to layouts that several families share (``Layout.native``): this package's and timm's models
read strictly, the authors' key set checked before timm's filter of their files, and transformers' own loading of a
transformers folder; torch, timm and transformers (the optional extra ``timm-layerscale[transformers]``) are
imported only when one is called."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

from ..errors import RemapError, option
from . import DEFAULT_NUM_CLASSES, Layout, Rule, Variant, state_dict_shapes

__all__ = ["authors_keys", "native_transformers", "own_model", "read_config", "timm_model", "transformers_layout"]
__all__ += ["timm_filtered", "without", "without_progress_bars"]

Filter = Callable[[dict[str, Any], Any], Any]


def own_model(variant: Variant, folded: bool, args: dict[str, Any]) -> Any:
    """The ``native`` loader of this package's own layout: its registered model, read strictly."""
    return timm_model(variant.name, {**args, **({"folded_layerscale": True} if folded else {})})


def timm_model(name: str, args: dict[str, Any], filter_fn: Filter | None = None) -> Any:
    """The ``native`` loader of timm's model ``name`` built with ``args``, reading a state dict through ``filter_fn``
    (default: as it is, strictly, as ``load_state_dict`` does)."""
    import timm

    return lambda: timm.create_model(name, **args), filter_fn or (lambda sd, model: sd)


def timm_filtered(module: str) -> Callable[[Variant, bool, dict[str, Any]], Any]:
    """The ``native`` loader of the authors' files that timm reads: a variant's timm twin (the authors' math) through
    the ``checkpoint_filter_fn`` of ``timm.models.<module>`` (which also takes a DDP prefix off)."""

    def native(variant: Variant, folded: bool, args: dict[str, Any]) -> Any:
        import importlib

        filter_fn = importlib.import_module(f"timm.models.{module}").checkpoint_filter_fn
        return timm_model(str(variant.reference), args, filter_fn)

    return native


def without(parts: str, filter_fn: Filter = lambda sd, model: sd) -> Filter:
    """``filter_fn`` on a state dict without the keys matching ``parts``, which the consumer's own loading leaves out:
    a training checkpoint's objective heads (the official evaluation code loads the backbone alone), a multimodal
    checkpoint's parts beside its vision tower."""
    return lambda sd, model: filter_fn({k: v for k, v in sd.items() if not re.fullmatch(parts, k)}, model)


def authors_keys(required: Collection[str], optional: str, what: str, filter_fn: Filter) -> Filter:
    """``filter_fn`` behind a check that a state dict has the key set of the authors' model ``what`` (its
    ``load_state_dict(strict=True)``): every ``required`` key, and beyond them only keys matching ``optional``.

    Raises:
        RemapError: Keys missing or unexpected, the first of each named.
    """

    def check(state_dict: dict[str, Any], model: Any) -> Any:
        missing = sorted(k for k in required if k not in state_dict)
        unexpected = sorted(k for k in state_dict if k not in required and not re.fullmatch(optional, k))
        kinds = (("missing", missing), ("unexpected", unexpected))
        if found := "; ".join(f"{len(ks)} {kind} (first {ks[0]})" for kind, ks in kinds if ks):
            raise RemapError(f"checkpoint does not fit the authors' {what}: {found}")
        return filter_fn(state_dict, model)

    return check


#: Fields of a transformers config that shape the function its model computes at inference (others are training
#: settings, bookkeeping, or shapes the tensors themselves check; ``layer_norm_eps`` is verified with its measured
#: effect added to the bound, since public folders keep transformers' default 1e-12).
_FUNCTION = {"hidden_act", "rope_theta", "query_bias", "key_bias", "value_bias", "proj_bias"}
_FUNCTION |= {"mlp_bias", "use_gated_mlp", "use_swiglu_ffn", "qkv_bias", "num_attention_heads", "patch_size"}
_FUNCTION |= {"num_register_tokens", "hidden_size", "num_hidden_layers", "use_mean_pooling"}
_FUNCTION |= {"use_relative_position_bias", "use_absolute_position_embeddings"}


def read_config(
    fields: Mapping[str, Any],
    where: str,
    config: Callable[[Variant, Mapping[str, tuple[int, ...]]], Any],
    variant: Variant,
    img_size: int | None,
) -> Any:
    """The transformers config whose ``config.json`` (at ``where``) holds ``fields`` (of the class its ``model_type``
    names), equal to the one ``config`` builds for ``variant`` (at ``img_size``, default its own) in every field that
    shapes it.

    Raises:
        RemapError: A field differs (a fine-tune with another norm epsilon, rotary base or activation); the first
            named, since the model this package builds would compute another function.
    """
    from transformers import CONFIG_MAPPING

    want = config(variant, state_dict_shapes(variant, 0))
    want.image_size = img_size or want.image_size
    kind = CONFIG_MAPPING[t] if (t := str(fields.get("model_type"))) in CONFIG_MAPPING else type(want)
    got = kind.from_dict(dict(fields))
    theirs, ours = got.to_dict(), want.to_dict()
    for name in sorted(ours.keys() & _FUNCTION):
        if name in theirs and theirs[name] != ours[name]:
            raise RemapError(
                f"{where} has {name}={theirs[name]!r} where {variant.name} has {ours[name]!r}; this package's model "
                "would compute another function, so the folder is not converted"
            )
    return got


@contextlib.contextmanager
def without_progress_bars() -> Iterator[None]:
    """transformers' loading bars off within (this package shows its own, silent with ``-q``), restored after."""
    from transformers.utils import logging

    bars = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if bars:
            logging.enable_progress_bar()


def native_transformers(
    config: Callable[[Any, Mapping[str, tuple[int, ...]]], Any], variant: Variant, args: dict[str, Any], any_size: bool
) -> Any:
    """``(build, filter)`` of transformers' model for a variant (``AutoModel``'s of its config, built from the
    registered model's shapes by ``config(variant, shapes)``, at ``args``' ``img_size``, or the source's own config
    given as ``args['config']``): the filter is transformers' own loading (``from_pretrained`` of a folder holding
    the tensors, with every rename its version applies), strict. The model's ``forward_features(x)`` and ``forward(x)``
    are its normed token sequence ``(B, N, C)``; its ``dynamic_img_size`` is ``any_size``: whether it computes timm's
    function at every input size (rotary positions), not only at the variant's (a position embedding it resamples
    its own way).

    Raises:
        RemapError: transformers is not installed, or the tensors leave keys of its model missing or unexpected.
    """
    try:
        import transformers
    except ImportError:
        raise RemapError(
            "verifying a transformers layout needs transformers: pip install 'timm-layerscale[transformers]', "
            f"or pass {option('no_verify')}"
        ) from None
    import tempfile

    from safetensors.torch import save_file
    from torch import nn

    # a family compared on its tokens is read as transformers' backbone, which has no classifier
    classes = 0 if variant.family.tokens else args.get("num_classes", DEFAULT_NUM_CLASSES)
    cfg = args.get("config") or config(variant, state_dict_shapes(variant, classes))
    if "img_size" in args and "config" not in args:
        cfg.image_size = args["img_size"]
    cls = transformers.AutoModelForImageClassification if classes else transformers.AutoModel
    cfg.num_labels = classes or cfg.num_labels

    class Backbone(nn.Module):
        """transformers' model: its normed tokens as ``forward_features``; as ``forward``, its logits where it has a
        classifier, else its pooled output (a family compared on its tokens: the tokens)."""

        def __init__(self) -> None:
            super().__init__()
            self.model = cls.from_config(cfg)
            # what verification and the report read of a model's attention (timm's flag)
            self.fused_attn = self.model.config._attn_implementation == "sdpa"
            self.dynamic_img_size = any_size

        def forward_features(self, x: Any) -> Any:
            return self.model(pixel_values=x).last_hidden_state

        def forward(self, x: Any) -> Any:
            out = self.model(pixel_values=x)
            return out.logits if classes else out.last_hidden_state if variant.family.tokens else out.pooler_output

    def load(state_dict: dict[str, Any], model: nn.Module) -> dict[str, Any]:
        with tempfile.TemporaryDirectory() as folder, without_progress_bars():
            cfg.save_pretrained(folder)
            save_file({k: v.contiguous() for k, v in state_dict.items()}, f"{folder}/model.safetensors")
            loaded, info = cls.from_pretrained(folder, output_loading_info=True)
        bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
        if bad:
            raise RemapError(f"transformers' {type(loaded).__name__} does not take these tensors: {bad}")
        return {f"model.{k}": v for k, v in loaded.state_dict().items()}

    return Backbone, load


def transformers_layout(
    read: tuple[Rule, ...], write: tuple[Rule, ...], config: Callable[..., Any], tell: str, any_size: bool
) -> Layout:
    """A family's ``transformers`` layout: its rules, its ``tell``, ``config(variant, shapes)`` of its model, read by
    :func:`native_transformers` (``any_size``: transformers' model computes timm's function at every input size)."""
    native = lambda v, folded, args: native_transformers(config, v, args, any_size)  # noqa: E731
    return Layout("transformers", read, write, native, tell=tell, library=True, config=config)
