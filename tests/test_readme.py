"""The README stays true: its method table is generated from specs/, its example runs."""

import pathlib
import re

from velox.spec import method_table

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_method_table_is_current():
    text = README.read_text()
    table = re.search(r"<!-- methods:begin -->\n(.*?)<!-- methods:end -->", text, re.S).group(1)
    assert table == method_table(), "run: python scripts/update_readme_table.py"


def test_decoding_loop_example_runs(capsys):
    text = README.read_text()
    block = re.search(r"## A decoding loop with TOVA\n\n```python\n(.*?)```", text, re.S).group(1)
    exec(compile(block, "README.md", "exec"), {})
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "(1, 8, 256, 64)"
    assert "bytes held" in out[2]
