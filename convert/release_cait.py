"""Release pipeline for the ten official CaiT checkpoints.

For every checkpoint in :data:`RELEASES`: fetch it (or take it from ``--sources``),
check its sha256 where one is pinned, convert it to the LayerScale-module layout,
verify bit-exact parity against timm's reference model, export a Hub-ready folder
``OUT/<model>.fb_dist_in1k`` and, with ``--org``, upload it to
``ORG/<model>.fb_dist_in1k``. A summary (``summary.md`` and ``summary.json`` in
``OUT``) records, per variant: parameters, source sha256, max abs diff, bit-exactness,
seconds and peak memory. A failing variant does not stop the others; failures are
listed at the end and the exit status is 1.

Run from the repository root::

    python -m convert --out release                      # download all ten, export
    python -m convert --sources ~/deit --out release      # files already on disk
    python -m convert --out release --org my-org          # and upload
    python -m convert --only cait_xxs24_224 cait_s24_224  # a subset
    python -m convert --list                              # the table
"""

from __future__ import annotations

import argparse
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

from timm_layerscale.conversion.families import CAIT_RELEASE_URL, variants_of
from timm_layerscale.errors import LayerScaleError
from timm_layerscale.options import add_verify_args, verify_options

__all__ = ["Release", "RELEASES", "TAG", "select", "run_release", "write_summary", "main"]

TAG = "fb_dist_in1k"
BASE_URL = CAIT_RELEASE_URL


@dataclass(frozen=True)
class Release:
    """One official CaiT checkpoint.

    Attributes:
        model: The model this package registers (``cait_s24_224_ls``).
        reference: timm's model for the same weights (``cait_s24_224``).
        file: File name of the official release.
        sha256: Pinned SHA-256 of the official file, or ``None`` when unknown.
    """

    model: str
    reference: str
    file: str
    sha256: str | None = None

    @property
    def url(self) -> str:
        """Official download address."""
        return BASE_URL + self.file

    @property
    def timm_hub_id(self) -> str:
        """timm's own Hub copy of these weights (``gamma_1`` layout, safetensors)."""
        return f"timm/{self.reference}.{TAG}"

    @property
    def name(self) -> str:
        """Folder and Hub repository name: ``<model>.fb_dist_in1k``."""
        return f"{self.model}.{TAG}"


#: Pinned SHA-256 of official files, by file name. The official release publishes no
#: checksums (neither in the URLs nor in the repository), so none is pinned yet: each run
#: records the sha256 of the file it converted in its summary and model cards. Pin a
#: value here once a release has been checked, and later runs will refuse any other file.
PINNED_SHA256: dict[str, str] = {}

#: The ten official CaiT checkpoints: the ``cait`` rows of the package's variant table.
RELEASES: tuple[Release, ...] = tuple(
    Release(v.name, str(v.reference), str(v.official_file), PINNED_SHA256.get(str(v.official_file)))
    for v in variants_of("cait").values()
)


class PipelineError(Exception):
    """A variant cannot be processed (missing source, checksum mismatch)."""


def _keys(rel: Release) -> set[str]:
    stem = rel.file.rsplit(".", 1)[0]
    return {k.lower() for k in (rel.model, rel.reference, rel.name, rel.file, stem, f"{rel.reference}.{TAG}")}


def select(names: Sequence[str] | None) -> list[Release]:
    """The releases named by ``names`` (model, timm name or file stem, any case), in table order.

    Raises:
        PipelineError: A name matches no release.
    """
    if not names:
        return list(RELEASES)
    wanted = {n.lower() for n in names}
    unknown = [n for n in names if not any(n.lower() in _keys(r) for r in RELEASES)]
    if unknown:
        known = ", ".join(r.reference for r in RELEASES)
        raise PipelineError(f"unknown variant(s) {', '.join(unknown)}; choose from: {known}")
    return [r for r in RELEASES if _keys(r) & wanted]


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
    from timm_layerscale.conversion.io import resolve_source

    if sources is not None:
        path = sources / rel.file
        if not path.is_file():
            raise PipelineError(f"{rel.file} is not in {sources}; download it from {rel.url}")
        return str(path), path
    return rel.url, resolve_source(rel.url)


def _check_sha256(rel: Release, path: Path) -> str:
    from timm_layerscale.conversion.io import sha256_file

    digest = sha256_file(path)
    if rel.sha256 is not None and digest != rel.sha256:
        raise PipelineError(f"{path} has sha256 {digest}, not the pinned {rel.sha256}; delete it and download it again")
    return digest


def _command(rel: Release, out: Path, sources: Path | None, org: str | None, private: bool, options: Any) -> str:
    from timm_layerscale.options import command_line

    return command_line(
        ("python", "-m", "convert"),
        options,
        only=rel.reference,
        out=out,
        sources=sources,
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


def format_markdown(rows: Sequence[dict[str, Any]], title: str = "CaiT release") -> str:
    """The summary as a markdown table, failures listed below it."""
    push = any(r.get("repo_id") for r in rows)
    head = [
        "variant",
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
            f"`{r['variant']}`",
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
        "failed": [r["variant"] for r in rows if r["status"] != "ok"],
    }
    md, js = out / "summary.md", out / "summary.json"
    for path, text in ((md, format_markdown(rows)), (js, json.dumps(data, indent=2) + "\n")):
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    return md, js


def format_table() -> str:
    """The release table as plain text (``--list``)."""
    rows = [("model", "official file", "timm Hub id", "sha256")]
    rows += [(r.model, r.url, r.timm_hub_id, r.sha256 or "not published") for r in RELEASES]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m convert",
        description="Convert, verify, export (and upload) every official CaiT checkpoint.",
        epilog="examples (from the repository root):\n"
        + __doc__.split("Run from the repository root::", 1)[1].strip("\n"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", default="release", metavar="DIR", help="output folder (default: release)")
    p.add_argument("--sources", metavar="DIR", help="take the official .pth files from DIR instead of downloading them")
    p.add_argument("--org", metavar="ORG", help="upload each folder to ORG/<model>.fb_dist_in1k")
    p.add_argument("--private", action="store_true", help="with --org, create the repositories as private")
    p.add_argument("--only", nargs="+", metavar="NAME", help="process only these variants (cait_s24_224, S24_224, ...)")
    p.add_argument("--overwrite", action="store_true", help="replace existing output folders")
    p.add_argument("--list", action="store_true", help="print the release table and exit")
    add_verify_args(p)
    return p


def _preflight(releases: Sequence[Release], sources: Path | None, org: str | None) -> None:
    """Check, before converting anything, what would make every variant fail: no network, no token.

    Raises:
        HubError: The official files must be downloaded (or the folders uploaded)
            and the network is off (``HF_HUB_OFFLINE``, or names do not resolve),
            or ``org`` is given and no Hub token is set.
    """
    from timm_layerscale.hub.download import cached_url_path, check_online, hub_endpoint
    from timm_layerscale.hub.upload import require_token

    missing = [r for r in releases if sources is None and not cached_url_path(r.url).is_file()]
    if missing:
        check_online(BASE_URL, f"downloading {len(missing)} official file(s) such as {missing[0].file}")
    if org:
        check_online(hub_endpoint(), f"uploading to {org}")
        require_token()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the pipeline; return 0 when every variant succeeded, 1 when any failed, 2 on bad input.

    Every error line starts with ``python -m convert: error:``.
    """
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(args_list)
    if args.list:
        print(format_table())
        return 0

    def error(message: str) -> int:
        print(f"{parser.prog}: error: {message}", file=sys.stderr)
        return 2

    try:
        releases = select(args.only)
    except PipelineError as e:
        return error(str(e))
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
    from tqdm.auto import tqdm

    rows = []
    bar = tqdm(releases, desc="CaiT release", unit="model", file=sys.stderr)
    for rel in bar:
        bar.set_postfix_str(rel.reference)
        row = run_release(
            rel, out, sources=sources, org=args.org, private=args.private, overwrite=args.overwrite, options=options
        )
        rows.append(row)
        done = "ok" if row["status"] == "ok" else f"FAILED: {row['error']}"
        bar.write(f"{rel.reference}: {done} ({row['seconds']:.1f} s)", file=sys.stderr)
    bar.close()
    md, js = write_summary(out, rows, args_list)
    print(format_markdown(rows), end="")
    print(f"summary written to {md} and {js}")
    failed = [r for r in rows if r["status"] != "ok"]
    if failed:
        print(f"{parser.prog}: error: {len(failed)} of {len(rows)} variant(s) failed:", file=sys.stderr)
        for r in failed:
            print(f"  {r['reference']}: {r['error']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
