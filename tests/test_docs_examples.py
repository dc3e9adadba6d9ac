"""The examples of the user documentation run as written, on the CPU.

A fenced ``python`` block directly below a ``<!-- runnable -->`` line is an example a user can
paste: the blocks of each page run in order, as one script, in a fresh interpreter (so the
page's own imports are what the example gets) in a temporary folder. The examples check their
own results (against numpy) where they compute something.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
MARK = "<!-- runnable -->"
#: Pages with runnable examples and how many each must have (a lost marker fails the test).
PAGES = {"docs/getting-started.md": 3, "README.md": 1}


def runnable_blocks(text: str) -> list:
    """The code of every ``python`` block that directly follows the marker line."""
    pattern = re.compile(re.escape(MARK) + r"\s*\n```python\n(.*?)^```", re.S | re.M)
    return pattern.findall(text)


def test_marker_finds_only_python_blocks():
    text = f"{MARK}\n```python\nx = 1\n```\n\n```python\ny = 2\n```\n{MARK}\n```bash\nls\n```\n"
    assert runnable_blocks(text) == ["x = 1\n"]


@pytest.mark.parametrize("page", sorted(PAGES))
def test_examples_run(page, tmp_path):
    blocks = runnable_blocks((REPO / page).read_text())
    assert len(blocks) == PAGES[page], f"{page}: expected {PAGES[page]} runnable blocks, found {len(blocks)}"
    script = tmp_path / "example.py"
    script.write_text("\n".join(blocks))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "python"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, f"{page}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
