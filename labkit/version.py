"""labkit's version (``labkit.__version__``), on the ground floor: run metadata records it."""
__version__ = "0.1.0"
