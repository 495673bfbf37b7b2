"""CaiT with LayerScale modules (``ls1.gamma`` / ``ls2.gamma``), the layout of timm's ViT and DeiT-III.

Paper: Touvron et al., "Going deeper with Image Transformers", ICCV 2021, https://arxiv.org/abs/2103.17239

timm's ``Cait`` built with blocks whose gates are LayerScale modules instead of raw ``gamma_1`` / ``gamma_2``
parameters; the official weights (``fb_dist_in1k``, https://github.com/facebookresearch/deit) remapped as they
load. Beyond timm's CaiT: ``dynamic_img_size``, pretrained loading at another ``img_size``,
``folded_layerscale``, ``attn_impl`` and ``init_values="auto"``.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn as nn
from timm.layers import DropPath, Mlp, PatchEmbed
from timm.models import generate_default_cfgs
from timm.models._manipulate import checkpoint_seq
from timm.models.cait import Cait, ClassAttn, TalkingHeadAttn

from ..conversion.checkpoint import unwrap_state_dict
from ..conversion.rules import to_layerscale
from ..families import Variant, variants_of
from ..families.cait import GATES, RELEASE_URL
from ..layer_scale import LayerScale, cait_init_value, fold_block, fold_plan
from ..layers.talking_heads import attention_workspace, buffered_attention, eager_inference, fast_attention
from ._helpers import (
    add_pos_embed,
    build_variant,
    check_global_pool,
    count_flops,
    fit_state_dict,
    has_no_layerscale,
    pretrained_cfg,
    prune_blocks,
    register_variants,
    reset_head,
    run_blocks,
    to_nchw,
)

torch.fx.wrap("add_pos_embed")

__all__ = ["BufferedTalkingHeadAttn", "CaitLS", "FastTalkingHeadAttn", "LayerScaleBlock", "LayerScaleBlockClassAttn"]


class BufferedTalkingHeadAttn(TalkingHeadAttn):
    """timm's ``TalkingHeadAttn`` whose CPU inference keeps its ``(B, H, N, N)`` tensors in three reused
    buffers, bit-identical to timm's (:func:`~timm_layerscale.layers.talking_heads.buffered_attention`);
    elsewhere, and with frozen head mixes (where ``matmul`` takes a stride-dependent path), timm's own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if eager_inference(self, x) and self.proj_l.weight.requires_grad and self.proj_w.weight.requires_grad:
            return self._buffered(x)
        return super().forward(x)

    @torch.jit.ignore
    def _buffered(self, x: torch.Tensor) -> torch.Tensor:
        return buffered_attention(self, x)


class FastTalkingHeadAttn(TalkingHeadAttn):
    """timm's ``TalkingHeadAttn`` whose CPU inference mixes the heads with one GEMM each, within
    :data:`~timm_layerscale.layers.talking_heads.FAST_ATTN_RTOL` of timm's (never bit-exact); elsewhere timm's own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._fast(x) if eager_inference(self, x) else super().forward(x)

    @torch.jit.ignore
    def _fast(self, x: torch.Tensor) -> torch.Tensor:
        return fast_attention(self, x)


#: ``attn_impl`` values of :class:`CaitLS` and their attention.
ATTN_IMPLS = {"reference": TalkingHeadAttn, "buffered": BufferedTalkingHeadAttn, "fast": FastTalkingHeadAttn}


class LayerScaleBlock(nn.Module):
    """timm's ``LayerScaleBlock`` (timm's arguments) with LayerScale modules: tokens ``(B, N, C)``,
    ``x + drop_path(ls1(attn(norm1(x))))``, then ``x + drop_path(ls2(mlp(norm2(x))))``."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = False,
        proj_drop: float = 0.0,
        attn_drop: float = 0.0,
        drop_path: float = 0.0,
        act_layer: type[nn.Module] = nn.GELU,
        norm_layer: Callable[..., nn.Module] = nn.LayerNorm,
        attn_block: Callable[..., nn.Module] = TalkingHeadAttn,
        mlp_block: Callable[..., nn.Module] = Mlp,
        init_values: float | None = 1e-4,
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        # Gates multiply with type promotion, as the official ``gamma_1 * x``: autocast runs their arithmetic.
        gate = (lambda: LayerScale(dim, init_values, promote=True, **dd)) if init_values is not None else nn.Identity
        self.norm1 = norm_layer(dim, **dd)
        self.attn = attn_block(
            dim, num_heads=num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop, proj_drop=proj_drop, **dd
        )
        self.ls1 = gate()
        self.drop_path = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        self.norm2 = norm_layer(dim, **dd)
        self.mlp = mlp_block(
            in_features=dim, hidden_features=int(dim * mlp_ratio), act_layer=act_layer, drop=proj_drop, **dd
        )
        self.ls2 = gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path(self.ls1(self.attn(self.norm1(x))))
        return x + self.drop_path(self.ls2(self.mlp(self.norm2(x))))

    def reparameterize(self) -> None:
        """Fold ``ls1`` into ``attn.proj`` and ``ls2`` into ``mlp.fc2``, as ``timm.utils.reparameterize_model`` asks."""
        fold_block(self, fold_plan(self, GATES))


class LayerScaleBlockClassAttn(LayerScaleBlock):
    """timm's ``LayerScaleBlockClassAttn`` with LayerScale modules: patches ``(B, N, C)`` and the class token
    ``(B, 1, C)`` to the class token."""

    def __init__(
        self, dim: int, num_heads: int, attn_block: Callable[..., nn.Module] = ClassAttn, **kwargs: Any
    ) -> None:
        super().__init__(dim, num_heads, attn_block=attn_block, **kwargs)

    def forward(self, x: torch.Tensor, x_cls: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        u = torch.cat((x_cls, x), dim=1)
        x_cls = x_cls + self.drop_path(self.ls1(self.attn(self.norm1(u))))
        return x_cls + self.drop_path(self.ls2(self.mlp(self.norm2(x_cls))))


class CaitLS(Cait):
    """CaiT (Class-Attention in Image Transformers) with LayerScale modules.

    Takes timm's ``Cait`` arguments (``img_size``, ``embed_dim``, ``depth``, ``num_heads``, ``block_layers``,
    ``attn_block``, ``mlp_block``, ...) with this package's blocks as defaults, and:

    Args:
        init_values: LayerScale initial value; ``"auto"``: :func:`~timm_layerscale.layer_scale.cait_init_value`
            of ``depth``; ``None``: no LayerScale.
        dynamic_img_size: Take any input size divisible by the patch size, the position embedding resampled.
        dynamic_img_pad: Pad inputs to a multiple of the patch size.
        folded_layerscale: Build without LayerScale modules, for weights whose gates were folded into
            ``attn.proj`` and ``mlp.fc2``; pretrained weights are folded as they load.
        attn_impl: Talking-heads attention, where ``attn_block`` is not given: ``"reference"`` (timm's),
            ``"buffered"`` (CPU inference in reused buffers, bit-identical) or ``"fast"`` (fewer copies,
            within a tolerance). All three train as timm's.
    """

    __jit_unused_properties__: typing.ClassVar[list[str]] = ["folded_layerscale"]  # not compiled by TorchScript

    def __init__(
        self,
        *,
        init_values: float | str | None = 1e-4,
        dynamic_img_size: bool = False,
        dynamic_img_pad: bool = False,
        folded_layerscale: bool = False,
        attn_impl: str = "reference",
        attn_block: Callable[..., nn.Module] | None = None,
        patch_layer: Callable[..., nn.Module] = PatchEmbed,
        **kwargs: Any,
    ) -> None:
        if init_values == "auto":
            init_values = cait_init_value(kwargs.get("depth", 12))
        elif isinstance(init_values, str):
            raise ValueError(f"init_values must be a number, 'auto' or None, got {init_values!r}")
        if attn_block is None and attn_impl not in ATTN_IMPLS:
            raise ValueError(f"attn_impl must be one of {', '.join(map(repr, ATTN_IMPLS))}, got {attn_impl!r}")
        check_global_pool(kwargs.get("global_pool", "token"))
        patch = {
            "dynamic_img_pad": dynamic_img_pad,
            **({"strict_img_size": False, "output_fmt": "NHWC"} if dynamic_img_size else {}),
        }
        kwargs.setdefault("block_layers", LayerScaleBlock)
        kwargs.setdefault("block_layers_token", LayerScaleBlockClassAttn)
        args: dict[str, Any] = {
            "attn_block": attn_block or ATTN_IMPLS[attn_impl],
            "patch_layer": partial(patch_layer, **patch),
        }
        super().__init__(init_values=None if folded_layerscale else init_values, **args, **kwargs)  # type: ignore[arg-type]
        self.dynamic_img_size = dynamic_img_size
        self.init_values = None if folded_layerscale else init_values
        self.num_prefix_tokens = 1  # timm 1.0.26 does not set it

    @property
    def folded_layerscale(self) -> bool:
        return has_no_layerscale(self)

    def _init_weights(self, m: nn.Module) -> None:  # a meta build has no values to draw (timm's draws take seconds)
        if not any(p.is_meta for p in m.parameters(recurse=False)):
            super()._init_weights(m)

    def _patch_tokens(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        x = self.patch_embed(x)
        fixed: tuple[int, int] = self.patch_embed.grid_size  # type: ignore[assignment]
        grid = (x.shape[1], x.shape[2]) if self.dynamic_img_size else fixed
        return add_pos_embed(x, self.pos_embed, fixed, self.dynamic_img_size), grid

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:  # dynamic_img_size, and the shared buffers
        x = self.pos_drop(self._patch_tokens(x)[0])
        if torch.jit.is_scripting():
            x = self.blocks(x)
        elif self.grad_checkpointing:
            x = checkpoint_seq(self.blocks, x)
        else:
            with attention_workspace():
                x = self.blocks(x)
        return self.norm(self.forward_cls(x))

    def forward_cls(self, x: torch.Tensor) -> torch.Tensor:  # timm 1.0.26 has none
        """Patch tokens ``(B, N, C)`` through the class-attention blocks, the class token prepended: ``(B, 1 + N, C)``."""
        if self.cls_token is None or self.blocks_token_only is None:  # pruned with the head
            return x
        cls_tokens = self.cls_token.expand(x.shape[0], -1, -1)
        for blk in self.blocks_token_only:
            cls_tokens = blk(x, cls_tokens)
        return torch.cat((cls_tokens, x), dim=1)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:  # timm 1.0.26 pools from token 1
        if self.global_pool == "avg":
            x = x[:, self.num_prefix_tokens :].mean(dim=1)
        elif self.global_pool == "token":
            x = x[:, 0]
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    def forward_intermediates(
        self,
        x: torch.Tensor,
        indices: int | list[int] | None = None,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
    ) -> list[torch.Tensor] | tuple[torch.Tensor, list[torch.Tensor]]:  # dynamic_img_size
        """timm's ``forward_intermediates``: the outputs of the self-attention blocks ``indices`` selects (the
        last ``n`` for an int), as ``(B, C, H, W)`` (``'NCHW'``) or ``(B, N, C)`` (``'NLC'``)."""
        if output_fmt not in ("NCHW", "NLC"):
            raise ValueError(f"output_fmt must be 'NCHW' or 'NLC', got {output_fmt!r}")
        x, grid = self._patch_tokens(x)
        x, intermediates = run_blocks(self, self.pos_drop(x), indices, norm, stop_early)
        if output_fmt == "NCHW":
            intermediates = to_nchw(intermediates, grid)
        if intermediates_only:
            return intermediates
        return self.norm(self.forward_cls(x)), intermediates

    def prune_intermediate_layers(
        self, indices: int | list[int] = 1, prune_norm: bool = False, prune_head: bool = True
    ) -> list[int]:  # timm 1.0.26 keeps the class token and an empty list of blocks
        take = prune_blocks(self, indices, prune_norm)
        if prune_head:
            self.blocks_token_only, self.cls_token, self.num_prefix_tokens = None, None, 0  # type: ignore[assignment]
            self.reset_classifier(0, "")
        return take

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        reset_head(self, num_classes, global_pool)  # timm 1.0.26 builds the head on the default device, in train mode

    @torch.jit.ignore
    def group_matcher(
        self, coarse: bool = False
    ) -> Callable[[str], float]:  # timm's fails once blocks_token_only is pruned
        def matcher(name: str) -> float:
            if name.startswith(("cls_token", "pos_embed", "patch_embed")):
                return 0
            if name.startswith("blocks."):
                return int(name.split(".")[1]) + 1
            if name.startswith("blocks_token_only."):  # beside the last self-attention blocks
                return int(name.split(".")[1]) + len(self.blocks) - len(self.blocks_token_only or ()) + 1
            return len(self.blocks) if name.startswith("norm.") else float("inf")

        return matcher

    @torch.jit.ignore
    def flop_count(self, batch_size: int = 1) -> int:
        """Multiplications of one forward pass at the model's ``img_size``
        (:func:`~timm_layerscale.models._helpers.count_flops`)."""
        return count_flops(self, batch_size)


def checkpoint_filter_fn(state_dict: dict[str, torch.Tensor], model: CaitLS) -> dict[str, torch.Tensor]:
    """Any CaiT checkpoint in this model's layout: the official file (``{'model': {'module.' + key: ...}}``),
    timm's ``cait_*`` state dict or the ``ls`` layout, ``pos_embed`` resampled to the model's grid and the gates
    folded for a ``folded_layerscale`` model."""
    return fit_state_dict(to_layerscale(unwrap_state_dict(state_dict), "cait"), model)


#: The registered variants (:data:`timm_layerscale.families.VARIANTS`).
VARIANTS = variants_of("cait")


def _cfg(v: Variant) -> dict[str, Any]:
    return pretrained_cfg(
        v,
        url=RELEASE_URL + str(v.official_file),
        hf_hub_id=f"timm/{v.reference}.fb_dist_in1k",
        paper_ids="arXiv:2103.17239",
        paper_name="Going deeper with Image Transformers",
        origin_url="https://github.com/facebookresearch/deit",
    )


default_cfgs = generate_default_cfgs({f"{name}.fb_dist_in1k": _cfg(v) for name, v in VARIANTS.items()})


register_variants(
    __name__, VARIANTS, lambda v, pretrained, kwargs: build_variant(CaitLS, checkpoint_filter_fn, v, pretrained, kwargs)
)
