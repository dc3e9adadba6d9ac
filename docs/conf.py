"""Sphinx configuration: the API reference, generated from the numpy-style docstrings.

Build: ``pip install -e ".[docs]" && sphinx-build -W -b html docs /tmp/html``.
Only the ``.rst`` pages are Sphinx sources; the Markdown guides next to them are read as they are.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

project = "relax_kvcache"
author = "relax_kvcache contributors"
copyright = "2026, relax_kvcache contributors"  # noqa: A001

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]

source_suffix = {".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "img"]

napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_rtype = False

autodoc_member_order = "bysource"
autodoc_typehints = "none"
autodoc_default_options = {"show-inheritance": True}

html_theme = "alabaster"
html_static_path = []
