"""Speculative decoding: proposers (`ngram`, `suffix`, `draft_model`), the acceptance rule (`verify`), the
speculation length policy (`policy`, pure: importable without torch), draft trees' flat layout
(`tree`: parents, ancestor masks, KV moves; pure) and `speculator`, which wires them into the
engine's step. Import the submodules directly."""
