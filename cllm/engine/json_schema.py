"""JSON Schemas as cllm hands them to llguidance: the subschemas a schema holds, rewrites of
every one of them (objects closed, numbers bounded, references moved under a new root), and
where a local `$ref` points."""
from __future__ import annotations

from urllib.parse import unquote

# Keywords whose value is a subschema or a list of them, and those whose value maps names to them.
_SUBSCHEMAS = ("items", "additionalProperties", "not", "contains", "if", "then", "else",
               "propertyNames", "anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                   "dependentSchemas")
# A number's integral part takes at most 16 digits, as llama-server's grammars bound it: free,
# a small model writing greedily repeated a digit until max_tokens ("population": 1111...).
# 2**53 - 1 is the largest such bound a double (llguidance's reading of a bound) holds exactly.
MAX_MAGNITUDE = 2**53 - 1


def subschemas(schema: dict):
    """The subschemas `schema` holds directly."""
    for key in _SUBSCHEMAS:
        value = schema.get(key)
        if isinstance(value, dict):
            yield value
        elif isinstance(value, list):
            yield from (s for s in value if isinstance(s, dict))
    for key in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            yield from (s for s in schema[key].values() if isinstance(s, dict))


def rewrite(schema, change):
    """`schema` with `change` applied to a copy of it and of each subschema in it, the
    deepest first. Recursive: bound the schema's depth first (grammar_depth)."""
    if isinstance(schema, list):
        return [rewrite(s, change) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMAS:
        if key in out:
            out[key] = rewrite(out[key], change)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: rewrite(s, change) for name, s in out[key].items()}
    return change(out)


def as_compiled(schema):
    """`schema` as cllm compiles it: objects closed, numbers bounded."""
    return rewrite(schema, lambda s: _bound_numbers(_close(s)))


def _close(schema: dict) -> dict:
    """An object that lists its properties and says nothing of others takes no others, as
    llama-server's converter reads it (JSON Schema's default allows any): free to, SmolLM2
    added a "temperature" to get_weather's city and unit."""
    if "properties" in schema and "additionalProperties" not in schema:
        schema["additionalProperties"] = False
    return schema


def _bound_numbers(schema: dict) -> dict:
    """An integer or a number without a bound on a side gets MAX_MAGNITUDE there."""
    types = schema.get("type")
    types = types if isinstance(types, list) else [types]
    if "integer" in types or "number" in types:
        if "minimum" not in schema and "exclusiveMinimum" not in schema:
            schema["minimum"] = -MAX_MAGNITUDE
        if "maximum" not in schema and "exclusiveMaximum" not in schema:
            schema["maximum"] = MAX_MAGNITUDE
    return schema


def rooted(schema, pointer: str):
    """`schema` to be placed at `pointer` ("/$defs/name") in another schema: its local
    references ("#", "#/$defs/X") made to point inside it there."""
    def move(s: dict) -> dict:
        ref = s.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            s["$ref"] = "#" + pointer + ref[1:]
        return s
    return rewrite(schema, move)


def target(root: dict, ref: str) -> dict | None:
    """The subschema of `root` a local reference ("#", "#/$defs/X") names, else None."""
    if ref != "#" and not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/") if ref != "#" else ():
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node if isinstance(node, dict) else None
