"""A LayerScale CaiT in timm's own training loop, driven the way timm's ``train.py`` drives a model."""

from __future__ import annotations

import argparse

import pytest
import timm
import torch
import torch.nn.functional as F
from timm.optim import create_optimizer_v2
from timm.utils import CheckpointSaver, ModelEmaV3

import timm_layerscale  # noqa: F401  (registers the models)
from helpers import TINY_CAIT, images, tiny_pair
from kernel_trace import compiled_graph, compiled_reference
from timm_layerscale.cli import main
from timm_layerscale.conversion.rules import to_gamma
from timm_layerscale.files.read import load_checkpoint
from timm_layerscale.models.cait_ls import CaitLS

NAME = "cait_xxs24_224_ls"
#: The same architecture at toy size; init 0.1 (the paper's value for this depth) so that
#: every branch carries gradient.
TINY = dict(TINY_CAIT, init_values=0.1)


def tiny_model(seed: int = 0, **kwargs) -> CaitLS:
    torch.manual_seed(seed)
    model = timm.create_model(NAME, **{**TINY, **kwargs})
    assert isinstance(model, CaitLS)
    return model


def batch(n: int = 8, size: int = 32, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, size, size, generator=g), torch.randint(0, 10, (n,), generator=g)


def gammas(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if n.endswith(".gamma")}


def grads(model: torch.nn.Module, forward, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    F.cross_entropy(forward(x), y).backward()
    out = {}
    for n, p in model.named_parameters():
        assert p.grad is not None, n
        out[n] = p.grad.clone()
    return out


@pytest.mark.compat
@pytest.mark.parametrize("layer_decay", [None, 0.75], ids=["plain", "layer_decay"])
def test_optimizer_factory_exempts_every_gamma_from_weight_decay(layer_decay):
    model = tiny_model()
    opt = create_optimizer_v2(model, "adamw", lr=1e-3, weight_decay=0.05, layer_decay=layer_decay)
    decay = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    no_decay = {id(p) for g in opt.param_groups if g["weight_decay"] == 0 for p in g["params"]}
    names = {id(p): n for n, p in model.named_parameters()}
    assert len(decay) + len(no_decay) == len(names) and not decay & no_decay
    gamma_ids = {id(p) for p in gammas(model).values()}
    assert len(gamma_ids) == 2 * (TINY["depth"] + 2)
    assert gamma_ids <= no_decay
    assert {id(model.pos_embed), id(model.cls_token)} <= no_decay  # the model's no_weight_decay()
    assert {"blocks.0.attn.qkv.weight", "blocks_token_only.1.mlp.fc2.weight", "head.weight"} <= {
        names[i] for i in decay
    }
    # A step with zero gradients moves nothing but AdamW's decoupled weight decay.
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) == (id(p) in no_decay), n


@pytest.mark.compat
def test_grad_checkpointing_gives_the_eager_gradients_exactly():
    """Equal by construction: recomputation runs the same ATen calls on the same tensors."""
    model = tiny_model(drop_path_rate=0.2).train()
    x, y = batch()
    torch.manual_seed(5)
    eager = grads(model, model, x, y)
    model.set_grad_checkpointing(True)
    torch.manual_seed(5)
    checkpointed = grads(model, model, x, y)
    assert eager.keys() == checkpointed.keys()
    for k in eager:
        assert torch.equal(eager[k], checkpointed[k]), k
    assert eager["blocks.1.ls2.gamma"].abs().max() > 0


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``cait_xxs24_224_ls`` fine-tuned for a step to 10 classes, saved by timm's CheckpointSaver."""
    torch.manual_seed(0)
    model = timm.create_model(NAME, num_classes=10, drop_path_rate=0.1).train()
    opt = create_optimizer_v2(model, "adamw", lr=1e-3, weight_decay=0.05)
    ema = ModelEmaV3(model, decay=0.9)
    x, y = batch(1, 224)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    ema.update(model)
    args = argparse.Namespace(
        model=NAME,
        num_classes=10,
        opt="adamw",
        lr=1e-3,
        weight_decay=0.05,
        drop_path=0.1,
        model_ema=True,
        model_ema_decay=0.9,
        amp=False,
        epochs=1,
    )
    folder = tmp_path_factory.mktemp("train-output")
    saver = CheckpointSaver(model, opt, args=args, model_ema=ema, checkpoint_dir=str(folder), recovery_dir=str(folder))
    saver.save_checkpoint(epoch=0, metric=10.0)
    return model.eval(), ema.module.eval(), folder / "last.pth.tar"


@pytest.mark.compat
def test_train_py_checkpoint_holds_what_train_py_writes(trained):
    _, _, path = trained
    ckpt = load_checkpoint(path)
    assert {"epoch", "arch", "state_dict", "state_dict_ema", "optimizer", "version", "args"} <= ckpt.keys()
    assert ckpt["arch"] == NAME and isinstance(ckpt["args"], argparse.Namespace)
    assert "blocks.0.ls1.gamma" in ckpt["state_dict"]


@pytest.mark.parametrize(
    "ema", [pytest.param(False, id="model"), pytest.param(True, id="ema", marks=pytest.mark.compat)]
)
@pytest.mark.full
def test_train_py_checkpoint_converts_to_gamma_and_loads_into_timm_cait(trained, ema, tmp_path, capsys, monkeypatch):
    model, ema_model, path = trained
    expected = ema_model if ema else model
    assert not torch.equal(ema_model.blocks[0].ls1.gamma, model.blocks[0].ls1.gamma)
    out = tmp_path / "XXS24_224_finetuned.pth"
    argv = ["convert", str(path), str(out), "--to", "gamma", "--num-inputs", "2"] + (
        ["--ema", "--no-verify"] if ema else []
    )
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 0, err
    official = torch.load(out, weights_only=True)
    assert list(official) == ["model"] and all(k.startswith("module.") for k in official["model"])
    sd = {k[len("module.") :]: v for k, v in official["model"].items()}
    assert "blocks.0.gamma_1" in sd and not any(".ls1." in k or ".ls2." in k for k in sd)
    reference = timm.create_model("cait_xxs24_224", num_classes=10)
    reference.load_state_dict(sd, strict=True)
    for k, v in to_gamma(expected.state_dict(), "cait").items():
        assert torch.equal(sd[k], v), k
    x, _ = batch(1, 224)
    with torch.no_grad():
        assert torch.equal(reference.eval()(x), expected(x))


@pytest.mark.compat
@pytest.mark.parametrize("fused", [True, False], ids=["fused_attn", "unfused_attn"])
@pytest.mark.parametrize("drop", [0.0, 0.1], ids=["no_dropout", "dropout"])
def test_train_mode_gradients_bit_exact(fused, drop, fused_attn):
    fused_attn(fused)
    rates = dict(proj_drop_rate=drop, attn_drop_rate=drop, drop_path_rate=drop)
    ref, ours = tiny_pair(**rates)
    ref.train()
    ours.train()
    x = images(3, 32)
    torch.manual_seed(7)
    a = ref(x)
    torch.manual_seed(7)
    b = ours(x)
    assert torch.equal(a, b)
    a.square().mean().backward()
    b.square().mean().backward()
    assert_timms_gradients(ref, ours)


def assert_timms_gradients(ref: torch.nn.Module, ours: torch.nn.Module) -> None:
    """Every parameter of ``ref`` has a gradient, and the one of ``ours`` under its name is equal."""
    ref_grads = {k: p.grad for k, p in ref.named_parameters() if p.grad is not None}
    our_grads = to_gamma({k: p.grad for k, p in ours.named_parameters() if p.grad is not None}, "cait")
    assert ref_grads.keys() == our_grads.keys() == dict(ref.named_parameters()).keys()
    for key, grad in ref_grads.items():
        assert torch.equal(grad, our_grads[key]), key


@pytest.mark.parametrize(  # every value of each setting, in pairs
    ("amp", "drop", "fused"), [(False, 0.1, True), (False, 0.0, False), (True, 0.1, False), (True, 0.0, True)]
)
@pytest.mark.full
def test_compiled_training_is_timms(fused, drop, amp, fused_attn):
    """``torch.compile`` makes timm's forward and backward graphs of a training step, up to the
    order of independent calls and of a multiply's operands (autograd computes LayerScale's two
    gradients in the other order for ``x * gamma`` than for timm's ``gamma_1 * x``), with the
    random draws in the same order, in fp32 and under bf16 autocast; so the compiled steps compute alike."""
    fused_attn(fused)
    rates = dict(proj_drop_rate=drop, attn_drop_rate=drop, drop_path_rate=drop)
    ref, ours = tiny_pair(depth=1, **rates)
    ref.train()
    ours.train()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        assert compiled_graph(ours, images(3, 32), _loss) == compiled_graph(ref, images(3, 32), _loss)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


@pytest.mark.slow  # inductor compiles its C++ kernels: about 40 s on a cold cache
def test_inductors_training_step_is_timms(fused_attn):
    """Run with inductor for timm's default (fused attention), with dropout, in fp32: the compiled steps give
    ``torch.equal`` outputs and gradients."""
    fused_attn(True)
    ref, ours = tiny_pair(depth=1, proj_drop_rate=0.1, attn_drop_rate=0.1, drop_path_rate=0.1)
    ref.train()
    ours.train()
    x = images(3, 32)
    outputs = []
    for model in (ref, ours):
        torch._dynamo.reset()
        torch.manual_seed(7)
        step = torch.compile(model)
        out = compiled_reference(step, x) if model is ref else step(x)
        model.zero_grad(set_to_none=True)
        _loss(out).backward()
        outputs.append(out.detach())
    torch._dynamo.reset()
    assert torch.equal(outputs[1], outputs[0])
    assert_timms_gradients(ref, ours)
