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
import sys
from pathlib import Path
from typing import Any

import yaml

from deploy.template_funcs import FUNCS, as_helm_values, go_str, truthy
from deploy.template_syntax import Parser, TemplateError


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
        tree = Parser(text).parse()
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
                    out.append(go_str(v))
            elif kind == "if":
                for cond, body in node[1]:
                    if truthy(self.pipeline(cond, scope)):
                        out.append(self.run(body, scope.child(scope.dot)))
                        break
                else:
                    out.append(self.run(node[2], scope.child(scope.dot)))
            elif kind == "with":
                v = self.pipeline(node[1], scope)
                out.append(self.run(node[2], scope.child(v)) if truthy(v) else self.run(node[3], scope.child(scope.dot)))
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
    ctx = {"Values": as_helm_values(values)}
    return engine.run(engine.load(text), _Scope(ctx, ctx))


def render_chart(chart_dir: str | Path, values: dict | None = None, release: str = "tandem",
                 namespace: str = "default") -> dict[str, str]:
    chart_dir = Path(chart_dir)
    chart = yaml.safe_load((chart_dir / "Chart.yaml").read_text())
    defaults = yaml.safe_load((chart_dir / "values.yaml").read_text()) or {}
    ctx = {
        "Values": as_helm_values(merge_values(defaults, values or {})),
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
