"""One table and plot from several runs of ``benchmarks/long_decode_quality.py``.

Each run writes its rows beside a full-cache row, under one protocol (text, prefill, scored
steps, chunk, bootstrap). This script reads their JSON files, refuses runs of another model
or protocol, or whose full-cache perplexity differs beyond rounding (1e-5: the reference all rows are measured
against must be the same), keeps the first row of each name (``--rows`` picks and orders
them; default: every row once, in file order), and writes the table (the benchmark's own
Markdown) and its plot (bytes against perplexity change and KL)::

    python benchmarks/merge_long_decode.py docs/results/codecs/long-decode-smollm2.json \\
        docs/results/crosslayer/long-decode-smollm2.json ... \\
        --md docs/results/lowrank/long-decode-all.md --plot docs/results/lowrank/long-decode-all.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import long_decode_quality as ldq  # noqa: E402


def merge(runs: list[dict[str, Any]], names: list[str] | None = None) -> tuple[dict, list]:
    """The first run's header (its command replaced by the files') and the rows, checked."""
    first = runs[0]
    keys = ("model", "protocol")
    full = None
    rows: dict[str, dict[str, Any]] = {}
    for run in runs:
        for k in keys:
            if run[k] != first[k]:
                raise SystemExit(f"runs differ in {k}: {run[k]!r} against {first[k]!r}")
        for r in run["rows"]:
            if r["method"] == ldq.FULL and not r.get("error"):
                ppl = r["figures"]["ppl"]
                if full is not None and abs(ppl - full) > 1e-5 * full:  # rounding of another machine
                    raise SystemExit(f"full-cache perplexity {ppl} against {full}: another reference")
                full = ppl
            rows.setdefault(r["row"], r)
    if full is None:
        raise SystemExit("no run holds a full-cache row")
    if names:
        missing = [n for n in names if n not in rows]
        if missing:
            raise SystemExit(f"rows not in the files: {missing}; they hold {sorted(rows)}")
        picked = [rows[n] for n in names]
    else:
        picked = list(rows.values())
    return first, picked


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--rows", nargs="+", help="row names to keep, in order (default: all)")
    ap.add_argument("--md", type=Path, required=True)
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--title", default="Long decode on SmolLM2: bytes against quality")
    args = ap.parse_args(argv)
    runs = [json.loads(f.read_text()) for f in args.files]
    meta, rows = merge(runs, args.rows)
    meta = dict(meta, command="python " + " ".join(
        [Path(sys.argv[0]).as_posix()] + [str(a) for a in (argv if argv is not None else sys.argv[1:])]))
    text = ldq._markdown(meta, rows)
    text += "\nRows gathered from " + ", ".join(f"`{f.as_posix()}`" for f in args.files) + \
        " (one protocol, one full-cache reference; each row's own command is in its file).\n"
    args.md.write_text(text, encoding="utf-8")
    if args.plot:
        err = ldq._plot(rows, args.plot, args.title)
        if err:
            print(err)
    print(text)


if __name__ == "__main__":
    main()
