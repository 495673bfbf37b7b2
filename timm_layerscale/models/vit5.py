"""ViT-5: a LayerScale Vision Transformer with RMSNorm, QK-norm, register tokens and 2-D rotary embeddings.

Paper: Wang et al., "ViT-5: Vision Transformers for the Mid-2020s", https://arxiv.org/abs/2602.08071.
Official code https://github.com/wangf3014/ViT-5; weights https://huggingface.co/FengWang3211/ViT-5.
The official architecture and numbers (the models guide lists them); the layout differs in LayerScale
being a module and the rotary tables being computed, the official ``*.freqs`` buffers checked and dropped.
"""

# No postponed annotations: an FX trace copies forward's into its code, where TorchScript reads them.
import typing
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import Mlp, PatchEmbed, RmsNorm, trunc_normal_, use_fused_attn
from timm.models import generate_default_cfgs
from timm.models._manipulate import checkpoint

from ..conversion.checkpoint import WRAPPER_KEYS, state_dict_of
from ..conversion.rules import to_layerscale
from ..families import DEFAULT_NUM_CLASSES, Variant, variants_of
from ..families.vit5 import HUB_REPO
from ..layer_scale import LayerScale
from ..layers.rope import RopeTables, Vit5RotaryEmbedding, apply_rope
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
from .cait_ls import LayerScaleBlock

torch.fx.wrap("add_pos_embed")

__all__ = ["Vit5", "Vit5Attention", "Vit5Block"]

_RmsNorm = partial(RmsNorm, eps=1e-6)


class Vit5Attention(nn.Module):
    """Self-attention of ``dim`` channels in ``num_heads`` heads, q and k normalised per head by
    ``norm_layer(dim / num_heads)`` (with ``qk_norm``) and rotated by the rotary tables."""

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        qkv_bias: bool = False,
        qk_norm: bool = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        norm_layer: Callable[..., nn.Module] = _RmsNorm,
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        if dim % num_heads:
            raise ValueError(f"dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.scale = self.head_dim**-0.5
        self.fused_attn = use_fused_attn()
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias, **dd)
        self.q_norm = norm_layer(self.head_dim, **dd) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(self.head_dim, **dd) if qk_norm else nn.Identity()
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim, **dd)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor, rope: RopeTables | None = None) -> torch.Tensor:
        """Tokens ``(B, N, C)`` and ``(sin, cos)`` tables ``(N, C / H)`` to ``(B, N, C)``."""
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        if self.fused_attn:
            x = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop.p if self.training else 0.0)
        else:
            x = self.attn_drop(((q * self.scale) @ k.transpose(-2, -1)).softmax(dim=-1)) @ v
        return self.proj_drop(self.proj(x.transpose(1, 2).reshape(B, N, C)))


class Vit5Block(LayerScaleBlock):
    """:class:`~timm_layerscale.models.cait_ls.LayerScaleBlock` with RMSNorm and rotary attention, which also
    takes the rotary tables; ``qk_norm`` normalises q and k per head."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        qk_norm: bool = True,
        norm_layer: Callable[..., nn.Module] = _RmsNorm,
        attn_block: Callable[..., nn.Module] = Vit5Attention,
        **kwargs: Any,
    ) -> None:
        attn = partial(attn_block, qk_norm=qk_norm, norm_layer=norm_layer)
        super().__init__(dim, num_heads, norm_layer=norm_layer, attn_block=attn, **kwargs)

    def forward(self, x: torch.Tensor, rope: RopeTables | None = None) -> torch.Tensor:
        x = x + self.drop_path(self.ls1(self.attn(self.norm1(x), rope)))
        return x + self.drop_path(self.ls2(self.mlp(self.norm2(x))))


class Vit5(nn.Module):
    """ViT-5 with LayerScale modules.

    Takes the arguments of timm's ``VisionTransformer`` that ViT-5 has (``img_size``, ``patch_size``,
    ``embed_dim``, ``depth``, ``num_heads``, ``mlp_ratio``, ``qkv_bias``, ``qk_norm``, the dropout rates, the
    layer types, ``device``, ``dtype``), with ViT-5's values as defaults, and:

    Args:
        reg_tokens: Register tokens after the patches, a square number (their rotary grid), 0 for none.
        rope_theta: Rotary base of the patches; ``reg_rope_theta``: of the registers.
        init_values: LayerScale initial value; ``None``: no LayerScale.
        folded_layerscale: Build without LayerScale modules; pretrained weights are folded as they load.
        dynamic_img_size: Take any input size divisible by the patch size (the position embedding
            resampled, the rotary positions rescaled); ``dynamic_img_pad``: pad inputs to a multiple of it.
    """

    __jit_unused_properties__: typing.ClassVar[list[str]] = ["folded_layerscale"]  # not compiled by TorchScript
    if typing.TYPE_CHECKING:  # for type checkers only, where TorchScript would take it for the attribute's type
        patch_embed: Any

    def __init__(
        self,
        img_size: int | tuple[int, int] = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        num_classes: int = DEFAULT_NUM_CLASSES,
        global_pool: str = "token",
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = False,
        qk_norm: bool = True,
        reg_tokens: int = 4,
        rope_theta: float = 10000.0,
        reg_rope_theta: float = 100.0,
        init_values: float | None = 1e-4,
        folded_layerscale: bool = False,
        drop_rate: float = 0.0,
        proj_drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        dynamic_img_size: bool = False,
        dynamic_img_pad: bool = False,
        norm_layer: Callable[..., nn.Module] = _RmsNorm,
        act_layer: type[nn.Module] = nn.GELU,
        block_layer: Callable[..., nn.Module] = Vit5Block,
        attn_block: Callable[..., nn.Module] = Vit5Attention,
        mlp_block: Callable[..., nn.Module] = Mlp,
        patch_layer: Callable[..., nn.Module] = PatchEmbed,
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        side = round(reg_tokens**0.5)
        if reg_tokens < 0 or side * side != reg_tokens:
            raise ValueError(f"reg_tokens must be a square number (0, 1, 4, 9, ...), got {reg_tokens}")
        check_global_pool(global_pool)
        self.num_classes, self.in_chans, self.global_pool = num_classes, in_chans, global_pool
        self.num_features = self.head_hidden_size = self.embed_dim = embed_dim
        self.num_prefix_tokens, self.num_reg_tokens = 1, reg_tokens
        self.dynamic_img_size, self.grad_checkpointing = dynamic_img_size, False
        self.init_values = None if folded_layerscale else init_values
        patch = {"strict_img_size": False, "output_fmt": "NHWC"} if dynamic_img_size else {}
        self.patch_embed = patch_layer(
            img_size=img_size,
            patch_size=patch_size,
            in_chans=in_chans,
            embed_dim=embed_dim,
            dynamic_img_pad=dynamic_img_pad,
            **patch,
            **dd,
        )
        self.cls_token = nn.Parameter(torch.empty(1, 1, embed_dim, **dd))
        self.reg_token = nn.Parameter(torch.empty(1, reg_tokens, embed_dim, **dd)) if reg_tokens else None
        self.pos_embed = nn.Parameter(torch.empty(1, self.patch_embed.num_patches, embed_dim, **dd))
        head_dim = embed_dim // num_heads
        self.rope = Vit5RotaryEmbedding(head_dim, tuple(self.patch_embed.grid_size), theta=rope_theta)
        self.rope_reg = Vit5RotaryEmbedding(head_dim, (side, side), theta=reg_rope_theta) if reg_tokens else None
        block = partial(
            block_layer,
            dim=embed_dim,
            num_heads=num_heads,
            mlp_ratio=mlp_ratio,
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
            proj_drop=proj_drop_rate,
            attn_drop=attn_drop_rate,
            drop_path=drop_path_rate,
            act_layer=act_layer,
            norm_layer=norm_layer,
            attn_block=attn_block,
            mlp_block=mlp_block,
            init_values=self.init_values,
            **dd,
        )
        self.blocks = nn.ModuleList([block() for _ in range(depth)])
        r = self.patch_embed.feat_ratio() if hasattr(self.patch_embed, "feat_ratio") else patch_size
        self.feature_info = [dict(num_chs=embed_dim, reduction=r, module=f"blocks.{i}") for i in range(depth)]
        self.norm = norm_layer(embed_dim, **dd)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes, **dd) if num_classes > 0 else nn.Identity()
        if not self.pos_embed.is_meta:  # a meta build is filled by load_state_dict
            self.init_weights()

    def init_weights(self) -> None:
        """As the official model: truncated normal (std 0.02) embeddings and linear weights, zero biases,
        unit norms, LayerScale at ``init_values``; the patch-embedding conv keeps PyTorch's default."""
        for p in (self.pos_embed, self.cls_token, self.reg_token):
            if p is not None:
                trunc_normal_(p, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, (RmsNorm, LayerScale)):
                m.reset_parameters()

    @property
    def folded_layerscale(self) -> bool:
        return has_no_layerscale(self)

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        return {"pos_embed", "cls_token", "reg_token"}

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> dict[str, Any]:
        return {
            "stem": r"^cls_token|^reg_token|^pos_embed|^patch_embed",
            "blocks": [(r"^blocks\.(\d+)", None), (r"^norm", (99999,))],
        }

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        reset_head(self, num_classes, global_pool)

    def rope_tables(self, grid: tuple[int, int], device: torch.device | None = None) -> RopeTables:
        """``(sin, cos)`` tables, each fp32 ``(1 + h * w + reg_tokens, C / H)``, in token order: the class
        token (identity), the patches (row-major), the registers."""
        sin, cos = self.rope.get_embed(grid, device)
        sins, coss = [sin.new_zeros(1, sin.shape[-1]), sin], [cos.new_ones(1, cos.shape[-1]), cos]
        if self.rope_reg is not None:
            reg_sin, reg_cos = self.rope_reg.get_embed(self.rope_reg.ref_grid, device)
            sins.append(reg_sin)
            coss.append(reg_cos)
        return torch.cat(sins), torch.cat(coss)

    def _tokens(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        x = self.patch_embed(x)
        fixed: tuple[int, int] = self.patch_embed.grid_size
        grid = (x.shape[1], x.shape[2]) if self.dynamic_img_size else fixed
        x = add_pos_embed(x, self.pos_embed, fixed, self.dynamic_img_size)
        tokens = [self.cls_token.expand(x.shape[0], -1, -1), x]
        if self.reg_token is not None:
            tokens.append(self.reg_token.expand(x.shape[0], -1, -1))
        return torch.cat(tokens, dim=1), grid

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Images ``(B, C_in, H, W)`` to normalised tokens ``(B, 1 + N + reg_tokens, C)``: class, patches, registers."""
        x, grid = self._tokens(x)
        rope = self.rope_tables(grid, x.device)
        for blk in self.blocks:
            x = checkpoint(blk, x, rope) if self.grad_checkpointing and not torch.jit.is_scripting() else blk(x, rope)
        return self.norm(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Tokens to logits ``(B, num_classes)``, or the pooled ``(B, C)``."""
        if self.global_pool == "avg":
            x = x[:, self.num_prefix_tokens : x.shape[1] - self.num_reg_tokens].mean(dim=1)
        elif self.global_pool == "token":
            x = x[:, 0]
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    def forward_intermediates(
        self,
        x: torch.Tensor,
        indices: int | list[int] | None = None,
        return_prefix_tokens: bool = False,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
    ) -> list[Any] | tuple[torch.Tensor, list[Any]]:
        """The outputs of the blocks ``indices`` selects (the last ``n`` for an int): their patch tokens as
        ``(B, C, h, w)`` (``'NCHW'``) or ``(B, h * w, C)`` (``'NLC'``), with ``return_prefix_tokens`` paired with
        the class token and the registers ``(B, 1 + reg_tokens, C)``; and the final tokens unless ``intermediates_only``."""
        if output_fmt not in ("NCHW", "NLC"):
            raise ValueError(f"output_fmt must be 'NCHW' or 'NLC', got {output_fmt!r}")
        x, grid = self._tokens(x)
        x, kept = run_blocks(self, x, indices, norm, stop_early, self.rope_tables(grid, x.device))
        first, regs = self.num_prefix_tokens, self.num_reg_tokens
        patches = [y[:, first : y.shape[1] - regs] for y in kept]
        patches = to_nchw(patches, grid) if output_fmt == "NCHW" else patches
        prefix = [torch.cat((y[:, :first], y[:, y.shape[1] - regs :]), dim=1) for y in kept]
        out: list[Any] = list(zip(patches, prefix, strict=True)) if return_prefix_tokens else patches
        return out if intermediates_only else (self.norm(x), out)

    def prune_intermediate_layers(
        self, indices: int | list[int] = 1, prune_norm: bool = False, prune_head: bool = True
    ) -> list[int]:
        take = prune_blocks(self, indices, prune_norm)
        if prune_head:
            self.reset_classifier(0, "")
        return take

    @torch.jit.ignore
    def flop_count(self, batch_size: int = 1) -> int:
        """Multiplications of one forward pass at the model's ``img_size``
        (:func:`~timm_layerscale.models._helpers.count_flops`)."""
        return count_flops(self, batch_size)


def checkpoint_filter_fn(
    state_dict: Mapping[str, Any], model: Vit5, use_ema: bool | None = None
) -> dict[str, torch.Tensor]:
    """Any ViT-5 checkpoint in this model's layout: the official training dict (its ``'model'`` weights, or
    ``'model_ema'`` with ``use_ema`` or a pretrained tag ending in ``_ema``), a bare official state dict or
    the ``ls`` layout. The rotary buffers are proven equal to the computed tables and dropped, ``pos_embed``
    resampled to the model's grid, the gates folded for a ``folded_layerscale`` model. (timm's loader for
    ``pretrained_cfg_overlay=dict(file=...)`` unwraps a training dict itself first, preferring ``'model_ema'``.)"""
    if use_ema is None:
        use_ema = ((getattr(model, "pretrained_cfg", None) or {}).get("tag") or "").endswith("_ema")
    sd = state_dict_of(state_dict, ema=bool(use_ema and any(k in state_dict for k in WRAPPER_KEYS)))
    return fit_state_dict(to_layerscale(sd, "vit5"), model)


def _cfg(v: Variant, **kwargs: Any) -> dict[str, Any]:
    return pretrained_cfg(
        v,
        url="",
        hf_hub_id=HUB_REPO if v.official_file else None,
        hf_hub_filename=v.official_file,
        paper_ids="arXiv:2602.08071",
        paper_name="ViT-5: Vision Transformers for the Mid-2020s",
        origin_url="https://github.com/wangf3014/ViT-5",
        **kwargs,
    )


def _tags(v: Variant) -> dict[str, dict[str, Any]]:
    if v.official_file is None:
        return {v.name: _cfg(v)}
    ema = ("EMA weights ('model_ema') of the released training checkpoint",)
    return {f"{v.name}.in1k": _cfg(v), f"{v.name}.in1k_ema": _cfg(v, notes=ema)}


#: The registered variants (:data:`timm_layerscale.families.VARIANTS`).
VARIANTS = variants_of("vit5")

default_cfgs = generate_default_cfgs({tag: cfg for v in VARIANTS.values() for tag, cfg in _tags(v).items()})


register_variants(
    __name__, VARIANTS, lambda v, pretrained, kwargs: build_variant(Vit5, checkpoint_filter_fn, v, pretrained, kwargs)
)
