"""Compile workers and the `nkicache` command line."""

# The project's version, read by setuptools at build time (pyproject.toml), so that `nkicache --version` needs
# no importlib.metadata (with the email and zipfile modules it loads, a quarter of a bare start-up).
__version__ = "0.1.0"
