"""The API reference builds with Sphinx, warnings as errors (``sphinx-build -W -b html docs OUT``).

``docs/conf.py`` generates it from the numpy-style docstrings of the public API (autodoc +
napoleon); a docstring that Sphinx cannot parse, or a name the reference lists that no longer
exists, fails this test. The ``test`` extra installs Sphinx, so CI runs it.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("sphinx")

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_sphinx_builds_without_warnings(tmp_path):
    out = tmp_path / "html"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "python"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                           "-d", str(tmp_path / "doctrees"), str(REPO / "docs"), str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    page = (out / "reference.html").read_text()
    for name in ("relax_kvcache.PagedAttentionKVCache.begin_forward", "relax_kvcache.KVCacheConfig",
                 "relax_kvcache.deploy.load", "relax_kvcache.frontend.PagedKVCache"):
        assert f'id="{name}"' in page, name


def test_reference_lists_the_public_api():
    import relax_kvcache

    text = (REPO / "docs" / "reference.rst").read_text()
    missing = [name for name in relax_kvcache.__all__ if f"relax_kvcache.{name}" not in text]
    assert not missing, f"docs/reference.rst does not document {missing}"
