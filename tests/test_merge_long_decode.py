"""benchmarks/merge_long_decode.py: rows of several long-decode runs under one reference."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import merge_long_decode as mld  # noqa: E402

PROTOCOL = {"text": "pride", "prefill": 1536, "score": 512}


def _run(*rows, protocol=PROTOCOL, full=17.77):
    out = [{"row": "full", "method": "full", "figures": {"ppl": full}}]
    out += [{"row": r, "method": r.split(":")[0], "figures": {"ppl": 18.0 + i}} for i, r in enumerate(rows)]
    return {"model": "m", "protocol": dict(protocol), "rows": out}


def test_rows_are_kept_once_in_order_or_as_named():
    meta, rows = mld.merge([_run("kivi:bits=2", "xkv"), _run("xkv", "palu")])
    assert [r["row"] for r in rows] == ["full", "kivi:bits=2", "xkv", "palu"]
    assert rows[2]["figures"]["ppl"] == 19.0  # the first file's xkv
    _, rows = mld.merge([_run("kivi:bits=2", "xkv"), _run("palu")], ["palu", "full"])
    assert [r["row"] for r in rows] == ["palu", "full"]
    with pytest.raises(SystemExit, match="rows not in the files"):
        mld.merge([_run("xkv")], ["svdq"])


def test_another_protocol_or_reference_is_refused():
    with pytest.raises(SystemExit, match="runs differ in protocol"):
        mld.merge([_run("xkv"), _run("palu", protocol=dict(PROTOCOL, score=256))])
    with pytest.raises(SystemExit, match="another reference"):
        mld.merge([_run("xkv"), _run("palu", full=17.9)])
    with pytest.raises(SystemExit, match="no run holds a full-cache row"):
        mld.merge([{"model": "m", "protocol": PROTOCOL, "rows": []}])
