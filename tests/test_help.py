"""``help(mtpmeta)`` shows the public API, not the package's private import helper.

Failure story: ``help(mtpmeta)`` listed ``_load_source_tree_native`` (the loader of the
source tree's ``native/`` folder) under FUNCTIONS, the first thing a user saw beside the
classes.
"""

from __future__ import annotations

import pydoc

import mtpmeta


def test_help_does_not_show_the_source_tree_loader():
    text = pydoc.render_doc(mtpmeta, renderer=pydoc.plaintext)
    assert "_load_source_tree_native" not in text
    assert not hasattr(mtpmeta, "_load_source_tree_native")


def test_help_shows_the_public_api():
    """The check above reads the real help text: the public names are in it."""
    text = pydoc.render_doc(mtpmeta, renderer=pydoc.plaintext)
    for name in ("MTPMetadata", "ContextGPUView", "ForwardShape", "MTPForwardMode"):
        assert name in text, name
