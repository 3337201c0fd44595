"""Shim for tools that still call setup.py; all metadata lives in pyproject.toml.

The one non-obvious piece, the ``package_dir`` mapping that installs the top-level
``native/`` folder as ``mtpmeta.native``, is declared there under [tool.setuptools].
"""

from setuptools import setup

setup()
