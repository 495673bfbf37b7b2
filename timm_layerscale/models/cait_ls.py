"""CaiT with LayerScale modules (``ls1.gamma`` / ``ls2.gamma``).

Paper: Touvron et al., "Going deeper with Image Transformers", ICCV 2021,
https://arxiv.org/abs/2103.17239

The architecture and numbers are those of the official CaiT models (and of timm's
``cait_*``, which reproduces them): talking-heads self-attention blocks followed by
two class-attention blocks, each residual branch gated by LayerScale. The difference
is the parameter layout: LayerScale is a :class:`~timm_layerscale.layer_scale.LayerScale` module,
as in timm's ViT/DeiT-III, instead of raw ``gamma_1`` / ``gamma_2`` parameters.
Pretrained weights are the official ones (``fb_dist_in1k``), remapped at load time.

Beyond timm's CaiT: ``dynamic_img_size=True`` and pretrained loading at another
``img_size`` (the position embedding is resampled).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from timm.layers import Mlp, PatchEmbed
from timm.models import generate_default_cfgs, register_model
from timm.models._manipulate import checkpoint_seq

from ..conversion.keys import to_layerscale, unwrap_state_dict
from ..families import CAIT_RELEASE_URL, DEFAULT_NUM_CLASSES, Variant, variants_of
from ..layer_scale import cait_init_value
from ..layers.block import PreNormBlock
from ..layers.class_attn import ClassAttn, LayerScaleBlockClassAttn
from ..layers.talking_heads import (
    ATTN_IMPLS,
    BufferedTalkingHeadAttn,
    FastTalkingHeadAttn,
    TalkingHeadAttn,
    attention_workspace,
)
from ._contract import (
    TimmContract,
    block_tail_flops,
    build_variant,
    fit_state_dict,
    linear_flops,
    pretrained_cfg,
    self_attention_flops,
)

__all__ = [
    "CaitLS",
    "TalkingHeadAttn",
    "BufferedTalkingHeadAttn",
    "FastTalkingHeadAttn",
    "ClassAttn",
    "LayerScaleBlock",
    "LayerScaleBlockClassAttn",
]

InitValues = float | str | None


class LayerScaleBlock(PreNormBlock):
    """Self-attention block: :class:`~timm_layerscale.layers.block.PreNormBlock` with talking-heads attention by default."""

    def __init__(
        self, dim: int, num_heads: int, attn_layer: Callable[..., nn.Module] = TalkingHeadAttn, **kwargs: Any
    ) -> None:
        super().__init__(dim, num_heads, attn_layer, **kwargs)


class CaitLS(TimmContract):
    """CaiT (Class-Attention in Image Transformers) with LayerScale modules.

    Args:
        img_size: Input resolution (pixels) the position embedding is built for.
        patch_size: Patch size (pixels).
        in_chans: Input channels.
        num_classes: Classifier outputs; 0 for no classifier.
        global_pool: ``'token'`` (class token), ``'avg'`` (mean of patch tokens) or ``''``.
        embed_dim: Token width ``C``.
        depth: Number of self-attention (talking-heads) blocks.
        num_heads: Attention heads ``H``; ``C`` must be divisible by it.
        mlp_ratio: MLP hidden width as a multiple of ``C``.
        qkv_bias: Bias on the q/k/v projections.
        drop_rate: Dropout before the classifier.
        pos_drop_rate: Dropout after adding the position embedding.
        proj_drop_rate: Dropout after attention projections and MLPs.
        attn_drop_rate: Dropout on attention weights.
        drop_path_rate: Stochastic depth rate (the same for every block, as in CaiT).
        init_values: LayerScale initial value; ``"auto"`` uses :func:`~timm_layerscale.layer_scale.cait_init_value`
            of ``depth``; ``None`` disables LayerScale (``nn.Identity``).
        depth_token_only: Number of class-attention blocks.
        mlp_ratio_token_only: MLP ratio of the class-attention blocks.
        dynamic_img_size: Accept any input size divisible by the patch size; the
            position embedding is resampled on the fly.
        dynamic_img_pad: Pad inputs to a multiple of the patch size.
        attn_impl: Talking-heads attention implementation (``attn_layer`` overrides it):
            ``"reference"`` (default; timm's formulation, so never slower than timm),
            ``"buffered"`` (CPU inference in reused buffers, bit-identical to the
            reference; faster where fresh large tensors page-fault, e.g. glibc's default
            allocator) or ``"fast"`` (fewer copies, within
            :data:`~timm_layerscale.layers.talking_heads.FAST_ATTN_RTOL` of the
            reference, not bit-exact). All three train identically.
        folded_layerscale: Build without LayerScale modules (``ls1`` / ``ls2`` are
            ``nn.Identity``, ``init_values`` is ignored), for weights whose gammas were
            folded into ``attn.proj`` and ``mlp.fc2``
            (:func:`~timm_layerscale.conversion.fold.fold_layerscale`).
        norm_layer: Norm layer; ``None`` for LayerNorm with eps 1e-6.
        act_layer: MLP activation.
        block_layer: Self-attention block type.
        block_layer_token: Class-attention block type.
        attn_layer: Self-attention type.
        attn_layer_token_only: Class-attention type.
        mlp_layer: MLP type.
        embed_layer: Patch embedding type.
        device: Device to build on (``"meta"`` allowed).
        dtype: Parameter dtype.
    """

    if TYPE_CHECKING:  # not at run time: see TimmContract
        blocks_token_only: nn.ModuleList | None

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
        qkv_bias: bool = True,
        drop_rate: float = 0.0,
        pos_drop_rate: float = 0.0,
        proj_drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        init_values: InitValues = 1e-4,
        depth_token_only: int = 2,
        mlp_ratio_token_only: float = 4.0,
        dynamic_img_size: bool = False,
        dynamic_img_pad: bool = False,
        folded_layerscale: bool = False,
        norm_layer: Callable[..., nn.Module] | None = None,
        act_layer: type[nn.Module] = nn.GELU,
        block_layer: type[nn.Module] = LayerScaleBlock,
        block_layer_token: type[nn.Module] = LayerScaleBlockClassAttn,
        attn_layer: type[nn.Module] | None = None,
        attn_impl: str = "reference",
        attn_layer_token_only: type[nn.Module] = ClassAttn,
        mlp_layer: type[nn.Module] = Mlp,
        embed_layer: Callable[..., PatchEmbed] = PatchEmbed,
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        if init_values == "auto":
            init_values = cait_init_value(depth)
        elif isinstance(init_values, str):
            raise ValueError(f"init_values must be a number, 'auto' or None, got {init_values!r}")
        if folded_layerscale:
            init_values = None
        norm_layer = norm_layer or partial(nn.LayerNorm, eps=1e-6)
        if attn_layer is None:
            if attn_impl not in ATTN_IMPLS:
                raise ValueError(f"attn_impl must be one of {', '.join(map(repr, ATTN_IMPLS))}, got {attn_impl!r}")
            attn_layer = ATTN_IMPLS[attn_impl]

        self._build_stem(
            img_size,
            patch_size,
            in_chans,
            num_classes,
            global_pool,
            embed_dim,
            init_values,
            folded_layerscale,
            dynamic_img_size,
            dynamic_img_pad,
            embed_layer,
            **dd,
        )
        self.cls_token = nn.Parameter(torch.empty(1, 1, embed_dim, **dd))
        self.pos_embed = nn.Parameter(torch.empty(1, self.patch_embed.num_patches, embed_dim, **dd))
        self.pos_drop = nn.Dropout(p=pos_drop_rate)

        block_args = dict(
            dim=embed_dim,
            num_heads=num_heads,
            qkv_bias=qkv_bias,
            init_values=init_values,
            act_layer=act_layer,
            norm_layer=norm_layer,
            mlp_layer=mlp_layer,
            **dd,
        )
        self.blocks = nn.Sequential(
            *[
                block_layer(
                    mlp_ratio=mlp_ratio,
                    proj_drop=proj_drop_rate,
                    attn_drop=attn_drop_rate,
                    drop_path=drop_path_rate,
                    attn_layer=attn_layer,
                    **block_args,
                )
                for _ in range(depth)
            ]
        )
        self.blocks_token_only = nn.ModuleList(
            [
                block_layer_token(mlp_ratio=mlp_ratio_token_only, attn_layer=attn_layer_token_only, **block_args)
                for _ in range(depth_token_only)
            ]
        )
        self._build_head(depth, patch_size, drop_rate, norm_layer, **dd)

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Callable[[str], float]:
        def _matcher(name: str) -> float:
            if name.startswith(("cls_token", "pos_embed", "patch_embed")):
                return 0
            if name.startswith("blocks."):
                return int(name.split(".")[1]) + 1
            if name.startswith("blocks_token_only."):
                # class-attention blocks share groups with the last self-attention blocks
                offset = len(self.blocks) - len(self.blocks_token_only or ()) + 1
                return int(name.split(".")[1]) + offset
            if name.startswith("norm."):
                return len(self.blocks)
            return float("inf")

        return _matcher

    def forward_intermediates(
        self,
        x: torch.Tensor,
        indices: int | list[int] | None = None,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
    ) -> list[torch.Tensor] | tuple[torch.Tensor, list[torch.Tensor]]:
        """Forward pass that also returns the outputs of selected self-attention blocks.

        Args:
            x: Images ``(B, C_in, H_img, W_img)``.
            indices: Last ``n`` blocks if an int, all if ``None``, else these block indices.
            norm: Apply the final norm to each intermediate.
            stop_early: Stop after the last requested block (needs ``intermediates_only``).
            output_fmt: ``'NCHW'`` (``(B, C, H, W)`` patch grids) or ``'NLC'`` (``(B, N, C)``).
            intermediates_only: Return only the intermediates.

        Returns:
            The intermediates, or ``(final_tokens (B, 1 + N, C), intermediates)``.
        """
        self._check_output_fmt(output_fmt)
        x, grid = self._patch_tokens(x)
        with attention_workspace():
            x, intermediates = self._collect_intermediates(self.pos_drop(x), indices, norm, stop_early)
        if output_fmt == "NCHW":
            intermediates = self._to_nchw(intermediates, grid)
        if intermediates_only:
            return intermediates
        if self.blocks_token_only is not None:
            x = self.forward_cls(x)
        x = self.norm(x)
        return x, intermediates

    def _prune_head(self) -> None:
        self.blocks_token_only = None
        self.cls_token = None
        self.num_prefix_tokens = 0
        self.reset_classifier(0, "")

    def forward_cls(self, x: torch.Tensor) -> torch.Tensor:
        """Run the class token through the class-attention blocks and prepend it.

        Args: x: patch tokens ``(B, N, C)``. Returns: ``(B, 1 + N, C)``.
        """
        assert self.cls_token is not None and self.blocks_token_only is not None, (
            "the class token was pruned (prune_intermediate_layers)"
        )
        cls_tokens = self.cls_token.expand(x.shape[0], -1, -1)
        for blk in self.blocks_token_only:
            cls_tokens = blk(x, cls_tokens)
        return torch.cat((cls_tokens, x), dim=1)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Images ``(B, C_in, H, W)`` to normalised tokens ``(B, 1 + N, C)``, class token first."""
        x = self.pos_drop(self._patch_tokens(x)[0])
        if torch.jit.is_scripting():
            x = self.blocks(x)
        elif self.grad_checkpointing:
            x = checkpoint_seq(self.blocks, x)
        else:
            with attention_workspace():
                x = self.blocks(x)
        if self.blocks_token_only is not None:
            x = self.forward_cls(x)
        return self.norm(x)

    def flop_count(self, batch_size: int = 1) -> int:
        """Multiplications of one forward pass at the model's ``img_size``.

        Multiply-only convention, as :meth:`~timm_layerscale.layer_scale.LayerScale.flop_count`: a multiply-add
        counts 1 (``torch.utils.flop_counter.FlopCounterMode`` counts it 2). Counted:
        the patch-embedding conv; every linear layer (``qkv``, ``proj``, the MLPs, the
        class-attention ``q`` / ``k`` / ``v`` / ``proj`` and the classifier); ``q @ k^T``
        and ``attn @ v`` (``N^2 C`` each in a self-attention block, ``(1 + N) C`` in a
        class-attention block); the talking-heads mixes ``proj_l`` and ``proj_w``
        (``H^2`` per entry of the ``N x N`` logits); LayerScale (``tokens * C`` per
        module; none when ``folded_layerscale``). Not counted: norms, softmax, GELU,
        the attention scale, bias, residual and position-embedding additions. Inputs
        of another size (``dynamic_img_size``) are not accounted for.

        Args:
            batch_size: Images per forward pass.

        Returns:
            The count for ``batch_size`` images.
        """
        n = self.patch_embed.num_patches
        total = 0
        for blk in self.blocks:
            total += self_attention_flops(blk.attn, n) + _talking_heads_flops(blk.attn, n) + block_tail_flops(blk, n)
        for blk in self.blocks_token_only or ():
            total += _class_attention_flops(blk.attn, n) + block_tail_flops(blk, 1)
        return self._flop_total(total, batch_size)


def _talking_heads_flops(attn: Any, tokens: int) -> int:
    """The ``proj_l`` and ``proj_w`` head mixes: ``H^2`` per entry of the ``N x N`` logits."""
    return 2 * tokens * tokens * attn.num_heads * attn.num_heads


def _class_attention_flops(attn: Any, patches: int) -> int:
    """``q`` and ``proj`` of the class token, ``k`` and ``v`` of all ``1 + N`` tokens, ``q @ k^T`` and ``attn @ v``."""
    n = patches + 1
    total = linear_flops(attn.q, 1) + linear_flops(attn.k, n) + linear_flops(attn.v, n) + linear_flops(attn.proj, 1)
    return total + 2 * n * attn.num_heads * attn.head_dim


def checkpoint_filter_fn(state_dict: dict[str, torch.Tensor], model: CaitLS) -> dict[str, torch.Tensor]:
    """Turn any CaiT checkpoint into this model's layout.

    Accepts the official file (``{'model': {'module.' + key: ...}}``), timm's
    ``cait_*`` state dict (``gamma_1``/``gamma_2``) and the ``ls`` layout. The
    position embedding is resampled when the checkpoint's grid differs from the
    model's (pretrained loading at another ``img_size``). For a model built with
    ``folded_layerscale=True`` the gammas are folded into ``attn.proj`` and ``mlp.fc2``
    (:func:`timm_layerscale.conversion.fold.fold_state_dict`).
    """
    return fit_state_dict(to_layerscale(unwrap_state_dict(state_dict), "cait"), model, fold=model.folded_layerscale)


#: The registered variants (:data:`timm_layerscale.families.VARIANTS`).
VARIANTS = variants_of("cait")


def _cfg(v: Variant) -> dict[str, Any]:
    return pretrained_cfg(
        v,
        url=CAIT_RELEASE_URL + str(v.official_file),
        hf_hub_id=f"timm/{v.reference}.fb_dist_in1k",
        paper_ids="arXiv:2103.17239",
        paper_name="Going deeper with Image Transformers",
        origin_url="https://github.com/facebookresearch/deit",
    )


default_cfgs = generate_default_cfgs({f"{name}.fb_dist_in1k": _cfg(v) for name, v in VARIANTS.items()})


def _make(name: str, pretrained: bool, kwargs: dict[str, Any]) -> CaitLS:
    return build_variant(CaitLS, checkpoint_filter_fn, VARIANTS[name], pretrained, kwargs)


@register_model
def cait_xxs24_224_ls(pretrained: bool = False, **kwargs: Any) -> CaitLS:
    return _make("cait_xxs24_224_ls", pretrained, kwargs)


@register_model
def cait_xxs24_384_ls(pretrained: bool = False, **kwargs: Any) -> CaitLS:
    return _make("cait_xxs24_384_ls", pretrained, kwargs)


@register_model
def cait_xxs36_224_ls(pretrained: bool = False, **kwargs: Any) -> CaitLS:
    return _make("cait_xxs36_224_ls", pretrained, kwargs)


@register_model
def cait_xxs36_384_ls(pretrained: bool = False, **kwargs: Any) -> CaitLS:
    return _make("cait_xxs36_384_ls", pretrained, kwargs)


@register_model
def cait_xs24_384_ls(pretrained: bool = False, **kwargs: Any) -> CaitLS:
    return _make("cait_xs24_384_ls", pretrained, kwargs)


@register_model
def cait_s24_224_ls(pretrained: bool = False, **kwargs: Any) -> CaitLS:
    return _make("cait_s24_224_ls", pretrained, kwargs)


@register_model
def cait_s24_384_ls(pretrained: bool = False, **kwargs: Any) -> CaitLS:
    return _make("cait_s24_384_ls", pretrained, kwargs)


@register_model
def cait_s36_384_ls(pretrained: bool = False, **kwargs: Any) -> CaitLS:
    return _make("cait_s36_384_ls", pretrained, kwargs)


@register_model
def cait_m36_384_ls(pretrained: bool = False, **kwargs: Any) -> CaitLS:
    return _make("cait_m36_384_ls", pretrained, kwargs)


@register_model
def cait_m48_448_ls(pretrained: bool = False, **kwargs: Any) -> CaitLS:
    return _make("cait_m48_448_ls", pretrained, kwargs)
