"""README.md and the guides in docs/ as a contract: every fenced code block runs as written."""

from __future__ import annotations

import ast
import contextlib
import io
import os
import re
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import ROOT

README = ROOT / "README.md"
DOCUMENTS = [README, *sorted((ROOT / "docs").glob("*.md"))]
NETWORK = re.compile(r"#\s*\[network\]")
#: Programs whose commands the README shows but this test does not run, and why.
NOT_RUN = {
    "make": "the make targets are the test harness itself; CI runs them",
    "pip": "installs packages from PyPI",
    "hf": "huggingface_hub's own command line (logs in to the Hub)",
    "pre-commit": "installs a git hook into the clone",
}
#: Seconds within which a network line must fail when offline.
FAST = 20.0  # retries took 25-51 s; a statement may first build its model (seconds on a busy machine)


@dataclass
class Block:
    language: str
    code: str
    line: int  # line of the opening fence
    document: str = "README.md"

    @property
    def id(self) -> str:
        return f"{self.document}:{self.line}:{self.language}"


def readme_blocks(text: str, document: str = "README.md") -> list[Block]:
    """Every fenced code block of a Markdown text, in order."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = re.match(r"^(\s*)(`{3,}|~{3,})\s*([{}\w+-]*)", lines[i])
        if not m:
            i += 1
            continue
        indent, fence, language = m.groups()
        body, j = [], i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j])
            j += 1
        blocks.append(Block(language.lower(), "\n".join(body) + "\n", i + 1, document))
        i = j + 1
    return blocks


BLOCKS = [
    block
    for path in DOCUMENTS
    for block in readme_blocks(path.read_text(encoding="utf-8"), path.relative_to(ROOT).as_posix())
    if not block.language.startswith("{")
]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    import shutil

    import timm
    import torch
    from PIL import Image

    import timm_layerscale  # noqa: F401
    from helpers import fine_tuned, gamma_file
    from timm_layerscale.conversion.rules import to_gamma
    from timm_layerscale.demo import write_official_checkpoint
    from timm_layerscale.families import get_variant
    from timm_layerscale.families.vit5 import official_model
    from timm_layerscale.parity.inputs import seed_parameters_

    work = tmp_path_factory.mktemp("prepared")
    write_official_checkpoint(work / "XXS24_224.pth", "cait_xxs24_224", seed=0)
    deit3 = seed_parameters_(timm.create_model("deit3_small_patch16_224"), seed=3)
    torch.save(gamma_file(to_gamma(deit3.state_dict(), "deit3"), "deit3"), work / "deit_3_small_224_1k.pth")
    vit5 = official_model(get_variant("vit5_small_patch16_224"))
    model_sd = {k: v.clone() for k, v in seed_parameters_(vit5, seed=7).state_dict().items()}
    ema_sd = {k: v.clone() for k, v in seed_parameters_(vit5, seed=8).state_dict().items()}
    torch.save(
        {"model": model_sd, "model_ema": ema_sd, "optimizer": {}, "epoch": 799}, work / "vit5_small_patch16_224.pth"
    )
    fine_tuned(work / "XXS24_224.pth", work / "finetuned.pth")
    (work / "labels.txt").write_text("".join(f"pet {i}\n" for i in range(10)))
    gen = torch.Generator().manual_seed(0)
    for name in ("cat.jpg", "dog.jpg"):
        pixels = torch.randint(0, 256, (256, 320, 3), generator=gen, dtype=torch.uint8).numpy()
        Image.fromarray(pixels).save(work / name)
    (work / "home" / "deit").mkdir(parents=True)
    shutil.copyfile(work / "XXS24_224.pth", work / "home" / "deit" / "XXS24_224.pth")
    return work


_FOLDERS: dict[str, Path] = {}


@pytest.fixture
def workdir(prepared, tmp_path_factory, request) -> Path:
    """The working folder of the block's document: links to the prepared files, made once."""
    document = request.node.callspec.params["block"].document
    if document not in _FOLDERS:
        folder = tmp_path_factory.mktemp("document")
        for entry in prepared.iterdir():
            (folder / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
        _FOLDERS[document] = folder
    return _FOLDERS[document]


@pytest.fixture
def offline_env(workdir, monkeypatch) -> dict[str, str]:
    import huggingface_hub.constants

    env = {
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(workdir / "hf"),
        "TORCH_HOME": str(workdir / "torch"),
        "HOME": str(workdir / "home"),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(workdir)
    return env


def _entry_point(argv: list[str]):
    """The in-process main function for a README command, and its arguments."""
    if argv[0] == "timm-layerscale":
        from timm_layerscale.cli import main

        return main, argv[1:]
    if argv[:3] == ["python", "-m", "timm_layerscale"]:
        from timm_layerscale.cli import main

        return main, argv[3:]
    if argv[:3] == ["python", "-m", "convert"]:
        from convert.release import main

        return main, argv[3:]
    return None, argv


def run_command(line: str) -> None:
    argv = [os.path.expanduser(a) if a.startswith("~") else a for a in shlex.split(line, comments=True)]
    if not argv:
        return
    if argv[0] in NOT_RUN:
        return
    main, args = _entry_point(argv)
    assert main is not None, f"README command of an unknown program, handle it in tests/test_readme.py: {line}"
    out, err = io.StringIO(), io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(args)
        except SystemExit as e:  # argparse
            code = e.code
    seconds = time.perf_counter() - t0
    if NETWORK.search(line):
        assert code in (1, 2), f"{line!r} should stop at the network boundary, got {code}: {err.getvalue()}"
        assert "error: " in err.getvalue() and "HF_HUB_OFFLINE" in err.getvalue(), err.getvalue()
        assert seconds < FAST, f"{line!r} took {seconds:.1f} s to fail offline"
    else:
        assert code == 0, f"{line!r} exited {code}:\n{out.getvalue()[-2000:]}\n{err.getvalue()[-2000:]}"


def run_python(block: Block) -> None:
    """Each top-level statement in turn, in this process (the working folder and the offline environment
    set), in a namespace of the block's own."""
    lines, namespace = block.code.splitlines(), {"__name__": "__main__"}
    for stmt in ast.parse(block.code).body:
        text = "\n".join(lines[stmt.lineno - 1 : stmt.end_lineno])
        network = any(NETWORK.search(line) for line in lines[stmt.lineno - 1 : stmt.end_lineno])
        t0 = time.perf_counter()
        try:
            exec(compile(ast.Module([stmt], []), block.id, "exec"), namespace)
        except Exception as e:
            if not network:
                raise AssertionError(f"{block.id}: README statement failed: {text}") from e
            message = f"{type(e).__name__}: {e}"
            # huggingface_hub's errors for "no network and not cached", or this package's one line.
            offline = type(e).__name__ in ("LocalEntryNotFoundError", "OfflineModeIsEnabled")
            offline |= "HF_HUB_OFFLINE" in message or (isinstance(e, OSError) and "offline mode" in message)
            assert offline, f"[network] statement failed, but not because it is offline: {text}\n{message}"
            assert time.perf_counter() - t0 < FAST, f"[network] statement took too long to fail offline: {text}"
        else:
            assert not network, f"[network] statement succeeded offline; remove the mark: {text}"


def test_the_readme_has_blocks_of_both_kinds():
    readme = [b for b in BLOCKS if b.document == "README.md"]
    assert {"python", "bash"} <= {b.language for b in readme}
    assert any(NETWORK.search(b.code) for b in readme)


def test_fence_parser_reads_languages_bodies_and_indented_fences():
    text = "x\n```bash\na  # [network]\n```\n  ```python\n  print(1)\n  ```\n~~~\nplain\n~~~\n"
    blocks = readme_blocks(text)
    assert [(b.language, b.code, b.line) for b in blocks] == [
        ("bash", "a  # [network]\n", 2),
        ("python", "print(1)\n", 5),
        ("", "plain\n", 8),
    ]


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
@pytest.mark.full
def test_readme_block_runs_as_written(block: Block, workdir: Path, offline_env: dict[str, str], few_inputs):
    if block.language in ("bash", "sh", "shell", "console"):
        for line in block.code.splitlines():
            if line.strip():
                run_command(line)
    elif block.language == "python":
        run_python(block)
    else:
        pytest.fail(f"{block.id}: no rule to run a {block.language or 'plain'!r} block; give it a language")
