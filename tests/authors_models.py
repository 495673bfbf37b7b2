"""The key sets and shapes of the authors' own models, per variant, written down from their model definitions (none of
their code is installed here): one block's keys, the depth, and the keys outside the blocks. ``D`` is the width,
``H`` the heads, ``N`` the patches; each function returns ``{key: shape}`` and the container of the released file.

- CaiT: facebookresearch/deit ``cait_models.py`` (``cait_XXS24_224`` ...), saved by DDP training as
  ``{'model': {'module.' + key: tensor}}``.
- DeiT III: facebookresearch/deit ``models_v2.py`` (``vit_models``, ``Layer_scale_init_Block``), ``{'model': ...}``.
- ViT-5: wangf3014/ViT-5 ``models_vit5.py`` (rotary ``freqs`` buffers persistent), its training dict's ``'model'``.
- DINOv3: facebookresearch/dinov3 ``models/vision_transformer.py`` as ``hub/backbones.py`` builds each release
  (``mask_k_bias=True``, the 7B without q/k/v bias and with ``untie_global_and_local_cls_norm``), a bare state dict.
- DINOv2: facebookresearch/dinov2 ``models/vision_transformer.py`` as ``hub/backbones.py`` builds it (the giant's
  ``SwiGLUFFNFused``: ``w12``, ``w3``), a bare state dict.
- BEiT: microsoft/unilm ``beit/modeling_finetune.py`` (mean pooling: ``fc_norm``, no ``norm``; each block's
  ``relative_position_index`` buffer persistent), ``{'model': ...}``.
- ConvNeXt: facebookresearch/ConvNeXt ``models/convnext.py`` (``downsample_layers``, ``stages.S.B``, Linear MLPs),
  ``{'model': ...}``; ``None`` for timm's own ``conv_mlp`` architectures, which the authors did not release.
- ResMLP: facebookresearch/deit ``resmlp_models.py`` (``attn`` the token-mixing linear, ``Affine`` vectors), a bare
  state dict (their loader's ``model.load_state_dict(checkpoint)``).
- XCiT: facebookresearch/xcit ``xcit.py`` (``ConvPatchEmbed`` of 3x3 convolutions and batch norms, ``pos_embeder``, a
  fused class-attention ``qkv``), ``{'model': ...}``.
"""

from __future__ import annotations

from typing import Any

Shapes = dict[str, tuple[int, ...]]


def _linear(name: str, out: int, inp: int, bias: bool = True) -> Shapes:
    return {f"{name}.weight": (out, inp), **({f"{name}.bias": (out,)} if bias else {})}


def _norm(name: str, dim: int, bias: bool = True) -> Shapes:
    return {f"{name}.weight": (dim,), **({f"{name}.bias": (dim,)} if bias else {})}


def _blocks(prefix: str, depth: int, block: Shapes) -> Shapes:
    return {f"{prefix}.{i}.{k}": s for i in range(depth) for k, s in block.items()}


def _stem(dim: int, patch: int, classes: int) -> Shapes:
    head = _linear("head", classes, dim) if classes else {}
    return {"patch_embed.proj.weight": (dim, 3, patch, patch), "patch_embed.proj.bias": (dim,), **head}


def cait(dim: int, depth: int, heads: int, img: int, classes: int = 1000) -> tuple[Shapes, Any]:
    mlp = {**_linear("mlp.fc1", 4 * dim, dim), **_linear("mlp.fc2", dim, 4 * dim)}
    talking = {**_linear("attn.proj_l", heads, heads), **_linear("attn.proj_w", heads, heads)}
    block = {**_norm("norm1", dim), **_linear("attn.qkv", 3 * dim, dim), **talking, **_linear("attn.proj", dim, dim)}
    block |= {"gamma_1": (dim,), **_norm("norm2", dim), **mlp, "gamma_2": (dim,)}
    attn = {k: s for n in "qkv" for k, s in _linear(f"attn.{n}", dim, dim).items()} | _linear("attn.proj", dim, dim)
    class_block = {**_norm("norm1", dim), **attn, "gamma_1": (dim,), **_norm("norm2", dim), **mlp, "gamma_2": (dim,)}
    outside = {"cls_token": (1, 1, dim), "pos_embed": (1, (img // 16) ** 2, dim), **_norm("norm", dim)}
    keys = {**outside, **_stem(dim, 16, classes), **_blocks("blocks", depth, block)}
    return keys | _blocks("blocks_token_only", 2, class_block), ("model", "module.")


def deit3(dim: int, depth: int, heads: int, img: int, patch: int = 16, classes: int = 1000) -> tuple[Shapes, Any]:
    block = {**_norm("norm1", dim), **_linear("attn.qkv", 3 * dim, dim), **_linear("attn.proj", dim, dim)}
    block |= {"gamma_1": (dim,), **_norm("norm2", dim), **_linear("mlp.fc1", 4 * dim, dim)}
    block |= {**_linear("mlp.fc2", dim, 4 * dim), "gamma_2": (dim,)}
    outside = {"cls_token": (1, 1, dim), "pos_embed": (1, (img // patch) ** 2, dim), **_norm("norm", dim)}
    return {**outside, **_stem(dim, patch, classes), **_blocks("blocks", depth, block)}, ("model", "")


def vit5(dim: int, depth: int, heads: int, img: int, classes: int = 1000) -> tuple[Shapes, Any]:
    hd = dim // heads
    block = {
        **_norm("norm1", dim, False),
        **_linear("attn.qkv", 3 * dim, dim, False),
        **_norm("attn.q_norm", hd, False),
    }
    block |= {**_norm("attn.k_norm", hd, False), **_linear("attn.proj", dim, dim)}
    block |= {"attn.rope.freqs": (hd // 4,), "attn.rope_reg.freqs": (hd // 4,), "gamma_1": (dim,)}
    block |= {**_norm("norm2", dim, False), **_linear("mlp.fc1", 4 * dim, dim), **_linear("mlp.fc2", dim, 4 * dim)}
    block |= {"gamma_2": (dim,)}
    outside: Shapes = {"cls_token": (1, 1, dim), "reg_token": (1, 4, dim), "pos_embed": (1, (img // 16) ** 2, dim)}
    outside |= _norm("norm", dim, False)
    return {**outside, **_stem(dim, 16, classes), **_blocks("blocks", depth, block)}, ("model", "")


def _swiglu_hidden(hidden: int, align: int) -> int:
    d = int(hidden * 2 / 3)
    return d + (-d % align)


def dinov3(
    dim: int, depth: int, heads: int, ffn: str = "mlp", ratio: float = 4.0, bias: bool = True
) -> tuple[Shapes, Any]:
    """``ffn``: ``"mlp"``, ``"swiglu"`` (aligned to 8) or ``"swiglu64"``; ``bias``: ``qkv_bias`` (the 7B's is off)."""
    hidden = int(dim * ratio)
    if ffn == "mlp":
        mlp = {**_linear("mlp.fc1", hidden, dim), **_linear("mlp.fc2", dim, hidden)}
    else:
        h = _swiglu_hidden(hidden, 64 if ffn == "swiglu64" else 8)
        mlp = {**_linear("mlp.w1", h, dim), **_linear("mlp.w2", h, dim), **_linear("mlp.w3", dim, h)}
    qkv = _linear("attn.qkv", 3 * dim, dim, bias) | ({"attn.qkv.bias_mask": (3 * dim,)} if bias else {})
    block = {**_norm("norm1", dim), **qkv, **_linear("attn.proj", dim, dim), "ls1.gamma": (dim,)}
    block |= {**_norm("norm2", dim), **mlp, "ls2.gamma": (dim,)}
    outside = {"cls_token": (1, 1, dim), "storage_tokens": (1, 4, dim), "mask_token": (1, dim), **_norm("norm", dim)}
    outside |= {"rope_embed.periods": (dim // heads // 4,), **({} if bias else _norm("local_cls_norm", dim))}
    return {**outside, **_stem(dim, 16, 0), **_blocks("blocks", depth, block)}, (None, "")


def dinov2(dim: int, depth: int, heads: int, registers: int = 0, ffn: str = "mlp") -> tuple[Shapes, Any]:
    """``ffn``: ``"mlp"`` or the giant's ``"swiglufused"`` (``w12`` packs the gate and the value)."""
    if ffn == "mlp":
        mlp = {**_linear("mlp.fc1", 4 * dim, dim), **_linear("mlp.fc2", dim, 4 * dim)}
    else:
        h = (int(4 * dim * 2 / 3) + 7) // 8 * 8
        mlp = {**_linear("mlp.w12", 2 * h, dim), **_linear("mlp.w3", dim, h)}
    block = {**_norm("norm1", dim), **_linear("attn.qkv", 3 * dim, dim), **_linear("attn.proj", dim, dim)}
    block |= {"ls1.gamma": (dim,), **_norm("norm2", dim), **mlp, "ls2.gamma": (dim,)}
    outside = {"cls_token": (1, 1, dim), "pos_embed": (1, 1 + 37 * 37, dim), "mask_token": (1, dim)}
    outside |= {**({"register_tokens": (1, registers, dim)} if registers else {}), **_norm("norm", dim)}
    stem = {"patch_embed.proj.weight": (dim, 3, 14, 14), "patch_embed.proj.bias": (dim,)}
    return {**outside, **stem, **_blocks("blocks", depth, block)}, (None, "")


def convnext(depths: Any, dims: Any, classes: int = 1000) -> tuple[Shapes, Any]:
    keys: Shapes = {"downsample_layers.0.0.weight": (dims[0], 3, 4, 4), "downsample_layers.0.0.bias": (dims[0],)}
    keys |= _norm("downsample_layers.0.1", dims[0])
    for s, (depth, dim) in enumerate(zip(depths, dims, strict=True)):
        if s:
            keys |= {
                **_norm(f"downsample_layers.{s}.0", dims[s - 1]),
                f"downsample_layers.{s}.1.weight": (dim, dims[s - 1], 2, 2),
            }
            keys[f"downsample_layers.{s}.1.bias"] = (dim,)
        block = {"dwconv.weight": (dim, 1, 7, 7), "dwconv.bias": (dim,), **_norm("norm", dim)}
        block |= {**_linear("pwconv1", 4 * dim, dim), **_linear("pwconv2", dim, 4 * dim), "gamma": (dim,)}
        keys |= _blocks(f"stages.{s}", depth, block)
    return {**keys, **_norm("norm", dims[-1]), **_linear("head", classes, dims[-1])}, ("model", "")


def beit(dim: int, depth: int, heads: int, img: int, classes: int = 1000) -> tuple[Shapes, Any]:
    n = (img // 16) ** 2
    attn = {
        "attn.q_bias": (dim,),
        "attn.v_bias": (dim,),
        "attn.qkv.weight": (3 * dim, dim),
        **_linear("attn.proj", dim, dim),
    }
    attn |= {"attn.relative_position_bias_table": ((2 * img // 16 - 1) ** 2 + 3, heads)}
    attn |= {"attn.relative_position_index": (n + 1, n + 1)}
    block = {"gamma_1": (dim,), "gamma_2": (dim,), **_norm("norm1", dim), **attn, **_norm("norm2", dim)}
    block |= {**_linear("mlp.fc1", 4 * dim, dim), **_linear("mlp.fc2", dim, 4 * dim)}
    outside = {"cls_token": (1, 1, dim), **_norm("fc_norm", dim), **_stem(dim, 16, classes)}
    return {**outside, **_blocks("blocks", depth, block)}, ("model", "")


def resmlp(dim: int, depth: int, patch: int, classes: int = 1000) -> tuple[Shapes, Any]:
    n = (224 // patch) ** 2
    affine = {f"norm{i}.{p}": (dim,) for i in (1, 2) for p in ("alpha", "beta")}
    block = {**affine, **_linear("attn", n, n), **_linear("mlp.fc1", 4 * dim, dim), **_linear("mlp.fc2", dim, 4 * dim)}
    block |= {"gamma_1": (dim,), "gamma_2": (dim,)}
    outside = {**_stem(dim, patch, classes), "norm.alpha": (dim,), "norm.beta": (dim,)}
    return {**outside, **_blocks("blocks", depth, block)}, (None, "")


def _batch_norm(name: str, dim: int) -> Shapes:
    stats = {f"{name}.running_mean": (dim,), f"{name}.running_var": (dim,), f"{name}.num_batches_tracked": ()}
    return {**_norm(name, dim), **stats}


def xcit(dim: int, depth: int, heads: int, patch: int, classes: int = 1000) -> tuple[Shapes, Any]:
    widths = [dim // 8, dim // 4, dim // 2, dim][4 - (3 if patch == 8 else 4) :]
    stem: Shapes = {}
    for i, (inp, out) in enumerate(zip([3, *widths], widths, strict=False)):  # conv3x3: a convolution, a batch norm
        stem |= {
            f"patch_embed.proj.{2 * i}.0.weight": (out, inp, 3, 3),
            **_batch_norm(f"patch_embed.proj.{2 * i}.1", out),
        }
    mlp = {**_linear("mlp.fc1", 4 * dim, dim), **_linear("mlp.fc2", dim, 4 * dim)}
    depthwise = {"weight": (dim, 1, 3, 3), "bias": (dim,)}
    lpi = {f"local_mp.conv{i}.{k}": s for i in (1, 2) for k, s in depthwise.items()} | _batch_norm("local_mp.bn", dim)
    attn = {**_linear("attn.qkv", 3 * dim, dim), **_linear("attn.proj", dim, dim)}
    block = {**_norm("norm1", dim), "attn.temperature": (heads, 1, 1), **attn, **_norm("norm3", dim), **lpi}
    block |= {**_norm("norm2", dim), **mlp, "gamma1": (dim,), "gamma2": (dim,), "gamma3": (dim,)}
    class_block = {**_norm("norm1", dim), **attn, **_norm("norm2", dim), **mlp, "gamma1": (dim,), "gamma2": (dim,)}
    outside = {"cls_token": (1, 1, dim), **_norm("norm", dim), **_linear("head", classes, dim)}
    outside |= {"pos_embeder.token_projection.weight": (dim, 64, 1, 1), "pos_embeder.token_projection.bias": (dim,)}
    keys = {**outside, **stem, **_blocks("blocks", depth, block)}
    return keys | _blocks("cls_attn_blocks", 2, class_block), ("model", "")


def _dinov3_release(name: str) -> tuple[Shapes, Any]:
    size = name.removeprefix("vit_").split("_patch16")[0]
    dim, depth, heads = {"tiny": (192, 12, 3), "small": (384, 12, 6), "small_plus": (384, 12, 6), "base": (768, 12, 12),
                         "large": (1024, 24, 16), "huge_plus": (1280, 32, 20), "7b": (4096, 40, 32)}[size]  # fmt: skip
    if size == "7b":
        return dinov3(dim, depth, heads, "swiglu64", 3.0, bias=False)
    return dinov3(dim, depth, heads, "swiglu" if "plus" in size else "mlp", 6.0 if "plus" in size else 4.0)


def internvit(dim: int, depth: int, img: int, patch: int) -> tuple[Shapes, Any]:
    block = {**_norm("norm1", dim), **_linear("attn.qkv", 3 * dim, dim), **_linear("attn.proj", dim, dim)}
    block |= {**_norm("norm2", dim), **_linear("mlp.fc1", 4 * dim, dim), **_linear("mlp.fc2", dim, 4 * dim)}
    block |= {"ls1": (dim,), "ls2": (dim,)}
    embeddings: Shapes = {"class_embedding": (1, 1, dim), "position_embedding": (1, (img // patch) ** 2 + 1, dim)}
    embeddings |= {"patch_embedding.weight": (dim, 3, patch, patch), "patch_embedding.bias": (dim,)}
    keys = {f"embeddings.{k}": s for k, s in embeddings.items()}
    return keys | _blocks("encoder.layers", depth, block), (None, "")


def pe(dim: int, depth: int, hidden: int, img: int, cls: bool) -> tuple[Shapes, Any]:
    block = {**_norm("ln_1", dim), "attn.in_proj_weight": (3 * dim, dim), "attn.in_proj_bias": (3 * dim,)}
    block |= {**_linear("attn.out_proj", dim, dim), **_norm("ln_2", dim), "ls_1.gamma": (dim,), "ls_2.gamma": (dim,)}
    block |= {**_linear("mlp.c_fc", hidden, dim), **_linear("mlp.c_proj", dim, hidden)}
    keys: Shapes = {"conv1.weight": (dim, 3, 14, 14), "positional_embedding": ((img // 14) ** 2 + cls, dim)}
    keys |= {**_norm("ln_pre", dim), **({"class_embedding": (dim,)} if cls else {})}
    return keys | _blocks("transformer.resblocks", depth, block), (None, "")


def official(variant: Any) -> tuple[Shapes, Any] | None:
    """The authors' keys, shapes and container of a registered variant's release (``None``: they released none)."""
    v, family = variant, variant.family.name
    if family == "cait":
        return cait(v.embed_dim, v.depth, v.num_heads, v.img_size)
    if family == "deit3":
        return deit3(v.embed_dim, v.depth, v.num_heads, v.img_size, v.patch_size)
    if family == "vit5":
        return vit5(v.embed_dim, v.depth, v.num_heads, v.img_size)
    if family == "dinov3":
        return _dinov3_release(v.name)
    if family == "beit":
        return beit(v.embed_dim, v.depth, v.num_heads, v.img_size)
    if family == "resmlp":
        return resmlp(v.embed_dim, v.depth, v.patch_size)
    if family == "pe":
        return pe(v.embed_dim, v.depth, 4096 if v.embed_dim == 1024 else 8960, v.img_size, v.embed_dim == 1024)
    if family == "internvit":
        return internvit(v.embed_dim, v.depth, v.img_size, v.patch_size)
    if family == "xcit":
        return xcit(v.embed_dim, v.depth, v.num_heads, v.patch_size)
    if family == "convnext":
        args = dict(v.args)
        return None if args.get("conv_mlp") or "head_hidden_size" in args else convnext(args["depths"], args["dims"])
    return dinov2(
        v.embed_dim, v.depth, v.num_heads, 4 if "_reg4" in v.name else 0, "swiglufused" if "giant" in v.name else "mlp"
    )
