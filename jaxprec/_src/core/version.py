"""jaxprec's version, in one place (``jaxprec.__version__`` re-exports it)."""

__version__ = "0.1.0.dev0"
