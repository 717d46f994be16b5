"""Tandem: disaggregated prefill/decode LLM serving on Ray.

The repository keeps one top-level folder per layer (engine/, kv_transfer/, ...); they install as
subpackages of this one (`tandem.engine`, `tandem.kv_transfer`, ...), mapped in pyproject.toml.
"""

__version__ = "0.1.0"
