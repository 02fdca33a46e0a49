"""Write the steady-step table of ``docs/design/decode.md``: ``python scripts/update_steady_table.py``.

One row a registered method: "whole model, compiled" where its steady single-token step runs in
the whole model's compiled step, else why not (``velox.decode.not_steady_because``).
``tests/test_model_step.py`` fails when the table misses a method or says otherwise.
"""

from __future__ import annotations

from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "design" / "decode.md"
BEGIN, END = "<!-- steady-table -->\n", "<!-- /steady-table -->"


def table() -> str:
    import velox  # noqa: F401  (registers every method)
    from velox import decode
    from velox.registry import get_method, method_keys

    rows = ["| method | steady decode step (`velox.decode.not_steady_because`) |", "|---|---|"]
    for k in method_keys():
        why = decode.not_steady_because(get_method(k))
        rows.append(f"| {k} | " + ("whole model, compiled" if why is None else "layer by layer: " + why) + " |")
    return "\n".join(rows) + "\n"


def main() -> None:
    text = DOC.read_text(encoding="utf-8")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    DOC.write_text(head + BEGIN + table() + END + tail, encoding="utf-8")


if __name__ == "__main__":
    main()
