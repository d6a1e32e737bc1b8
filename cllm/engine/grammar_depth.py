"""How deeply a grammar nests, bounded before llguidance compiles it: its compiler recurses on
the native stack for each level of a JSON Schema (a `$ref` into its target is a level) and of a
grammar's rules and groups, and a request nested a few thousand deep overflowed that stack and
took the process down with it. Measured here in Python, never recursing past the bound."""
from __future__ import annotations

import json
import re

from cllm.engine.json_schema import subschemas, target

# llguidance 1.9.1 overflowed a thread's 8 MiB stack (Linux's default) at about 1,850 levels
# of a schema ($refs chained through properties, 2 levels a link; through items or anyOf, about
# 2,100) and 3,550 of a GBNF grammar (rules naming the next): 128 leaves a margin of 14. Real
# schemas and grammars nest a few dozen levels deep.
MAX_DEPTH = 128


class TooDeep(ValueError):
    """A schema or grammar nested deeper than MAX_DEPTH."""

    def __init__(self) -> None:
        super().__init__(f"nested more than {MAX_DEPTH} levels deep, the limit (each subschema, "
                         "$ref, rule and group is a level)")


class _Heights:
    """Each node's height (the levels below it), each computed once, through `children(node)`:
    (levels, child or None for a leaf) pairs. A reference back into the path that reached it
    adds nothing: llguidance compiles a cycle as a rule that names itself."""

    def __init__(self, children) -> None:
        self._children = children
        self._known: dict[object, int] = {}
        self._open: set[object] = set()

    def height(self, node, depth: int = 0) -> int:
        if depth > MAX_DEPTH:
            raise TooDeep()
        key = node if isinstance(node, str) else id(node)
        if key in self._open:
            return 0
        if key not in self._known:
            self._open.add(key)
            self._known[key] = max((levels + (0 if child is None else
                                              self.height(child, depth + levels))
                                    for levels, child in self._children(node)), default=0)
            self._open.discard(key)
        if depth + self._known[key] > MAX_DEPTH:
            raise TooDeep()
        return self._known[key]


def schema_height(schema) -> int:
    """Levels of subschemas in `schema`, a local `$ref` counting one into its target."""
    if not isinstance(schema, dict):
        return 0

    def children(node: dict):
        for child in subschemas(node):
            yield 1, child
        ref = node.get("$ref")
        found = target(schema, ref) if isinstance(ref, str) else None
        if found is not None:
            yield 1, found
    return _Heights(children).height(schema)


# Lark as llguidance reads it (GBNF arrives converted): strings, regexes and comments are
# skipped; a rule starts a line ("name:", "?name:", "NAME.2:"); %json holds a JSON Schema.
_LARK = re.compile(r"""
    "(?:[^"\\\n]|\\.)*"i?
  | /(?![/*])(?:[^/\\\n]|\\.)+/[imslux]*
  | (?://|\#)[^\n]*
  | ^[ \t]*[?!]?(?P<rule>[A-Za-z_][\w-]*)(?:\.-?\d+)?(?:\[[^\]\n]*\])?[ \t]*:
  | %json\b\s*(?P<json>\{)
  | %\w+
  | (?P<name>[A-Za-z_][\w-]*)
  | (?P<open>[(\[])
  | (?P<close>[)\]])
""", re.M | re.X)


def lark_height(text: str) -> int:
    """Levels of rules (a name is one level into its rule), groups and inline JSON Schemas."""
    rules: dict[str, list] = {}
    body, level, pos = None, 0, 0
    while (m := _LARK.search(text, pos)) is not None:
        pos = m.end()
        if m["rule"]:
            body, level = rules.setdefault(m["rule"], []), 0
        elif body is None:
            continue
        elif m["json"]:
            schema, pos = _inline_json(text, m.start("json"))
            body.append((level + 1 + schema_height(schema), None))
        elif m["name"]:
            body.append((level + 1, m["name"]))
        elif m["open"]:
            level += 1
            body.append((level, None))
        elif m["close"]:
            level = max(0, level - 1)
    heights = _Heights(lambda name: rules.get(name, ()))
    return max((heights.height(name) for name in rules), default=0)


def _inline_json(text: str, start: int):
    """(the JSON value at `start`, where it ends); None where there is none to read there (the
    compiler then says what is wrong)."""
    try:
        return json.JSONDecoder().raw_decode(text, start)
    except ValueError:
        return None, start + 1
    except RecursionError:
        raise TooDeep() from None


def check_source(source: str) -> None:
    """Raise TooDeep where a translated grammar nests deeper than MAX_DEPTH: llguidance's JSON
    (its grammars, each a Lark text or a JSON Schema), or Lark text."""
    if not source.lstrip().startswith("{"):
        lark_height(source)
        return
    for grammar in json.loads(source).get("grammars", ()):
        if isinstance(grammar.get("lark_grammar"), str):
            lark_height(grammar["lark_grammar"])
        schema_height(grammar.get("json_schema"))
