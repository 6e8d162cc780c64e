"""The package's version, at the bottom of the package so that every layer can name it
(exporter/__init__.py re-exports it as exporter.__version__; pyproject.toml repeats it)."""

__version__ = "0.1.0"
