"""Tokenizers and chat templates. The engine itself knows nothing about text; this module turns
text and chat messages into token ids and back, incrementally for streaming.

- `HFTokenizer`: a `tokenizer.json` (the `tokenizers` library) plus the model's Jinja chat template.
- `ByteTokenizer`: bytes as ids (offset past a few specials), for the `*-random` models.
- `tokenizer_json_from_gguf`: rebuilds a byte-level BPE tokenizer.json from GGUF metadata.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from tandem.engine.architectures import UnsupportedModelError
from tandem.wire.errors import InvalidRequestError

CHAT_ROLES = ("system", "user", "assistant", "tool")


def _render_template(template: str, messages: list[dict[str, str]], add_generation_prompt: bool,
                     **extra: Any) -> str:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.Undefined)

    def raise_exception(msg):
        raise InvalidRequestError(f"chat template: {msg}")

    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = _tojson   # transformers' filter: jinja's own escapes <, > and & for HTML
    return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **extra)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def check_messages(messages: list[dict]) -> None:
    if not messages:
        raise InvalidRequestError("messages must not be empty")
    for i, m in enumerate(messages):
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise InvalidRequestError(f"messages[{i}].role {role!r} is not a known role; use one of {list(CHAT_ROLES)}")
        if not isinstance(m.get("content"), str):
            raise InvalidRequestError(f"messages[{i}].content must be a string")


def _token_text(token: str | dict | None) -> str | None:
    """tokenizer_config.json writes a special token as its text or as {"content": text, ...}."""
    return token.get("content") if isinstance(token, dict) else token


class HFTokenizer:
    def __init__(self, tokenizer_json: str | Path, chat_template: str | None = None,
                 eos_token_ids: tuple[int, ...] = (), bos_token: str | None = None,
                 add_bos: bool = False):
        self._tok = Tokenizer.from_file(str(tokenizer_json))
        self.chat_template = chat_template
        self.eos_token_ids = eos_token_ids
        self.bos_token = bos_token
        self.add_bos = add_bos
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_dir(cls, path: str | Path, eos_token_ids: tuple[int, ...] = ()) -> "HFTokenizer":
        path = Path(path)
        cfg: dict[str, Any] = {}
        if (path / "tokenizer_config.json").exists():
            cfg = json.loads((path / "tokenizer_config.json").read_text())
        template = cfg.get("chat_template")
        if template is None and (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        if not (path / "tokenizer.json").exists():
            raise UnsupportedModelError(f"{path}: no tokenizer.json (the fast-tokenizer file is needed)")
        bos, eos = (_token_text(cfg.get(k)) for k in ("bos_token", "eos_token"))
        tok = cls(path / "tokenizer.json", template, eos_token_ids, bos, bool(cfg.get("add_bos_token", False)))
        # the EOS set: the model config's, and the tokenizer's own end token
        eos_id = tok._tok.token_to_id(eos) if eos else None
        if eos_id is not None and eos_id not in eos_token_ids:
            tok.eos_token_ids = (*eos_token_ids, eos_id)
        return tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token is not None:
            bos = self._tok.token_to_id(self.bos_token)
            if bos is not None and (not ids or ids[0] != bos):
                ids = [bos] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def supports_tools(self) -> bool:
        """Whether the chat template renders `tools` (a template that never reads them would drop them)."""
        return bool(self.chat_template) and "tools" in self.chat_template

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """`tools`: functions in OpenAI's shape ({"type": "function", "function": {...}}), as
        transformers passes them to a template."""
        check_messages(messages)
        if not self.chat_template:
            raise InvalidRequestError("this model has no chat template; send `prompt` or `prompt_token_ids`")
        extra = {"tools": tools} if tools else {}
        return _render_template(self.chat_template, messages, add_generation_prompt,
                                bos_token=self.bos_token or "", eos_token="", **extra)


class ByteTokenizer:
    """Text as UTF-8 bytes: id = byte + 3 (0 pad, 1 bos, 2 eos). For random-weight models."""

    OFFSET = 3
    TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")

    def __init__(self, vocab_size: int, eos_token_ids: tuple[int, ...] = (2,)):
        if vocab_size < 256 + self.OFFSET:
            raise ValueError("ByteTokenizer needs a vocabulary of at least 259 ids")
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.chat_template = self.TEMPLATE

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [b + self.OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        data = bytes(i - self.OFFSET for i in ids if self.OFFSET <= i < 256 + self.OFFSET)
        return data.decode("utf-8", errors="replace")

    supports_tools = False

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tools=None) -> str:
        check_messages(messages)
        return _render_template(self.TEMPLATE, messages, add_generation_prompt)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without re-decoding everything, holding
    back a partial UTF-8 character (shown as U+FFFD) until the next token completes it."""

    def __init__(self, tokenizer, prompt_tail: list[int] | None = None):
        self.tok = tokenizer
        self.ids: list[int] = list(prompt_tail or [])[-4:]
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # all output text so far
        self.emitted = 0  # how much of `text` has been handed to the client

    def add(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset])
        full = self.tok.decode(self.ids[self.prefix_offset:])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        full = self.tok.decode(self.ids[self.prefix_offset:])
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset])
        delta = full[len(prefix):] if len(full) > len(prefix) else ""
        self.read_offset = len(self.ids)
        self.text += delta
        return delta


def tokenizer_json_from_gguf(meta: dict[str, Any]) -> str:
    """A tokenizer.json for a GGUF `gpt2`-type (byte-level BPE) vocabulary such as SmolLM2's.

    `meta` holds the GGUF keys tokenizer.ggml.{model, pre, tokens, merges, token_type}. The `smollm`
    pre-tokenizer splits digits individually before the GPT-2 byte-level split, as SmolLM2's own
    tokenizer.json does."""
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"only byte-level BPE (gpt2) GGUF vocabularies are supported, "
                         f"got {meta.get('tokenizer.ggml.model')!r}")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    split = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if meta.get("tokenizer.ggml.pre") == "smollm":
        split.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(split)
    tok.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type") or []
    control = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3]
    tok.add_special_tokens(control)
    return tok.to_str()


def find_stop(text: str, stops: tuple[str, ...], new_from: int) -> int | None:
    """Where the first of `stops` starts in `text`, looking only where one can newly appear once
    the text from `new_from` on is new; None if none does."""
    best = None
    for s in stops:
        i = text.find(s, max(0, new_from - len(s) + 1))
        if i >= 0 and (best is None or i < best):
            best = i
    return best
