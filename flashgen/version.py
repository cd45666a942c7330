"""flashgen's version (recorded in every emitted source, binary cache key and tuned table)."""

__version__ = "0.1.0"
