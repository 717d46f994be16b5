"""Render the Helm chart in deploy/helm/tandem without Helm: a subset of Go templates and Sprig.

`render_chart(chart_dir, values=None, release="tandem", namespace="default")` returns
{template path: rendered text}, like `helm template`; `render_manifests` parses it into objects. Only what the chart uses is implemented, and
anything else is an error rather than a silent difference from Helm:

- actions `{{ pipeline }}`, trim markers `{{-` / `-}}`, comments `{{/* */}}`, variables `$x := ...`;
- `if / else if / else`, `range` (lists and maps, with `$i, $v :=`), `with`, `define`, `include`;
- functions: quote, squote, toYaml, toJson, indent, nindent, default, required, empty, eq, ne, not,
  and, or (both evaluate every argument), printf (%s %d %v %q), trunc, trimSuffix, lower, index, list, dict, lookup (always empty,
  as under `helm template`), randAlphaNum, b64enc, int.

Numbers in values files are float64 as in Helm (1000000 prints as 1e+06; `eq` of one with an
integer literal fails), so the renderer does not hide those traps. `python -m deploy.render CHART [-f FILE] [--set k=v]`
prints the manifests as one YAML stream.
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import re
import secrets
import string
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any

import yaml


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


class _Parser:
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


# ---------------------------------------------------------------------------------------------
# Values as Go prints them

def _go_str(v: Any) -> str:
    if v is None:
        return ""  # Go prints <no value>; Helm turns that into ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return _go_float(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return v
    if isinstance(v, dict):
        return "map[" + " ".join(f"{k}:{_go_str(v[k])}" for k in sorted(v)) + "]"
    if isinstance(v, list):
        return "[" + " ".join(_go_str(x) for x in v) + "]"
    raise TemplateError(f"cannot print {type(v).__name__}")


def _go_float(f: float) -> str:
    """fmt's %v of a float64: shortest digits, exponent form when the exponent is < -4 or >= 6."""
    if math.isinf(f) or math.isnan(f):
        return "NaN" if math.isnan(f) else ("+Inf" if f > 0 else "-Inf")
    if f == 0:
        return "0"
    d = Decimal(repr(f)).normalize()
    sign, digits, exp10 = d.as_tuple()
    exp = len(digits) + exp10 - 1
    if exp < -4 or exp >= 6:
        mant = "".join(map(str, digits))
        mant = mant[0] + ("." + mant[1:] if len(mant) > 1 else "")
        return f"{'-' if sign else ''}{mant}e{'+' if exp >= 0 else '-'}{abs(exp):02d}"
    return format(d, "f")


def _as_helm_values(v: Any) -> Any:
    """Helm reads values files through JSON, so every number in them becomes a float64."""
    if isinstance(v, dict):
        return {k: _as_helm_values(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_as_helm_values(x) for x in v]
    if isinstance(v, int) and not isinstance(v, bool):
        return float(v)
    return v


def _plain_numbers(v: Any) -> Any:
    """What toYaml writes: Helm marshals through JSON, where a float64 of 2 is written 2."""
    if isinstance(v, dict):
        return {k: _plain_numbers(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_plain_numbers(x) for x in v]
    if isinstance(v, float) and v.is_integer() and abs(v) < 1e21:
        return int(v)
    return v


def _eq(a: Any, *others: Any) -> bool:
    for b in others:
        kinds = {type(x) for x in (a, b) if x is not None}
        if kinds == {int, float}:
            raise TemplateError(f"eq: incompatible types for comparison ({a!r}, {b!r}); "
                                "numbers from values are float64 in Helm")
        if a == b:
            return True
    return False


def _truthy(v: Any) -> bool:
    return not (v is None or v is False or v == 0 and not isinstance(v, bool) or v in ("", [], {}))


def _to_yaml(v: Any) -> str:
    if v is None:
        return "null"
    return yaml.safe_dump(_plain_numbers(v), default_flow_style=False, sort_keys=True, width=1 << 16).rstrip("\n")


def _indent(n: int, s: str) -> str:
    pad = " " * int(n)
    return "\n".join(pad + line for line in str(s).split("\n"))


def _printf(fmt: str, *args: Any) -> str:
    it = iter(args)

    def sub(m: re.Match) -> str:
        verb = m.group(1)
        if verb == "%":
            return "%"
        a = next(it)
        if verb == "d" and not (isinstance(a, int) and not isinstance(a, bool)):
            raise TemplateError(f"printf %d of {a!r}: Go prints %!d(...); use `int` first")
        return json.dumps(_go_str(a)) if verb == "q" else _go_str(a)

    return re.sub(r"%([svdq%])", sub, fmt)


def _required(msg: str, v: Any) -> Any:
    if v is None or v == "":
        raise TemplateError(f"execution error: required: {msg}")
    return v


def _index(v: Any, *keys: Any) -> Any:
    for k in keys:
        v = v.get(k) if isinstance(v, dict) else v[int(k)]
    return v


FUNCS = {
    "quote": lambda *a: " ".join(json.dumps(_go_str(x), ensure_ascii=False) for x in a if x is not None),
    "squote": lambda *a: " ".join(f"'{_go_str(x)}'" for x in a if x is not None),
    "toYaml": _to_yaml,
    "toJson": lambda v: json.dumps(_plain_numbers(v), sort_keys=True, separators=(",", ":")),
    "indent": _indent,
    "nindent": lambda n, s: "\n" + _indent(n, s),
    "default": lambda d, v=None: v if _truthy(v) else d,
    "required": _required,
    "empty": lambda v: not _truthy(v),
    "eq": _eq,
    "ne": lambda a, b: a != b,
    "not": lambda v: not _truthy(v),
    "and": lambda *a: next((x for x in a if not _truthy(x)), a[-1]),
    "or": lambda *a: next((x for x in a if _truthy(x)), a[-1]),
    "printf": _printf,
    "trunc": lambda n, s: s[:n] if n >= 0 else s[n:],
    "trimSuffix": lambda suf, s: s[: -len(suf)] if suf and s.endswith(suf) else s,
    "lower": lambda s: s.lower(),
    "index": _index,
    "list": lambda *a: list(a),
    "dict": lambda *a: {a[i]: a[i + 1] for i in range(0, len(a), 2)},
    "lookup": lambda *a: {},
    "randAlphaNum": lambda n: "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(n)),
    "b64enc": lambda s: base64.b64encode(s.encode()).decode(),
    "int": lambda v: int(float(v)) if v not in (None, "") else 0,
}


# ---------------------------------------------------------------------------------------------
# Execution

class _Scope:
    def __init__(self, dot: Any, root: Any, parent: "_Scope | None" = None):
        self.dot, self.root, self.parent, self.vars = dot, root, parent, {}

    def child(self, dot: Any) -> "_Scope":
        return _Scope(dot, self.root, self)

    def lookup(self, name: str) -> Any:
        s: _Scope | None = self
        while s is not None:
            if name in s.vars:
                return s.vars[name]
            s = s.parent
        raise TemplateError(f"undefined variable {name}")


class _Engine:
    def __init__(self) -> None:
        self.defines: dict[str, list] = {}

    def load(self, text: str) -> list:
        tree = _Parser(text).parse()
        for node in tree:
            if node[0] == "define":
                self.defines[node[1]] = node[2]
        return [n for n in tree if n[0] != "define"]

    def run(self, tree: list, scope: _Scope) -> str:
        out = []
        for node in tree:
            kind = node[0]
            if kind == "text":
                out.append(node[1])
            elif kind == "out":
                v = self.pipeline(node[1], scope)
                if not node[1]["decl"]:
                    out.append(_go_str(v))
            elif kind == "if":
                for cond, body in node[1]:
                    if _truthy(self.pipeline(cond, scope)):
                        out.append(self.run(body, scope.child(scope.dot)))
                        break
                else:
                    out.append(self.run(node[2], scope.child(scope.dot)))
            elif kind == "with":
                v = self.pipeline(node[1], scope)
                out.append(self.run(node[2], scope.child(v)) if _truthy(v) else self.run(node[3], scope.child(scope.dot)))
            elif kind == "range":
                out.append(self._range(node, scope))
        return "".join(out)

    def _range(self, node: tuple, scope: _Scope) -> str:
        pipe = node[1]
        items = self.pipeline({**pipe, "decl": []}, scope)
        if isinstance(items, dict):
            pairs = [(k, items[k]) for k in sorted(items)]
        elif isinstance(items, list):
            pairs = list(enumerate(items))
        elif items is None:
            pairs = []
        else:
            raise TemplateError(f"range over {type(items).__name__}")
        if not pairs:
            return self.run(node[3], scope.child(scope.dot))
        out = []
        for k, v in pairs:
            inner = scope.child(v)
            if len(pipe["decl"]) == 1:
                inner.vars[pipe["decl"][0]] = v
            elif len(pipe["decl"]) == 2:
                inner.vars[pipe["decl"][0]], inner.vars[pipe["decl"][1]] = k, v
            out.append(self.run(node[2], inner))
        return "".join(out)

    def pipeline(self, pipe: dict, scope: _Scope) -> Any:
        value, have = None, False
        for cmd in pipe["cmds"]:
            value = self.command(cmd, scope, value, have)
            have = True
        if pipe["decl"]:
            scope.vars[pipe["decl"][0]] = value
        return value

    def command(self, cmd: list, scope: _Scope, piped: Any, have_piped: bool) -> Any:
        head = cmd[0]
        if head[0] == "ident":
            name = head[1]
            args = [self.operand(a, scope) for a in cmd[1:]] + ([piped] if have_piped else [])
            if name == "include":
                return self.include(*args)
            if name not in FUNCS:
                raise TemplateError(f"function {name!r} is not in this subset")
            try:
                return FUNCS[name](*args)
            except TemplateError:
                raise
            except Exception as e:  # wrong arity or types: Helm fails too
                raise TemplateError(f"{name}: {e}") from e
        if len(cmd) > 1 or have_piped:
            raise TemplateError(f"cannot call non-function {head[1]!r}")
        return self.operand(head, scope)

    def include(self, name: str, dot: Any) -> str:
        if name not in self.defines:
            raise TemplateError(f"no template {name!r}")
        return self.run(self.defines[name], _Scope(dot, dot))

    def operand(self, arg: tuple, scope: _Scope) -> Any:
        kind = arg[0]
        if kind == "lit":
            return arg[1]
        if kind == "pipe":
            return _fields(self.pipeline(arg[1], scope.child(scope.dot)), arg[2])
        if kind == "field":
            return _fields(scope.dot, [] if arg[1] == "." else arg[1].split(".")[1:])
        if kind == "var":
            name, *chain = arg[1].split(".")
            base = scope.root if name == "$" else scope.lookup(name)
            return _fields(base, chain)
        if kind == "ident":
            return self.command([arg], scope, None, False)
        raise TemplateError(f"bad operand {arg}")


def _fields(v: Any, chain: list[str]) -> Any:
    for name in chain:
        if v is None:
            raise TemplateError(f"nil pointer evaluating interface {{}}.{name}")
        if not isinstance(v, dict):
            raise TemplateError(f"can't evaluate field {name} in type {type(v).__name__}")
        v = v.get(name)
    return v


# ---------------------------------------------------------------------------------------------
# Charts

def merge_values(base: dict, over: dict) -> dict:
    """Helm's coalescing: maps merge key by key, anything else replaces; null deletes the key."""
    out = dict(base)
    for k, v in over.items():
        if v is None:
            out.pop(k, None)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge_values(out[k], v)
        else:
            out[k] = v
    return out


def set_value(values: dict, dotted: str, raw: str) -> dict:
    """`--set a.b=v` with v read as YAML (so numbers and booleans keep their type)."""
    keys = dotted.split(".")
    over: dict = {}
    d = over
    for k in keys[:-1]:
        d = d.setdefault(k, {})
    d[keys[-1]] = yaml.safe_load(raw) if raw != "" else ""
    return merge_values(values, over)


def render_template(text: str, values: dict, defines: str = "") -> str:
    """One template string with `.Values` = values (as read from a values file), after loading the
    `define`s in `defines`."""
    engine = _Engine()
    engine.load(defines)
    ctx = {"Values": _as_helm_values(values)}
    return engine.run(engine.load(text), _Scope(ctx, ctx))


def render_chart(chart_dir: str | Path, values: dict | None = None, release: str = "tandem",
                 namespace: str = "default") -> dict[str, str]:
    chart_dir = Path(chart_dir)
    chart = yaml.safe_load((chart_dir / "Chart.yaml").read_text())
    defaults = yaml.safe_load((chart_dir / "values.yaml").read_text()) or {}
    ctx = {
        "Values": _as_helm_values(merge_values(defaults, values or {})),
        "Release": {"Name": release, "Namespace": namespace, "Service": "Helm", "IsInstall": True,
                    "IsUpgrade": False, "Revision": 1},
        "Chart": {"Name": chart["name"], "Version": chart["version"], "AppVersion": chart.get("appVersion")},
        "Capabilities": {"KubeVersion": {"Version": "v1.30.0"}},
    }
    engine = _Engine()
    templates = sorted((chart_dir / "templates").iterdir())
    for p in templates:
        if p.name.startswith("_"):
            engine.load(p.read_text())
    out = {}
    for p in templates:
        if p.name.startswith("_") or p.suffix not in (".yaml", ".yml", ".txt"):
            continue
        tree = engine.load(p.read_text())
        try:
            text = engine.run(tree, _Scope(ctx, ctx))
        except TemplateError as e:
            raise TemplateError(f"{p.name}: {e}") from None
        out[f"{chart['name']}/templates/{p.name}"] = text
    return out


def render_manifests(chart_dir: str | Path, values: dict | None = None, **kw: Any) -> list[dict]:
    """The rendered objects (NOTES.txt left out), as `helm template | kubectl apply` would see them."""
    docs = []
    for path, text in render_chart(chart_dir, values, **kw).items():
        if path.endswith(".txt"):
            continue
        try:
            docs += [d for d in yaml.safe_load_all(text) if d]
        except yaml.YAMLError as e:
            raise TemplateError(f"{path} renders to invalid YAML: {e}\n{text}") from None
    return docs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deploy.render", description=__doc__.split("\n")[0])
    ap.add_argument("chart")
    ap.add_argument("-f", "--values", action="append", default=[], help="values file (repeatable)")
    ap.add_argument("--set", action="append", default=[], help="a.b=value (repeatable)")
    ap.add_argument("--name", default="tandem", help="release name")
    ap.add_argument("--namespace", default="default")
    args = ap.parse_args(argv)
    values: dict = {}
    for f in args.values:
        values = merge_values(values, yaml.safe_load(Path(f).read_text()) or {})
    for s in args.set:
        key, _, raw = s.partition("=")
        values = set_value(values, key, raw)
    rendered = render_chart(args.chart, values, release=args.name, namespace=args.namespace)
    for path, text in rendered.items():
        if path.endswith(".txt") or not text.strip():
            continue
        sys.stdout.write(f"---\n# Source: {path}\n{text.strip()}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
