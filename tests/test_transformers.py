"""Exported folders where people load models: transformers' TimmWrapper, plain timm, the Hub card."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from huggingface_hub import ModelCard

from helpers import ROOT, assert_one_line_error, cli, fine_tuned
from timm_layerscale.errors import CheckpointError, RemapError
from timm_layerscale.hub.export import export_folder
from timm_layerscale.parity.tolerance import VerifyOptions

LABELS = [f"class {i}" for i in range(10)]
#: One seeded input: what these tests need of an export is its folder and its reload check.
ONE = VerifyOptions(num_inputs=1)

# make test leaves this file to make test-full; one seeded image: these tests do not count them
pytestmark = [pytest.mark.full, pytest.mark.usefixtures("few_inputs")]


@pytest.fixture(scope="module")
def folders(tmp_path_factory, official) -> dict[str, Path]:
    from PIL import Image

    from timm_layerscale.demo import write_official_checkpoint

    root = tmp_path_factory.mktemp("tf")
    deit3 = root / "deit_3_small_224_1k.pth"
    vit5 = root / "vit5_small_patch16_224.pth"
    write_official_checkpoint(deit3, "deit3_small_patch16_224", seed=1)
    write_official_checkpoint(vit5, "vit5_small_patch16_224", seed=2)
    labels = root / "labels.txt"
    labels.write_text("\n".join(f"{n}\tdescription of {n}" for n in LABELS) + "\n")
    image = root / "cat.png"
    Image.fromarray(torch.full((240, 320, 3), 128, dtype=torch.uint8).numpy()).save(image)
    tuned = fine_tuned(official, root / "tuned.pth")
    jobs = {
        "cait": (official, {}),
        "cait_gamma": (official, {"to": "gamma"}),
        "deit3": (deit3, {}),
        "vit5": (vit5, {}),
        "tuned": (tuned, {"label_names": labels, "options": VerifyOptions(num_inputs=2, images=(str(image),))}),
        "tuned_unnamed": (tuned, {"to": "gamma"}),
        "backbone": (fine_tuned(official, root / "backbone.pth", num_classes=0), {}),
        "resized": (fine_tuned(official, root / "ft256.pth", num_classes=None, img_size=256), {}),
    }
    return {
        key: export_folder(src, root / key, plot=False, repo_id=f"org/{key}", **{"options": ONE, **kw}).folder
        for key, (src, kw) in jobs.items()
    }


def _pixels(seed: int = 0) -> torch.Tensor:
    return torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("key", ["cait", "cait_gamma", "deit3", "vit5", "tuned"])
def test_transformers_loads_the_folder_with_timms_logits_and_features(folders, key) -> None:
    import timm
    from transformers import AutoModel, AutoModelForImageClassification

    folder = folders[key]
    config = json.loads((folder / "config.json").read_text())
    assert "model_args" not in config  # nothing the architecture's defaults do not give
    reference: Any = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
    classifier = AutoModelForImageClassification.from_pretrained(folder).eval()
    backbone = AutoModel.from_pretrained(folder).eval()
    x = _pixels()
    with torch.inference_mode():
        expected = reference(x)
        assert torch.equal(classifier(pixel_values=x).logits, expected)
        pooled = backbone(pixel_values=x).pooler_output
        assert torch.equal(pooled, reference.forward_head(reference.forward_features(x), pre_logits=True))
        # transformers computes on the file's memory: one image (one-row GEMMs) is equal too, as
        # the file's weight matrices start on 64-byte boundaries
        assert torch.equal(classifier(pixel_values=x[:1]).logits, reference(x[:1]))
    assert classifier.config.num_labels == expected.shape[-1] == config["num_classes"]


def test_a_backbone_without_a_head_is_a_feature_extractor_everywhere(folders) -> None:
    import timm
    from PIL import Image
    from transformers import AutoModel, pipeline

    folder = folders["backbone"]
    assert json.loads((folder / "config.json").read_text())["num_classes"] == 0
    reference: Any = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
    x = _pixels()
    with torch.inference_mode():
        expected = reference(x)
        assert expected.shape == (2, 192)
        backbone = AutoModel.from_pretrained(folder).eval()
        assert torch.equal(backbone(pixel_values=x).pooler_output, expected)
        assert torch.equal(backbone(pixel_values=x[:1]).pooler_output, reference(x[:1]))
    image = Image.fromarray((torch.rand(224, 224, 3, generator=torch.Generator().manual_seed(1)) * 255).byte().numpy())
    features = pipeline("image-feature-extraction", model=str(folder))(image, pool=True)
    assert torch.tensor(features).shape == (1, 192)
    card = ModelCard.load(folder / "README.md")
    assert card.data.pipeline_tag == "image-feature-extraction" and "image-classification" not in card.data.tags
    assert 'pipeline("image-feature-extraction", model="org/backbone")' in card.text
    assert "feature backbone, without a classifier" in card.text and "softmax" not in card.text


def test_a_fine_tune_at_another_resolution_loads_at_it_everywhere(folders) -> None:
    import timm
    from PIL import Image
    from transformers import AutoModelForImageClassification, pipeline

    folder = folders["resized"]
    config = json.loads((folder / "config.json").read_text())
    assert config["model_args"] == {"img_size": 256} and config["pretrained_cfg"]["input_size"] == [3, 256, 256]
    reference: Any = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
    # timm gives the folder's input_size as config.json holds it (a list) until 1.0.30, a tuple from 1.0.31
    assert tuple(timm.data.resolve_data_config({}, model=reference)["input_size"]) == (3, 256, 256)
    x = torch.randn(2, 3, 256, 256, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        classifier = AutoModelForImageClassification.from_pretrained(folder).eval()
        assert torch.equal(classifier(pixel_values=x).logits, reference(x))
        assert torch.equal(classifier(pixel_values=x[:1]).logits, reference(x[:1]))
    image = Image.fromarray((torch.rand(300, 400, 3, generator=torch.Generator().manual_seed(1)) * 255).byte().numpy())
    assert len(pipeline("image-classification", model=str(folder))(image, top_k=3)) == 3
    assert "- **Image size:** 256 x 256" in (folder / "README.md").read_text()


def test_label_names_reach_timm_and_transformers(folders) -> None:
    import timm
    from transformers import AutoConfig

    folder = folders["tuned"]
    config = json.loads((folder / "config.json").read_text())
    assert config["num_classes"] == 10 and config["label_names"] == LABELS
    assert config["label_descriptions"]["class 3"] == "description of class 3"
    model: Any = timm.create_model(f"local-dir:{folder}", pretrained=True)
    assert model.pretrained_cfg["label_names"] == LABELS
    assert AutoConfig.from_pretrained(folder).id2label == dict(enumerate(LABELS))
    # The card's command names the local files, not the folder they are in.
    card = (folder / "README.md").read_text()
    assert "timm-layerscale export tuned.pth tuned " in card and "--images cat.png" in card
    assert "--label-names labels.txt" in card and str(folder.parent) not in card
    # Another head size without names gets none (transformers' defaults), not ImageNet's.
    unnamed = json.loads((folders["tuned_unnamed"] / "config.json").read_text())
    assert unnamed["num_classes"] == 10 and "label_names" not in unnamed
    assert AutoConfig.from_pretrained(folders["tuned_unnamed"]).id2label[0] == "LABEL_0"


@pytest.mark.parametrize(("key", "named"), [("cait", True), ("vit5", False)])
def test_a_fine_tune_begun_in_transformers_exports_again(folders, tmp_path: Path, key: str, named: bool) -> None:
    """A new head from transformers (``num_labels``, ``ignore_mismatched_sizes``), a training step,
    ``save_pretrained``: exporting that folder gives timm the fine-tuned model and its class names
    (transformers' placeholders ``LABEL_0``, ... are no names)."""
    import timm
    from transformers import AutoModelForImageClassification

    names = {i: f"kind {i}" for i in range(10)} if named else {}
    folder = folders[key]
    model = AutoModelForImageClassification.from_pretrained(
        folder,
        num_labels=10,
        ignore_mismatched_sizes=True,
        **cast(dict[str, Any], {"id2label": names} if named else {}),
    )
    start: Any = timm.create_model(f"local-dir:{folder}", pretrained=True)
    tuned = model.timm_model.state_dict()
    assert tuned["head.weight"].shape[0] == 10
    assert all(torch.equal(v, tuned[k]) for k, v in start.state_dict().items() if not k.startswith("head."))
    x = _pixels()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model(pixel_values=x, labels=torch.arange(2)).loss.backward()
    optimizer.step()
    model.eval().save_pretrained(tmp_path / "saved")
    again = export_folder(tmp_path / "saved", tmp_path / "again", plot=False, repo_id="org/again", options=ONE).folder
    config = json.loads((again / "config.json").read_text())
    assert config.get("label_names") == (list(names.values()) if named else None)
    reloaded: Any = timm.create_model(f"local-dir:{again}", pretrained=True).eval()
    with torch.inference_mode():
        assert torch.equal(reloaded(x), model(pixel_values=x).logits)


def test_transformers_loads_bf16_and_preprocesses_as_timm(folders) -> None:
    import timm
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageClassification

    image = Image.fromarray((torch.rand(240, 320, 3, generator=torch.Generator().manual_seed(2)) * 255).byte().numpy())
    for key in ("cait", "deit3", "vit5"):
        reference: Any = timm.create_model(f"local-dir:{folders[key]}", pretrained=True).eval()
        transform = timm.data.create_transform(**timm.data.resolve_data_config({}, model=reference))
        pixels = AutoImageProcessor.from_pretrained(folders[key])(image, return_tensors="pt")["pixel_values"]
        assert torch.equal(pixels[0], transform(image)), key
        classifier = AutoModelForImageClassification.from_pretrained(folders[key], dtype=torch.bfloat16).eval()
        assert {p.dtype for p in classifier.parameters()} == {torch.bfloat16}
        x = _pixels().bfloat16()
        with torch.inference_mode():
            assert torch.equal(classifier(pixel_values=x).logits, reference.bfloat16()(x)), key


def test_re_exporting_a_folder_keeps_its_class_names_and_tag(folders, tmp_path: Path, capsys) -> None:
    """Exporting an exported folder again (onto itself, or as timm's own CaiT) keeps the class
    names and descriptions its ``config.json`` gives, and its pretrained tag; given names win."""
    import shutil

    tuned = json.loads((folders["tuned"] / "config.json").read_text())
    gamma = export_folder(folders["tuned"], tmp_path / "gamma", to="gamma", plot=False, options=ONE).folder
    config = json.loads((gamma / "config.json").read_text())
    assert config["architecture"] == "cait_xxs24_224"
    assert config["label_names"] == LABELS and config["label_descriptions"] == tuned["label_descriptions"]
    deit3 = tmp_path / "deit3"
    shutil.copytree(folders["deit3"], deit3)
    export_folder(deit3, deit3, overwrite=True, tag="fb_in22k_ft_in1k", plot=False, options=ONE)
    export_folder(deit3, deit3, overwrite=True, plot=False, options=ONE)
    config = json.loads((deit3 / "config.json").read_text())
    assert config["pretrained_cfg"]["tag"] == "fb_in22k_ft_in1k" and "label_names" not in config
    given = export_folder(
        gamma, tmp_path / "given", label_names=[f"n{i}" for i in range(10)], plot=False, options=ONE
    ).folder
    assert json.loads((given / "config.json").read_text())["label_names"][0] == "n0"
    # Names that do not fit the weights: one line naming the file, nothing written.
    config = json.loads((gamma / "config.json").read_text())
    (gamma / "config.json").write_text(json.dumps({**config, "label_names": LABELS[:9]}))
    assert_one_line_error(
        *cli(capsys, "export", gamma, tmp_path / "out"),
        f"{gamma / 'config.json'}: 9 label names for a model with 10 classes; give one name per class, "
        "or pass --label-names FILE",
    )
    # A tag given too does not hide where the names came from; an unknown one is said first.
    err = assert_one_line_error(*cli(capsys, "export", gamma, tmp_path / "out", "--tag", "fb_dist_in1k"))
    assert f"{gamma / 'config.json'}: 9 label names" in err
    assert_one_line_error(*cli(capsys, "export", gamma, tmp_path / "out", "--tag", "x"), "'x' is not a pretrained tag")
    (gamma / "config.json").write_text("{")
    assert_one_line_error(*cli(capsys, "export", gamma, tmp_path / "out"), "config.json (Expecting property name")
    assert not (tmp_path / "out").exists()


def test_timm_is_refused_before_converting_where_timm_has_no_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ViT-5 has no timm layout (timm has no ViT-5): ``--to timm`` and the release word ``gamma`` (which means it for
    an export) are refused before the conversion and its verification, and leave no folder behind."""
    import timm_layerscale.converter
    from timm_layerscale.demo import write_official_checkpoint

    source = tmp_path / "src.pth"
    write_official_checkpoint(source, "vit5_small_patch16_224")

    def no_conversion(*args: object, **kwargs: object) -> None:
        raise AssertionError("converted before refusing")

    monkeypatch.setattr(timm_layerscale.converter, "convert_checkpoint", no_conversion)
    for to in ("timm", "gamma"):
        with pytest.raises(RemapError, match="ViT-5 has no layout 'timm' to write; its layouts: ls, official"):
            export_folder(source, tmp_path / "out", to=to, plot=False, options=ONE)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src.pth"]


def test_timms_own_architectures_load_without_the_package(folders) -> None:
    """The gamma CaiT and the DeiT-III folders need neither this package nor its start-up hook."""
    code = (
        "import sys, torch, timm\n"
        "from transformers import AutoModelForImageClassification\n"
        "for folder in sys.argv[1:]:\n"
        "    t = timm.create_model('local-dir:' + folder, pretrained=True).eval()\n"
        "    m = AutoModelForImageClassification.from_pretrained(folder).eval()\n"
        "    x = torch.randn(1, 3, 224, 224)\n"
        "    with torch.inference_mode():\n"
        "        assert torch.equal(m(pixel_values=x).logits, t(x)), folder\n"
        "    print(type(t).__name__)\n"
        "assert not any(n.startswith('timm_layerscale') for n in sys.modules), 'timm_layerscale was imported'\n"
    )
    env = {**os.environ, "TIMM_LAYERSCALE_AUTOLOAD": "0"}
    proc = subprocess.run(
        [sys.executable, "-c", code, str(folders["cait_gamma"]), str(folders["deit3"])],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["Cait", "VisionTransformer"]


def test_cards_say_which_package_loads_the_folder_and_where_weights_come_from(folders) -> None:
    cards = {key: ModelCard.load(folders[key] / "README.md", ignore_metadata_errors=False) for key in folders}
    assert cards["cait"].data.base_model == "timm/cait_xxs24_224.fb_dist_in1k"
    assert cards["cait_gamma"].data.base_model == "timm/cait_xxs24_224.fb_dist_in1k"
    assert cards["deit3"].data.base_model == "timm/deit3_small_patch16_224.fb_in1k"
    assert cards["vit5"].data.base_model is None  # timm has no copy of ViT-5
    assert "timm with `timm-layerscale` installed, which registers `cait_xxs24_224_ls`" in cards["cait"].text
    assert "import timm_layerscale" in cards["cait"].text and "pip install timm-layerscale" in cards["cait"].text
    for key in ("cait_gamma", "deit3"):
        text = cards[key].text
        assert "timm-layerscale is not needed" in text and "import timm_layerscale" not in text
        assert "pip install timm\n" in text
    assert "timm has no ViT-5" in cards["vit5"].text
    assert "stored in timm's own layout for `deit3_small_patch16_224`." in cards["deit3"].text
    assert "| `blocks.N.gamma_1` | `blocks.N.ls1.gamma` |" in cards["deit3"].text  # the official file's keys
    assert "stored in timm's own layout for `cait_xxs24_224`." in cards["cait_gamma"].text
    assert (
        "Every key keeps its name; the source's container, `{'model': {'module.' + key: tensor}}`"
        in cards["cait_gamma"].text
    )
    assert "**LayerScale-module layout** of [timm-layerscale]" in cards["cait"].text
    # The card names the source file and its SHA-256.
    for card in cards.values():
        assert "The weights come from `" in card.text and "(SHA-256 `" in card.text
    assert "(class names in `config.json`)" in cards["tuned"].text


def test_a_tag_is_written_and_an_unknown_one_refused(tmp_path: Path) -> None:
    from timm_layerscale.hub.config import write_config

    config = write_config("deit3_small_patch16_224.fb_in22k_ft_in1k", tmp_path / "config.json")
    assert config["pretrained_cfg"]["tag"] == "fb_in22k_ft_in1k" and "model_args" not in config
    with pytest.raises(
        CheckpointError, match="'pets' is not a pretrained tag of cait_xxs24_224_ls; choose from: fb_dist_in1k"
    ):
        write_config("cait_xxs24_224_ls.pets", tmp_path / "other.json")
    assert not (tmp_path / "other.json").exists()
