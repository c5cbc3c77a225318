"""Kimi-K2.5 / K2.6's TypeScript-style tool declarations (the `tools_ts_str` template variable).

Their tokenizer renders OpenAI function tools as TypeScript before the chat template runs, and the
template puts that text in the `tool_declare` message (falling back to the JSON without it):

    # Tools

    ## functions
    namespace functions {
    // Get the weather.
    type get_weather = (_: {
      // The city.
      city: string,
      unit?: "c" | "f"
    }) => any;
    }

Rules (a JSON schema -> a TypeScript type): object properties required first, then optional
(`?`), each group by name; a property's description, then its constraints (`// k: v, ...`:
string maxLength / minLength / pattern, number minimum / maximum, array minItems / maxItems,
sorted by key) and its default (`// Default: ...`) as comment lines above it; integer -> number;
enum -> `"a" | 1`; anyOf -> its types joined by ` | `; a type list -> the types joined (object
`{}`, array `Array<any>`); array -> `Array<T>` (multi-line when its item carries comments);
additionalProperties -> `[k: string]: T` (true: any, false: never); `$defs` -> `interface NAME {...}`
lines before the function and `$ref` -> the name (`#` -> the function's own `parameters`
interface); {} or true -> any. Tools of another type than "function" are left out. The tools are
deep-sorted by key first, as the tokenizer does.
"""
from __future__ import annotations

import json

IND = "  "
CONSTRAINTS = {"string": ("maxLength", "minLength", "pattern"), "number": ("maximum", "minimum"),
               "integer": ("maximum", "minimum"), "array": ("minItems", "maxItems")}
UNION_NAMES = {"string": "string", "number": "number", "integer": "number", "boolean": "boolean", "null": "null",
               "object": "{}", "array": "Array<any>"}


def deep_sort(x):
    """Dicts with their keys sorted, recursively (lists keep their order)."""
    if isinstance(x, dict):
        return {k: deep_sort(x[k]) for k in sorted(x)}
    if isinstance(x, list):
        return [deep_sort(v) for v in x]
    return x


def _comment(text: str, ind: str) -> str:
    """Each line of `text` as a `// ` comment line (empty lines stay empty)."""
    return "\n".join(f"{ind}// {line}" if line else "" for line in text.split("\n"))


def _kind(s) -> str:
    """Which rule renders schema `s`."""
    if isinstance(s, bool) or s == {}:
        return "any" if s is not False else "null"
    if "$ref" in s:
        return "ref"
    if "anyOf" in s:
        return "anyOf"
    if "enum" in s:
        return "enum"
    t = s.get("type")
    if isinstance(t, list):
        return "union"
    if t in ("object", "array"):
        return t
    if t is not None:
        return "scalar"
    raise ValueError(f"not a JSON schema this encoder knows: {s!r}")


def _docs(s, ind: str) -> str:
    """The comment lines above a value of schema `s`: its description, then its constraints."""
    if isinstance(s, bool) or _kind(s) in ("any", "null"):
        return ""
    out = [_comment(s["description"], ind)] if s.get("description") else []
    keys = CONSTRAINTS.get(s.get("type"), ()) if _kind(s) in ("scalar", "array") else ()
    cons = sorted((k, s[k]) for k in keys if k in s)
    if cons:
        out.append(f"{ind}// " + ", ".join(f"{k}: {v}" for k, v in cons))
    return "".join(line + "\n" for line in out)


def _type(s, ind: str, ctx: dict) -> str:
    """The TypeScript type of schema `s` written at indentation `ind`."""
    kind = _kind(s)
    if kind in ("any", "null"):
        return kind
    if kind == "ref":
        ref = s["$ref"]
        if ref == "#":
            ctx["self"] = True
            return "parameters"
        if not ref.startswith("#/$defs/") or ref.split("/")[-1] not in ctx["defs"]:
            raise ValueError(f"unsupported or unknown $ref {ref!r}")
        return ref.split("/")[-1]
    if kind == "anyOf":
        return " | ".join(_type(t, ind, ctx) for t in s["anyOf"])
    if kind == "enum":
        return " | ".join(f'"{e}"' if isinstance(e, str) else str(e) for e in s["enum"])
    if kind == "union":
        return " | ".join(UNION_NAMES[t] for t in s["type"])
    if kind == "array":
        item = s.get("items") or {}
        docs = _docs(item, ind + IND)
        if docs:
            return f"Array<\n{docs}{ind}{IND}{_type(item, ind + IND, ctx)}\n{ind}>"
        return f"Array<{_type(item, ind, ctx)}>"
    if kind == "object":
        return _object(s, ind, ctx)
    return "number" if s["type"] == "integer" else s["type"]


def _fields(s: dict, ind: str, ctx: dict) -> list[str]:
    """An object schema's fields (and index signature) as lines at indentation `ind`."""
    ctx["defs"].update(s.get("$defs") or {})
    props = s.get("properties") or {}
    required = set(s.get("required") or ())
    names = sorted(n for n in props if n in required) + sorted(n for n in props if n not in required)
    out = []
    for n in names:
        p = props[n]
        docs = _docs(p, ind)
        default = p.get("default") if isinstance(p, dict) else None
        if default is not None:
            shown = repr(default) if isinstance(default, (int, float, bool)) else json.dumps(default, ensure_ascii=False)
            docs += f"{ind}// Default: {shown}\n"
        out.append(f"{docs}{ind}{n}{'' if n in required else '?'}: {_type(p, ind, ctx)}")
    extra = s.get("additionalProperties")
    if extra is not None:
        t = "any" if extra is True else "never" if extra is False else _type(extra, ind, ctx)
        out.append(f"{ind}[k: string]: {t}")
    return out


def _object(s: dict, ind: str, ctx: dict) -> str:
    fields = _fields(s, ind + IND, ctx)
    return "{\n" + ",\n".join(fields) + f"\n{ind}}}" if fields else "{}"


def _function(fn: dict) -> str:
    """One function's declaration: its $defs interfaces, its description, its `type NAME = ...;`."""
    ctx: dict = {"defs": {}, "self": False}
    params = fn.get("parameters") or {}
    body = _object(params, "", ctx)
    parts = []
    if ctx["self"]:
        fields = ",\n".join(_fields(params, IND, ctx))
        parts.append(f"interface parameters {{{chr(10) + fields + chr(10) if fields else ''}}}")
    for name, d in list(ctx["defs"].items()):
        desc = _comment(d["description"], "") + "\n" if isinstance(d, dict) and d.get("description") else ""
        parts.append(f"{desc}interface {name} {_type(d, '', ctx)}")
    if fn.get("description"):
        parts.append(_comment(fn["description"], ""))
    arg = "parameters" if ctx["self"] else body
    parts.append(f"type {fn.get('name', 'function')} = (_: {arg}) => any;")
    return "\n".join(parts)


def tools_typescript(tools: list[dict] | None) -> str:
    """The `tools_ts_str` of OpenAI function tools ("" when there are none)."""
    fns = [_function(t["function"]) for t in deep_sort(tools or [])
           if t.get("type") == "function" and t.get("function")]
    if not fns:
        return ""
    return "# Tools\n\n## functions\nnamespace functions {\n" + "\n".join(fns) + "\n}\n"
