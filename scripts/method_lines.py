"""Lines of each method module: its own rule against everything else.

    python scripts/method_lines.py                 # the working tree
    python scripts/method_lines.py --rev 32cad02   # a commit (read with git show)
    python scripts/method_lines.py --compare 32cad02   # both, side by side

A module's code lines (not blank, not comments, not docstrings) are split in two:

* **rule**: lines inside functions other than ``init`` (its scores, selections, kernels'
  inputs, the backends it writes itself, its helpers);
* **rest**: every other code line: imports, ``__all__``, the state record, ``init`` (its
  signature and body), registration, wrappers, module constants.

Docstring and comment lines are counted apart (``docs``). A wrapper such as
``def <key>_update(...): return dispatch(...)`` counts as rest: it restates, it is no rule.
"""

from __future__ import annotations

import argparse
import ast
import io
import subprocess
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHODS = "velox/methods"
_GLUE_NAMES = ("init", "update", "get_kv", "bytes", "nbytes")


def _is_glue(name: str, key: str) -> bool:
    """Functions that restate rather than rule: ``init`` and the old per-method wrappers."""
    return name in _GLUE_NAMES or name in {f"{key}_{n}" for n in _GLUE_NAMES}


def _doc_lines(tree: ast.AST) -> set[int]:
    out: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            out.update(range(body[0].lineno, body[0].end_lineno + 1))
    return out


def count(source: str, key: str) -> dict[str, int]:
    tree = ast.parse(source)
    docs = _doc_lines(tree)
    comments = {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                if tok.type == tokenize.COMMENT}
    rule_lines: set[int] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_glue(node.name, key):
            # the body after the def line(s); the signature is rest
            first = node.body[0].lineno
            rule_lines.update(range(first, node.end_lineno + 1))
    lines = source.splitlines()
    out = dict(rule=0, rest=0, docs=0)
    for i, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        if i in docs or (i in comments and text.strip().startswith("#")):
            out["docs"] += 1
        elif i in rule_lines:
            out["rule"] += 1
        else:
            out["rest"] += 1
    return out


def _sources(rev: str | None) -> dict[str, str]:
    if rev is None:
        return {p.stem: p.read_text() for p in sorted((ROOT / METHODS).glob("*.py"))
                if not p.name.startswith("_")}
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:{METHODS}"], cwd=ROOT,
                           check=True, capture_output=True, text=True).stdout.split()
    return {n[:-3]: subprocess.run(["git", "show", f"{rev}:{METHODS}/{n}"], cwd=ROOT, check=True,
                                   capture_output=True, text=True).stdout
            for n in names if n.endswith(".py") and not n.startswith("_")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", help="count at this git revision instead of the working tree")
    ap.add_argument("--compare", metavar="REV", help="print REV and the working tree side by side")
    args = ap.parse_args()
    if args.compare:
        before, after = _sources(args.compare), _sources(None)
        print(f"| method | rule before | rest before | rule now | rest now | rest share before -> now |")
        print("|---|---|---|---|---|---|")
        tot = dict(rb=0, sb=0, ra=0, sa=0)
        for key in sorted(set(before) | set(after)):
            b = count(before[key], key) if key in before else dict(rule=0, rest=0)
            a = count(after[key], key) if key in after else dict(rule=0, rest=0)
            share = lambda c: c["rest"] / max(1, c["rule"] + c["rest"])  # noqa: E731
            print(f"| {key} | {b['rule']} | {b['rest']} | {a['rule']} | {a['rest']} | "
                  f"{share(b):.0%} -> {share(a):.0%} |")
            tot["rb"] += b["rule"]; tot["sb"] += b["rest"]; tot["ra"] += a["rule"]; tot["sa"] += a["rest"]
        print(f"| **all** | {tot['rb']} | {tot['sb']} | {tot['ra']} | {tot['sa']} | "
              f"{tot['sb'] / (tot['rb'] + tot['sb']):.0%} -> {tot['sa'] / (tot['ra'] + tot['sa']):.0%} |")
        return
    print("| method | rule | rest | docs |")
    print("|---|---|---|---|")
    for key, src in _sources(args.rev).items():
        c = count(src, key)
        print(f"| {key} | {c['rule']} | {c['rest']} | {c['docs']} |")


if __name__ == "__main__":
    main()
