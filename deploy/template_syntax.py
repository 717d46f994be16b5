"""The Go-template subset deploy/render.py executes: lexing `{{ ... }}` actions out of the text and
parsing them into a tree (text, actions, if/range/with/define blocks, pipelines of commands).
Anything outside the subset raises TemplateError here, before a line is rendered."""

from __future__ import annotations

import json
import re


class TemplateError(Exception):
    """The template uses something this subset does not have, or fails the way Helm would."""


# ---------------------------------------------------------------------------------------------
# Lexing and parsing

_ACTION = re.compile(r"\{\{(-\s)?(.*?)(\s-)?\}\}", re.S)
_TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<str>"(?:[^"\\]|\\.)*")
  | (?P<raw>`[^`]*`)
  | (?P<decl>:=)
  | (?P<num>-?\d+(?:\.\d+)?)
  | (?P<var>\$[A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)
  | (?P<field>(?:\.[A-Za-z_][A-Za-z0-9_]*)+|\.)
  | (?P<ident>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<punct>[()|,=])
""", re.X)


def _tokenize(src: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(src):
        m = _TOKEN.match(src, pos)
        if not m:
            raise TemplateError(f"cannot parse {src[pos:]!r} in action {src!r}")
        kind = m.lastgroup
        # `(pipeline).Field` selects from the result only when nothing separates `)` and `.Field`.
        if kind == "field" and m.group() != "." and out and out[-1] == ("punct", ")") and src[pos - 1] == ")":
            kind = "chain"
        pos = m.end()
        if kind != "ws":
            out.append((kind, m.group()))
    return out


def _split_actions(text: str) -> list[tuple[str, str]]:
    """[(kind, body)]: kind 'text' or 'action', with trim markers applied to the texts around them."""
    parts: list[tuple[str, str]] = []
    pos, trim_next = 0, False
    for m in _ACTION.finditer(text):
        chunk = text[pos:m.start()]
        if trim_next:
            chunk = chunk.lstrip()
        if m.group(1):
            chunk = chunk.rstrip()
        parts.append(("text", chunk))
        body = m.group(2).strip()
        if not (body.startswith("/*") and body.endswith("*/")):
            parts.append(("action", body))
        trim_next = bool(m.group(3))
        pos = m.end()
    tail = text[pos:]
    parts.append(("text", tail.lstrip() if trim_next else tail))
    return [p for p in parts if p != ("text", "")]


class Parser:
    """Builds a tree of nodes: ('text', s) | ('out', pipe) | ('if', [(pipe, body)], else) |
    ('range', pipe, body, else) | ('with', pipe, body, else) | ('define', name, body)."""

    def __init__(self, text: str):
        self.parts = _split_actions(text)
        self.i = 0

    def parse(self) -> list:
        body, end = self._block()
        if end is not None:
            raise TemplateError(f"unexpected {{{{ {end} }}}}")
        return body

    def _block(self) -> tuple[list, str | None]:
        nodes: list = []
        while self.i < len(self.parts):
            kind, body = self.parts[self.i]
            self.i += 1
            if kind == "text":
                nodes.append(("text", body))
                continue
            word = body.split(None, 1)[0] if body else ""
            rest = body[len(word):].strip()
            if word in ("end", "else"):
                return nodes, body
            if word == "if":
                nodes.append(self._if(rest))
            elif word in ("range", "with"):
                inner, end = self._block()
                other = []
                if end is not None and end.startswith("else"):
                    other, end = self._block()
                if end != "end":
                    raise TemplateError(f"{word} without end")
                nodes.append((word, _parse_pipeline(_tokenize(rest)), inner, other))
            elif word == "define":
                name = json.loads(rest)
                inner, end = self._block()
                if end != "end":
                    raise TemplateError(f"define {name} without end")
                nodes.append(("define", name, inner))
            elif word in ("template", "block", "break", "continue"):
                raise TemplateError(f"{word} is not in this subset")
            else:
                nodes.append(("out", _parse_pipeline(_tokenize(body))))
        return nodes, None

    def _if(self, cond: str) -> tuple:
        branches, other = [], []
        while True:
            inner, end = self._block()
            branches.append((_parse_pipeline(_tokenize(cond)), inner))
            if end is None:
                raise TemplateError("if without end")
            if end == "end":
                break
            rest = end[len("else"):].strip()
            if rest.startswith("if "):
                cond = rest[3:]
                continue
            other, end = self._block()
            if end != "end":
                raise TemplateError("else without end")
            break
        return ("if", branches, other)


def _parse_pipeline(tokens: list[tuple[str, str]]) -> dict:
    decl: list[str] = []
    if any(t == ("decl", ":=") for t in tokens) or (len(tokens) > 1 and tokens[1] == ("punct", "=")):
        i = 0
        while tokens[i][0] == "var" or tokens[i] == ("punct", ","):
            if tokens[i][0] == "var":
                decl.append(tokens[i][1])
            i += 1
        if tokens[i] not in (("decl", ":="), ("punct", "=")):
            raise TemplateError(f"bad declaration {tokens}")
        tokens = tokens[i + 1:]
    cmds, pos = [], 0
    while pos <= len(tokens):
        cmd, pos = _parse_command(tokens, pos)
        cmds.append(cmd)
        if pos < len(tokens) and tokens[pos] == ("punct", "|"):
            pos += 1
            continue
        if pos < len(tokens) and tokens[pos] != ("punct", ")"):
            raise TemplateError(f"unexpected {tokens[pos][1]!r}")
        break
    return {"decl": decl, "cmds": cmds, "end": pos}


def _parse_command(tokens: list, pos: int) -> tuple[list, int]:
    args = []
    while pos < len(tokens) and tokens[pos] not in (("punct", "|"), ("punct", ")")):
        kind, text = tokens[pos]
        if text == "(":
            sub = _parse_pipeline(tokens[pos + 1:])
            pos += sub["end"] + 2
            chain = []
            if pos < len(tokens) and tokens[pos][0] == "chain":
                chain = tokens[pos][1].split(".")[1:]
                pos += 1
            args.append(("pipe", sub, chain))
            continue
        if kind == "str":
            args.append(("lit", json.loads(text)))
        elif kind == "raw":
            args.append(("lit", text[1:-1]))
        elif kind == "num":
            args.append(("lit", float(text) if "." in text else int(text)))
        elif kind == "ident" and text in ("true", "false"):
            args.append(("lit", text == "true"))
        elif kind == "ident" and text == "nil":
            args.append(("lit", None))
        elif kind in ("ident", "field", "var"):
            args.append((kind, text))
        else:
            raise TemplateError(f"unexpected {text!r}")
        pos += 1
    if not args:
        raise TemplateError("empty command")
    return args, pos
