"""The package version, in one place (the console script reads it without the package)."""

__version__ = "0.1.0"
