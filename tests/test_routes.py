"""The routes as users run them: the command line in fresh processes, each family with its own shape table, first
empty (cold), then filled by the commands before (warm), on files this package did not write (seeded weights in
timm's layout, the authors' training dict for ViT-5) and on what it writes from them.

``make test`` converts each family's official file twice, cold then warm (a family whose smallest model is a tower of
over 100M parameters, in ``make test-full``); ``make test-full`` runs the whole matrix:
per layout a family writes, ``convert --to X`` (cold), then ``convert X`` back to ``ls``, ``verify SRC X``,
``verify X X_ls`` and ``inspect X``, each exiting 0 with nothing on stderr (no third-party progress output either).
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import timm
import torch
from safetensors.torch import load_file, save_file

from helpers import ROOT, randomize
from timm_layerscale.conversion.rules import target_tensors, to_layerscale
from timm_layerscale.errors import LayerScaleError
from timm_layerscale.families import FAMILIES, VARIANTS, Family, Variant, get_variant, state_dict_shapes, variants_of

ONE = ("--num-inputs", "1")


def smallest(family: Family) -> Variant:
    """The family's smallest real variant that every layout it writes can hold (its shapes, on the meta device,
    convert to each)."""
    for v in sorted(
        variants_of(family.name).values(), key=lambda v: sum(map(math.prod, state_dict_shapes(v).values()))
    ):
        backbone = 0 if "transformers" in family.layouts else None  # as source() writes it
        tensors = {k: torch.empty(s, device="meta") for k, s in state_dict_shapes(v, backbone).items()}
        try:
            for name in family.targets():
                target_tensors(tensors, v, family.layouts["ls"], family.layouts[name])
        except LayerScaleError:
            continue
        return v
    raise AssertionError(f"no variant of {family.title} fits all its layouts")


#: Per family, its smallest real variant that every layout of the family can hold.
SMALLEST = {name: smallest(family).name for name, family in FAMILIES.items()}
#: Families whose files fit another variant of the same resolution alike (BEiT and BEiT v2 of one size), which
#: detection does not guess: named on every command.
NAMED = {
    v.family.name
    for v in VARIANTS
    if v.name in SMALLEST.values()
    and any(
        w is not v and (w.family, w.img_size) == (v.family, v.img_size) and state_dict_shapes(w) == state_dict_shapes(v)
        for w in VARIANTS
    )
}


def run(cache: Path, *args: Any) -> str:
    """``timm-layerscale -q ARGS`` in a fresh process with the shape table in ``cache``: its stdout; a failure (or
    anything on stderr) fails the test with the command and what it said."""
    env = {**os.environ, "TIMM_LAYERSCALE_CACHE": str(cache)}
    argv = [sys.executable, "-m", "timm_layerscale", "-q", *map(str, args)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0 and not done.stderr, (" ".join(argv[3:]), done.returncode, done.stderr)
    return done.stdout


def source(family: str, folder: Path) -> Path:
    """A seeded file of the family's smallest variant as others write it: the authors' training dict for ViT-5
    (timm has none), else timm's own model's state dict, a backbone where a layout (transformers') has no classifier."""
    v = get_variant(SMALLEST[family])
    if v.reference is None:  # the authors' model, as the official layout's consumer builds it
        native = v.family.layouts["official"].native
        assert native is not None
        weights = randomize(native(v, False, {})[0]()).state_dict()
        torch.save({"model": weights, "model_ema": weights, "optimizer": {}, "epoch": 3}, path := folder / "src.pth")
        return path
    backbone: dict[str, Any] = {"num_classes": 0} if "transformers" in v.family.layouts else {}
    save_file(randomize(timm.create_model(v.reference, **backbone)).state_dict(), path := folder / "src.safetensors")
    return path


def official(family: str, folder: Path) -> Path:
    """The family's official file of the same weights, in its container, written by the rules in this process."""
    src = source(family, folder)
    if src.suffix == ".pth":
        return src
    v = get_variant(SMALLEST[family])
    layouts = v.family.layouts
    tensors = target_tensors(to_layerscale(load_file(src), v.family), v, layouts["ls"], layouts["official"])
    torch.save(layouts["official"].wrap(tensors), path := folder / "official.pth")
    return path


def _params(name: str) -> int:
    return sum(math.prod(s) for s in state_dict_shapes(get_variant(name)).values())


@pytest.mark.parametrize(
    "family", [pytest.param(f, marks=[pytest.mark.full] * (_params(v) > 10**8)) for f, v in SMALLEST.items()]
)
def test_an_official_file_converts_cold_then_warm(family, tmp_path):
    """The same conversion twice, with an empty shape table and then with the table the first run filled (which
    imports no model module): both pass and write the same tensors."""
    src, cache = official(family, tmp_path), tmp_path / "cache"
    named = ("--model", SMALLEST[family]) if family in NAMED else ()
    for out in ("cold.safetensors", "warm.safetensors"):
        assert "PASS" in run(cache, "convert", src, tmp_path / out, *named, *ONE)
    cold, warm = load_file(tmp_path / "cold.safetensors"), load_file(tmp_path / "warm.safetensors")
    assert cold.keys() == warm.keys() and all(torch.equal(cold[k], warm[k]) for k in cold)


@pytest.mark.full
@pytest.mark.parametrize("family", SMALLEST)
def test_every_layout_a_family_writes_routes_both_ways(family, tmp_path):
    src, cache = source(family, tmp_path), tmp_path / "cache"
    named = ("--model", SMALLEST[family]) if family in NAMED else ()
    layouts = FAMILIES[family].layouts
    for to in dict.fromkeys(FAMILIES[family].targets(), None):
        if layouts[to] is layouts["ls"] and to != "ls":
            continue  # DeiT-III's and DINOv2's timm layout is their ls record
        shutil.rmtree(cache, ignore_errors=True)  # each layout's first conversion cold
        out = tmp_path / f"{to}.{'pth' if layouts[to].wrapper else 'safetensors'}"
        assert "PASS" in run(cache, "convert", src, out, "--to", to, *named, *ONE)
        back = tmp_path / f"{to}-ls.safetensors"
        assert "PASS" in run(cache, "convert", out, back, *named, *ONE)
        assert "PASS" in run(cache, "verify", src, out, *named, *ONE)
        assert "PASS" in run(cache, "verify", out, back, *named, *ONE)
        said = run(cache, "inspect", out)
        assert ("ambiguous: fits" if family in NAMED else f", {to} layout (") in said, said
