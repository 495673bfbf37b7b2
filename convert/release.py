"""Release pipeline for the official checkpoints of every family: CaiT, DeiT-III and ViT-5.

For every release in :func:`releases`: fetch the official file (or take it from
``--sources``), check its sha256 where one is pinned, convert it, verify it against its
reference, export a Hub-ready folder ``OUT/<model>.<tag>`` and, with ``--org``, upload
it to ``ORG/<model>.<tag>``. A summary (``summary.md`` and ``summary.json`` in ``OUT``)
records, per release: parameters, source sha256, max abs diff, bit-exactness, seconds
and peak memory. A failing release does not stop the others; failures are listed at
the end and the exit status is 1.

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
import resource
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from timm_layerscale.commands import stoppable
from timm_layerscale.errors import LayerScaleError
from timm_layerscale.families import CAIT_RELEASE_URL, OFFICIAL_SHA256, VARIANTS
from timm_layerscale.hub.card import timm_hub_copy
from timm_layerscale.options import OneLineParser, add_verify_args, check_inputs, verify_options
from timm_layerscale.progress import write_out

__all__ = ["Release", "FAMILIES", "releases", "select", "run_release", "write_summary", "main"]

#: The families the pipeline releases, in table order.
FAMILIES = ("cait", "deit3", "vit5")
#: The tag of the official CaiT weights (timm's).
CAIT_TAG = "fb_dist_in1k"


@dataclass(frozen=True)
class Release:
    """One official checkpoint, as one Hub repository.

    Attributes:
        model: The model the folder is exported as (``cait_s24_224_ls``, ``deit3_small_patch16_224``).
        family: ``cait``, ``deit3`` or ``vit5``.
        tag: The pretrained tag (``fb_dist_in1k``, ``fb_in22k_ft_in1k``, ``in1k_ema``).
        source: The official address: an ``https://`` URL or ``hf-hub:ORG/REPO/FILE``.
        reference: timm's model for the same weights, or ``None`` (ViT-5).
        ema: Take the file's ``'model_ema'`` weights.
    """

    model: str
    family: str
    tag: str
    source: str
    reference: str | None
    ema: bool = False

    @property
    def file(self) -> str:
        """File name of the official release."""
        return (
            self.source.rsplit("/", 1)[-1]
            if self.source.startswith("hf-hub:")
            else os.path.basename(urlparse(self.source).path)
        )

    @property
    def sha256(self) -> str | None:
        """Pinned SHA-256 of the official file (:data:`OFFICIAL_SHA256`), or ``None`` when unknown."""
        return OFFICIAL_SHA256.get(self.file)

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
    """Every official release of the variant table, read from timm's registry.

    CaiT: the ten official files (``CAIT_RELEASE_URL + official_file``). DeiT-III: each
    pretrained tag timm registers for the variant, from its official URL. ViT-5: each tag
    this package registers (``in1k``, ``in1k_ema``: the same file, its two sets of weights)
    from the official Hub repository.
    """
    import timm

    import timm_layerscale  # noqa: F401  (registers the ViT-5 tags)

    rows = []
    for v in VARIANTS:
        if v.family == "cait":
            src = CAIT_RELEASE_URL + str(v.official_file)
            rows.append(Release(v.name, "cait", CAIT_TAG, src, v.reference))
            continue
        for full in timm.list_pretrained(f"{v.name}.*"):
            cfg: Any = timm.models.get_pretrained_cfg(full)
            tag = full.split(".", 1)[1]
            if v.family == "deit3" and cfg.url:
                rows.append(Release(v.name, "deit3", tag, str(cfg.url), v.reference))
            elif v.family == "vit5" and cfg.hf_hub_id and cfg.hf_hub_filename:
                src = f"hf-hub:{cfg.hf_hub_id}/{cfg.hf_hub_filename}"
                rows.append(Release(v.name, "vit5", tag, src, None, ema=tag.endswith("_ema")))
    return tuple(rows)


class PipelineError(Exception):
    """A variant cannot be processed (missing source, checksum mismatch)."""


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


class PeakMemory:
    """Peak resident memory of this process over a ``with`` block, in MiB.

    On Linux the kernel's high-water mark is reset on entry (``/proc/self/clear_refs``)
    and read on exit (``VmHWM``), which gives the peak of the block itself. Elsewhere
    it is the peak of the whole process so far (``ru_maxrss``), and :attr:`scope`
    says so.
    """

    def __init__(self) -> None:
        self.mib: float | None = None
        self.scope = "variant"

    def __enter__(self) -> PeakMemory:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            self.scope = "process"
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.scope == "variant":
            try:
                with open("/proc/self/status") as f:
                    for line in f:
                        if line.startswith("VmHWM:"):
                            self.mib = int(line.split()[1]) / 1024
                            return
            except OSError:
                pass
            self.scope = "process"
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        self.mib = rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    from timm_layerscale.errors import LayerScaleError

    return text if isinstance(e, (LayerScaleError, PipelineError)) else f"{type(e).__name__}: {text}"


def _fetch(rel: Release, sources: Path | None) -> tuple[str, Path]:
    """The source to convert (as given to the converter) and its local file."""
    from timm_layerscale.files.sources import resolve_source

    if sources is not None:
        path = sources / rel.file
        if not path.is_file():
            raise PipelineError(f"{rel.file} is not in {sources}; download it from {rel.source}")
        return str(path), path
    return rel.source, resolve_source(rel.source)


def _check_sha256(rel: Release, path: Path) -> str:
    from timm_layerscale.files.read import sha256_file

    digest = sha256_file(path)
    if rel.sha256 is not None and digest != rel.sha256:
        raise PipelineError(f"{path} has sha256 {digest}, not the pinned {rel.sha256}; delete it and download it again")
    return digest


def _command(rel: Release, out: Path, sources: Path | None, org: str | None, private: bool, options: Any) -> str:
    from timm_layerscale.files.sources import published_path
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
    """Fetch, check, convert, verify, export (and push) one checkpoint; never raises for a bad variant.

    Returns:
        The summary row: ``variant``, ``status`` (``ok`` or ``failed``), ``error``,
        ``params``, ``source_sha256``, ``max_abs_diff``, ``bit_exact``, ``seconds``,
        ``peak_memory_mib``, ``folder``, ``repo_id`` and ``url``.
    """
    from timm_layerscale.hub.export import export_folder

    row: dict[str, Any] = {
        "variant": rel.model,
        "tag": rel.tag,
        "family": rel.family,
        "reference": rel.reference,
        "file": rel.file,
        "status": "failed",
        "error": None,
        "params": None,
        "source_sha256": None,
        "max_abs_diff": None,
        "bit_exact": None,
        "seconds": None,
        "peak_memory_mib": None,
        "folder": None,
        "repo_id": f"{org}/{rel.name}" if org else None,
        "url": None,
    }
    t0 = time.perf_counter()
    with PeakMemory() as peak:
        try:
            source, path = _fetch(rel, sources)
            row["source_sha256"] = _check_sha256(rel, path)
            result = export_folder(
                source,
                out / rel.name,
                model=rel.model,
                ema=rel.ema,
                tag=rel.tag,
                overwrite=overwrite,
                options=options,
                push_to_hub=row["repo_id"],
                private=private,
                command=_command(rel, out, sources, org, private, options),
            )
            report = result.conversion.report
            row.update(
                status="ok",
                params=result.num_params,
                folder=str(result.folder),
                source_sha256=result.conversion.source_sha256,
                max_abs_diff=report.max_abs_diff if report else None,
                bit_exact=report.bit_exact if report else None,
                url=(result.push.commit_url or result.push.repo_url) if result.push else None,
            )
        except Exception as e:  # one variant's failure must not stop the others
            row["error"] = _one_line(e)
    row["seconds"] = round(time.perf_counter() - t0, 2)
    row["peak_memory_mib"] = round(peak.mib, 1) if peak.mib is not None else None
    row["peak_memory_scope"] = peak.scope
    return row


def _fmt(value: Any, kind: str) -> str:
    if value is None:
        return "-"
    if kind == "params":
        return f"{value / 1e6:.1f}"
    if kind == "diff":
        return f"{value:.3g}"
    if kind == "bool":
        return "yes" if value else "no"
    if kind == "float1":
        return f"{value:.1f}"
    return str(value)


def format_markdown(rows: Sequence[dict[str, Any]], title: str = "Release") -> str:
    """The summary as a markdown table, failures listed below it."""
    push = any(r.get("repo_id") for r in rows)
    head = [
        "release",
        "params (M)",
        "source sha256",
        "max abs diff",
        "bit-exact",
        "seconds",
        "peak memory (MiB)",
        "status",
    ]
    if push:
        head.append("Hub")
    lines = [f"# {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [
            f"`{r['variant']}.{r['tag']}`" if r.get("tag") else f"`{r['variant']}`",
            _fmt(r["params"], "params"),
            f"`{r['source_sha256']}`" if r["source_sha256"] else "-",
            _fmt(r["max_abs_diff"], "diff"),
            _fmt(r["bit_exact"], "bool"),
            _fmt(r["seconds"], "float1"),
            _fmt(r["peak_memory_mib"], "float1"),
            r["status"],
        ]
        if push:
            cells.append(f"[{r['repo_id']}]({r['url']})" if r.get("url") else "-")
        lines.append("| " + " | ".join(cells) + " |")
    failed = [r for r in rows if r["status"] != "ok"]
    if failed:
        lines += ["", "## Failures", ""]
        lines += [f"- `{r['variant']}`: {r['error']}" for r in failed]
    if any(r.get("peak_memory_scope") == "process" for r in rows):
        lines += ["", "Peak memory is the process peak so far (this system cannot reset it per variant)."]
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
    rows = [("release", "official source", "timm Hub id", "sha256")]
    rows += [
        (r.name + (" (EMA)" if r.ema else ""), r.source, r.timm_hub_id or "-", r.sha256 or "not pinned") for r in table
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
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
    p.add_argument(
        "--family", nargs="+", choices=FAMILIES, default=list(FAMILIES), help="families to release (default: all)"
    )
    p.add_argument("--sources", metavar="DIR", help="take the official .pth files from DIR instead of downloading them")
    p.add_argument("--org", metavar="ORG", help="upload each folder to ORG/<model>.<tag>")
    p.add_argument("--private", action="store_true", help="with --org, create the repositories as private")
    p.add_argument(
        "--only",
        nargs="+",
        metavar="NAME",
        help="process only these releases (cait_s24_224, S24_224, deit3_small_patch16_224.fb_in1k, ...)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace existing output folders")
    p.add_argument("--list", action="store_true", help="print the plan (the selected releases) and exit")
    add_verify_args(p)
    return p


def _cached(rel: Release) -> bool:
    """Whether the official file is in the download cache already."""
    if rel.source.startswith("hf-hub:"):
        from huggingface_hub import try_to_load_from_cache

        repo, _, filename = rel.source[len("hf-hub:") :].rpartition("/")
        return isinstance(try_to_load_from_cache(repo, filename), str)
    from timm_layerscale.files.sources import cached_url_path

    return cached_url_path(rel.source).is_file()


def _preflight(releases: Sequence[Release], sources: Path | None, org: str | None) -> None:
    """Check, before converting anything, what would make every variant fail: no network, no token.

    Raises:
        HubError: The official files must be downloaded (or the folders uploaded)
            and the network is off (``HF_HUB_OFFLINE``, or names do not resolve),
            or ``org`` is given and no Hub token is set.
    """
    from timm_layerscale.files.sources import check_online, hub_endpoint
    from timm_layerscale.hub.upload import require_token

    missing = [r for r in releases if sources is None and not _cached(r)]
    for rel in missing[:1]:
        where = hub_endpoint() if rel.source.startswith("hf-hub:") else rel.source
        check_online(where, f"downloading {len(missing)} official file(s) such as {rel.file}")
    if org:
        check_online(hub_endpoint(), f"uploading to {org}")
        require_token()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the pipeline; return 0 when every variant succeeded, 1 when any failed, 2 on bad input.

    Every error line starts with ``python -m convert: error:``; 130 when interrupted, 143 when
    terminated (the variant being written leaves nothing behind).
    """
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(args_list)
    check_inputs(parser, args)

    def error(message: str) -> int:
        print(f"{parser.prog}: error: {message}", file=sys.stderr)
        return 2

    try:
        return stoppable(lambda: _run(args, args_list, parser.prog, error), error)
    except LayerScaleError as e:  # the output refused the summary (a full device)
        return error(str(e))


def _run(args: argparse.Namespace, args_list: list[str], prog: str, error: Any) -> int:
    try:
        releases = select(args.only, args.family)
    except PipelineError as e:
        return error(str(e))
    if args.list:
        write_out(format_table(releases))
        return 0
    try:
        options = verify_options(args)
    except LayerScaleError as e:
        return error(str(e))
    sources = Path(args.sources) if args.sources else None
    if sources is not None and not sources.is_dir():
        return error(f"--sources {sources} is not a folder")
    from timm_layerscale.errors import HubError

    try:
        _preflight(releases, sources, args.org)
    except HubError as e:
        return error(str(e))
    out = Path(args.out)
    from timm_layerscale import progress

    rows = []
    bar = progress.bar(releases, desc="release", unit="model")
    for rel in bar:
        bar.set_postfix_str(rel.name)
        row = run_release(
            rel, out, sources=sources, org=args.org, private=args.private, overwrite=args.overwrite, options=options
        )
        rows.append(row)
        done = "ok" if row["status"] == "ok" else f"FAILED: {row['error']}"
        bar.write(f"{rel.name}: {done} ({row['seconds']:.1f} s)", file=sys.stderr)
    bar.close()
    md, js = write_summary(out, rows, args_list)
    write_out(format_markdown(rows), end="")
    write_out(f"summary written to {md} and {js}")
    failed = [r for r in rows if r["status"] != "ok"]
    if failed:
        print(f"{prog}: error: {len(failed)} of {len(rows)} release(s) failed:", file=sys.stderr)
        for r in failed:
            print(f"  {r['variant']}.{r['tag']}: {r['error']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
