"""Values as Go's templates print them, and the Sprig functions the chart calls (FUNCS), each as
Helm behaves: numbers are float64, `lookup` is always empty (as under `helm template`)."""

from __future__ import annotations

import base64
import json
import math
import re
import secrets
import string
from decimal import Decimal
from typing import Any

import yaml

from deploy.template_syntax import TemplateError


# ---------------------------------------------------------------------------------------------
# Values as Go prints them

def go_str(v: Any) -> str:
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
        return "map[" + " ".join(f"{k}:{go_str(v[k])}" for k in sorted(v)) + "]"
    if isinstance(v, list):
        return "[" + " ".join(go_str(x) for x in v) + "]"
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


def as_helm_values(v: Any) -> Any:
    """Helm reads values files through JSON, so every number in them becomes a float64."""
    if isinstance(v, dict):
        return {k: as_helm_values(x) for k, x in v.items()}
    if isinstance(v, list):
        return [as_helm_values(x) for x in v]
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


def truthy(v: Any) -> bool:
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
        return json.dumps(go_str(a)) if verb == "q" else go_str(a)

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
    "quote": lambda *a: " ".join(json.dumps(go_str(x), ensure_ascii=False) for x in a if x is not None),
    "squote": lambda *a: " ".join(f"'{go_str(x)}'" for x in a if x is not None),
    "toYaml": _to_yaml,
    "toJson": lambda v: json.dumps(_plain_numbers(v), sort_keys=True, separators=(",", ":")),
    "indent": _indent,
    "nindent": lambda n, s: "\n" + _indent(n, s),
    "default": lambda d, v=None: v if truthy(v) else d,
    "required": _required,
    "empty": lambda v: not truthy(v),
    "eq": _eq,
    "ne": lambda a, b: a != b,
    "not": lambda v: not truthy(v),
    "and": lambda *a: next((x for x in a if not truthy(x)), a[-1]),
    "or": lambda *a: next((x for x in a if truthy(x)), a[-1]),
    "printf": _printf,
    "trunc": lambda n, s: s[:n] if n >= 0 else s[n:],
    "trimSuffix": lambda suf, s: s[: -len(suf)] if suf and s.endswith(suf) else s,
    "lower": lambda s: s.lower(),
    "trim": lambda s: go_str(s).strip(),
    "index": _index,
    "list": lambda *a: list(a),
    "dict": lambda *a: {a[i]: a[i + 1] for i in range(0, len(a), 2)},
    "lookup": lambda *a: {},
    "randAlphaNum": lambda n: "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(n)),
    "b64enc": lambda s: base64.b64encode(s.encode()).decode(),
    "add": lambda *a: sum(int(float(x)) for x in a),  # Sprig: every argument as int64
    "int": lambda v: int(float(v)) if v not in (None, "") else 0,
}
