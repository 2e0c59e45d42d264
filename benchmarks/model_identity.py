"""``model-identity``: what keying the caches on every weight byte costs at start.

:func:`mmserve.model.identity.checkpoint_digest` reads every byte of a checkpoint's files
once (XXH3-128) and remembers each file's digest by path, size, mtime, ctime and inode;
this times it with the files out of the page cache (a first start after a download or a
reboot), in the page cache with no memo, and from the memo (every restart after).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from benchmarks import report
from mmserve.model.identity import checkpoint_digest, checkpoint_files

OPTIONS: list[tuple[tuple[str, ...], dict]] = [
    (("--repeats",), dict(type=int, default=3, help="runs of each case (median)")),
]


def _drop_from_page_cache(paths: list[Path]) -> None:
    """Ask the kernel to forget the files' cached pages (written back first)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def model_identity(args: argparse.Namespace, model_dir: str) -> int:
    """``model-identity``: seconds to digest a checkpoint cold, warm and from the memo."""
    files = [real for _, real in checkpoint_files(Path(model_dir))]
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        memo = Path(tmp) / "checkpoint-digests.json"
        for case in ("cold", "warm", "memo"):
            runs = []
            for _ in range(args.repeats):
                if case != "memo":
                    memo.unlink(missing_ok=True)
                if case == "cold":
                    _drop_from_page_cache(files)
                runs.append(checkpoint_digest(model_dir, memo))
            s = statistics.median(r.seconds for r in runs)
            read = runs[0].bytes_read
            out[case] = {
                "seconds_p50": s,
                "seconds": [r.seconds for r in runs],
                "bytes_read": read,
                "bytes_total": runs[0].bytes_total,
                "files": runs[0].files,
                "memo_hits": runs[0].memo_hits,
                "gb_per_s": read / 1e9 / s if read and s else None,
                "digest": runs[0].digest.hex(),
            }
    assert len({v["digest"] for v in out.values()}) == 1, "the digest changed between runs"
    md = (
        f"checkpoint {model_dir}: {out['cold']['files']} files, "
        f"{out['cold']['bytes_total'] / 1e9:.3f} GB (median of {args.repeats})\n\n"
        "| case | seconds | GB read | GB/s | files from the memo |\n"
        "| --- | --- | --- | --- | --- |\n"
    )
    for case, label in (
        ("cold", "cold (out of the page cache)"),
        ("warm", "in the page cache, no memo"),
        ("memo", "memo (a restart)"),
    ):
        r = out[case]
        rate = f"{r['gb_per_s']:.2f}" if r["gb_per_s"] else "-"
        md += (
            f"| {label} | {r['seconds_p50']:.3f} | {r['bytes_read'] / 1e9:.3f} | {rate} "
            f"| {r['memo_hits']} / {r['files']} |\n"
        )
    return report.emit(args.out, "model_identity", out, md)
