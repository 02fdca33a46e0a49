"""Rewrite the method table in README.md from specs/ (the test suite checks it is current)."""

import pathlib
import re

from velox.spec import method_table

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BEGIN, END = "<!-- methods:begin -->", "<!-- methods:end -->"


def render(text: str) -> str:
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    return pattern.sub(BEGIN + "\n" + method_table() + END, text)


if __name__ == "__main__":
    README.write_text(render(README.read_text()))
