"""Release pipeline for the official checkpoints of CaiT, DeiT-III, ViT-5, InternViT and Perception Encoder.

For every release in :func:`releases`: fetch the official file (or take it from ``--sources``),
convert and verify it into a Hub-ready folder ``OUT/<model>.<tag>`` and, with ``--org``, upload it
to ``ORG/<model>.<tag>``. ``summary.md`` and ``summary.json`` in ``OUT`` record each release's
parameters, source sha256, max abs diff, bit-exactness and seconds. A failing release does not stop the others; the exit status is then 1.

Run from the repository root::

    python -m convert --list                                # the plan: every release, offline
    python -m convert --out release                         # download all, export
    python -m convert --family cait --sources ~/deit --out release   # CaiT files already on disk
    python -m convert --family deit3 vit5 --out release --org my-org # and upload
    python -m convert --only cait_xxs24_224 deit3_small_patch16_224.fb_in1k   # a subset
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from timm_layerscale.errors import LayerScaleError
from timm_layerscale.families import VARIANTS
from timm_layerscale.families.cait import RELEASE_URL as CAIT_RELEASE_URL
from timm_layerscale.families.internvit import AUTHORS_FILE as INTERNVIT_FILE
from timm_layerscale.hub.card import timm_hub_copy
from timm_layerscale.options import OneLineParser, add_verify_args, check_inputs, verify_options
from timm_layerscale.progress import write_out

__all__ = ["Release", "FAMILIES", "releases", "select", "run_release", "write_summary", "main"]

#: The families the pipeline releases, in table order.
FAMILIES = ("cait", "deit3", "vit5", "internvit", "pe")
#: The tag of the official CaiT weights (timm's).
CAIT_TAG = "fb_dist_in1k"


@dataclass(frozen=True)
class Release:
    """One official checkpoint as one Hub repository: the model it is exported as (``cait_s24_224_ls``), its
    family, pretrained tag (``fb_dist_in1k``, ``in1k_ema``), official address (``https://`` URL or
    ``hf-hub:ORG/REPO/FILE``), timm's model for the same weights (``None`` for ViT-5), and whether to take
    the file's ``'model_ema'`` weights."""

    model: str
    family: str
    tag: str
    source: str
    reference: str | None
    ema: bool = False

    @property
    def file(self) -> str:
        """File name of the official release."""
        return os.path.basename(self.source if self.source.startswith("hf-hub:") else urlparse(self.source).path)

    @property
    def timm_hub_id(self) -> str | None:
        """timm's own Hub copy of these weights, where timm has one."""
        return timm_hub_copy(self.reference, self.tag)

    @property
    def name(self) -> str:
        """Folder and Hub repository name: ``<model>.<tag>``."""
        return f"{self.model}.{self.tag}"


@functools.cache
def releases() -> tuple[Release, ...]:
    """Every official release: the ten CaiT files, each DeiT-III tag timm registers (from its official URL),
    each ViT-5 tag this package registers (``in1k``, ``in1k_ema``: one file's two sets of weights), the authors'
    InternViT-300M and their three Perception Encoders with LayerScale."""
    import timm

    import timm_layerscale  # noqa: F401  (registers the ViT-5 tags)

    rows = []
    for v in VARIANTS:
        if v.family.name == "cait":
            src = CAIT_RELEASE_URL + str(v.official_file)
            rows.append(Release(v.name, "cait", CAIT_TAG, src, v.reference))
            continue
        if v.family.name == "internvit":  # the authors' folder, which timm's ogvl_dist copies
            rows.append(Release(v.name, "internvit", "ogvl_dist", INTERNVIT_FILE, v.reference))
            continue
        if v.family.name == "pe":  # the authors' file, facebook/<name>/<name>.pt
            src = f"hf-hub:facebook/{Path(str(v.official_file)).stem}/{v.official_file}"
            rows.append(Release(v.name, "pe", "fb", src, v.reference))
            continue
        for full in timm.list_pretrained(f"{v.name}.*"):
            cfg: Any = timm.models.get_pretrained_cfg(full)
            tag = full.split(".", 1)[1]
            if v.family.name == "deit3" and cfg.url:
                rows.append(Release(v.name, "deit3", tag, str(cfg.url), v.reference))
            elif v.family.name == "vit5" and cfg.hf_hub_id and cfg.hf_hub_filename:
                src = f"hf-hub:{cfg.hf_hub_id}/{cfg.hf_hub_filename}"
                rows.append(Release(v.name, "vit5", tag, src, None, ema=tag.endswith("_ema")))
    return tuple(rows)


class PipelineError(Exception):
    """A variant cannot be processed (a missing source, an unknown name)."""


def _keys(rel: Release) -> set[str]:
    stem = rel.file.rsplit(".", 1)[0]
    names = {rel.model, rel.name, rel.file, stem}
    if rel.reference:
        names |= {rel.reference, f"{rel.reference}.{rel.tag}"}
    return {k.lower() for k in names}


def select(names: Sequence[str] | None, families: Sequence[str] = FAMILIES) -> list[Release]:
    """The releases of ``families`` named by ``names`` (model, timm name, ``name.tag`` or file, any case), in table order.

    Raises:
        PipelineError: A name matches no release of those families.
    """
    table = [r for r in releases() if r.family in families]
    if not names:
        return table
    wanted = {n.lower() for n in names}
    unknown = [n for n in names if not any(n.lower() in _keys(r) for r in table)]
    if unknown:
        known = ", ".join(dict.fromkeys(r.reference or r.model for r in table))
        raise PipelineError(f"unknown variant(s) {', '.join(unknown)}; choose from: {known}")
    return [r for r in table if _keys(r) & wanted]


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if isinstance(e, (LayerScaleError, PipelineError)) else f"{type(e).__name__}: {text}"


def _source(rel: Release, sources: Path | None) -> str:
    """The source to convert: the official address, or the file in ``sources``."""
    if sources is None:
        return rel.source
    if not (sources / rel.file).is_file():
        raise PipelineError(f"{rel.file} is not in {sources}; download it from {rel.source}")
    return str(sources / rel.file)


def _command(rel: Release, out: Path, sources: Path | None, org: str | None, private: bool, options: Any) -> str:
    from timm_layerscale.files.read import published_path
    from timm_layerscale.options import command_line, published_options

    return command_line(
        ("python", "-m", "convert"),
        published_options(options),
        only=rel.name,
        out=published_path(out),
        sources=sources and published_path(sources),
        org=org,
        private=bool(org and private),
    )


def run_release(
    rel: Release,
    out: Path,
    *,
    sources: Path | None = None,
    org: str | None = None,
    private: bool = False,
    overwrite: bool = False,
    options: Any = None,
) -> dict[str, Any]:
    """Fetch, convert, verify, export, check and (with ``org``) push one release; never raises for a bad one.

    Returns:
        The summary row: ``variant``, ``status`` (``ok`` or ``failed``), ``error``, ``params``,
        ``source_sha256``, ``max_abs_diff``, ``bit_exact``, ``seconds``, ``folder``, ``repo_id``, ``url``.
    """
    from timm_layerscale.hub.export import export_folder
    from timm_layerscale.hub.upload import push_folder

    row: dict[str, Any] = dict.fromkeys(
        ("error", "params", "source_sha256", "max_abs_diff", "bit_exact", "folder", "url")
    )
    row.update(variant=rel.model, tag=rel.tag, family=rel.family, reference=rel.reference, file=rel.file)
    row.update(status="failed", repo_id=f"{org}/{rel.name}" if org else None)
    t0 = time.perf_counter()
    try:
        result = export_folder(
            _source(rel, sources),
            out / rel.name,
            model=rel.model,
            ema=rel.ema,
            tag=rel.tag,
            overwrite=overwrite,
            options=options,
            repo_id=row["repo_id"],
            private=private,
            command=_command(rel, out, sources, org, private, options),
        )
        digest, report = result.conversion.source_sha256, result.conversion.report
        row.update(source_sha256=digest, params=result.num_params, folder=str(result.folder))
        row.update(max_abs_diff=report.max_abs_diff if report else None, bit_exact=report.bit_exact if report else None)
        if org:
            push = push_folder(result.folder, row["repo_id"], private=private)
            row["url"] = push.commit_url or push.repo_url
        row["status"] = "ok"
    except Exception as e:  # one release's failure must not stop the others
        row["error"] = _one_line(e)
    row["seconds"] = round(time.perf_counter() - t0, 2)
    return row


def format_markdown(rows: Sequence[dict[str, Any]], title: str = "Release") -> str:
    """The summary as a markdown table, failures listed below it."""
    push = any(r.get("repo_id") for r in rows)
    head = ["release", "params (M)", "source sha256", "max abs diff", "bit-exact", "seconds", "status"]
    lines = [f"# {title}", "", "| " + " | ".join(head + ["Hub"] * push) + " |", "|" + "---|" * (len(head) + push)]
    for r in rows:
        cells = [
            f"`{r['variant']}.{r['tag']}`",
            "-" if r["params"] is None else f"{r['params'] / 1e6:.1f}",
            f"`{r['source_sha256']}`" if r["source_sha256"] else "-",
            "-" if r["max_abs_diff"] is None else f"{r['max_abs_diff']:.3g}",
            "-" if r["bit_exact"] is None else "yes" if r["bit_exact"] else "no",
            f"{r['seconds']:.1f}",
            r["status"],
        ]
        cells += [f"[{r['repo_id']}]({r['url']})" if r.get("url") else "-"] * push
        lines.append("| " + " | ".join(cells) + " |")
    failed = [r for r in rows if r["status"] != "ok"]
    if failed:
        lines += ["", "## Failures", "", *(f"- `{r['variant']}`: {r['error']}" for r in failed)]
    return "\n".join(lines) + "\n"


def write_summary(out: Path, rows: Sequence[dict[str, Any]], argv: Sequence[str]) -> tuple[Path, Path]:
    """Write ``summary.md`` and ``summary.json`` into ``out`` (each atomically)."""
    from timm_layerscale.parity.compare import versions

    out.mkdir(parents=True, exist_ok=True)
    data = {
        "command": shlex.join(["python", "-m", "convert", *argv]),
        "versions": versions(),
        "results": list(rows),
        "failed": [f"{r['variant']}.{r['tag']}" for r in rows if r["status"] != "ok"],
    }
    md, js = out / "summary.md", out / "summary.json"
    for path, text in ((md, format_markdown(rows)), (js, json.dumps(data, indent=2) + "\n")):
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    return md, js


def format_table(table: Sequence[Release]) -> str:
    """The plan as plain text (``--list``): one line per release."""
    rows = [("release", "official source", "timm Hub id")]
    rows += [(r.name + (" (EMA)" if r.ema else ""), r.source, r.timm_hub_id or "-") for r in table]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)


class _Parser(OneLineParser):
    name = "python -m convert"


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=_Parser.name,
        description="Convert, verify, export (and upload) every official CaiT, DeiT-III and ViT-5 checkpoint.",
        epilog="examples (from the repository root):\n"
        + __doc__.split("Run from the repository root::", 1)[1].strip("\n"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", default="release", metavar="DIR", help="output folder (default: release)")
    p.add_argument("--family", nargs="+", choices=FAMILIES, default=list(FAMILIES), help="families (default: all)")
    p.add_argument("--sources", metavar="DIR", help="take the official .pth files from DIR instead of downloading them")
    p.add_argument("--org", metavar="ORG", help="upload each folder to ORG/<model>.<tag>")
    p.add_argument("--private", action="store_true", help="with --org, create the repositories as private")
    p.add_argument("--only", nargs="+", metavar="NAME", help="only these (cait_s24_224, S24_224, NAME.TAG, ...)")
    p.add_argument("--overwrite", action="store_true", help="replace existing output folders")
    p.add_argument("--list", action="store_true", help="print the plan (the selected releases) and exit")
    add_verify_args(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the pipeline; return 0 when every release succeeded, 1 when any failed, 2 on bad input,
    130 when interrupted. Every error line starts with ``python -m convert: error:``."""
    from timm_layerscale import progress

    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(args_list)
    check_inputs(parser, args)
    sources = Path(args.sources) if args.sources else None
    try:
        table = select(args.only, args.family)
        if args.list:
            write_out(format_table(table))
            return 0
        options = verify_options(args)
        if sources is not None and not sources.is_dir():
            raise PipelineError(f"--sources {sources} is not a folder")
        rows = []
        given = dict(sources=sources, org=args.org, private=args.private, overwrite=args.overwrite, options=options)
        with progress.bar(table, desc="release", unit="model") as bar:
            for rel in bar:
                bar.set_postfix_str(rel.name)
                rows.append(run_release(rel, Path(args.out), **given))
                done = "ok" if rows[-1]["status"] == "ok" else f"FAILED: {rows[-1]['error']}"
                bar.write(f"{rel.name}: {done} ({rows[-1]['seconds']:.1f} s)", file=sys.stderr)
        md, js = write_summary(Path(args.out), rows, args_list)
        write_out(format_markdown(rows), end="")
        write_out(f"summary written to {md} and {js}")
    except KeyboardInterrupt:
        print(f"{parser.prog}: error: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of the output left
        return 141
    except (LayerScaleError, PipelineError) as e:  # bad options, or the output refused the summary
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    failed = [r for r in rows if r["status"] != "ok"]
    if failed:
        print(f"{parser.prog}: error: {len(failed)} of {len(rows)} release(s) failed:", file=sys.stderr)
        for r in failed:
            print(f"  {r['variant']}.{r['tag']}: {r['error']}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
