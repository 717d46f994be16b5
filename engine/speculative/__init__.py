"""Speculative decoding: proposers (`ngram`, `suffix`, `draft_model`), the acceptance rule (`verify`), the
speculation length policy (`policy`, pure: importable without torch) and `speculator`, which
wires them into the engine's step. Import the submodules directly."""
