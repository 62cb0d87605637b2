"""Which regular-expression features constrained decoding enforces: the rest is refused by name (stdlib only).

A regex reaches the grammar library (xgrammar 0.2.9) as a JSON Schema ``pattern`` or as vLLM's
``guided_regex`` / ``structured_outputs.regex``. Checked on xgrammar 0.2.9 (``compile_regex`` and
``compile_json_schema``), feature by feature:

- silently relaxed in a JSON Schema ``pattern`` (the output ignores them): lookaheads ``(?=`` /
  ``(?!`` (``^(?=.*[0-9])[a-z0-9]{4}$`` let ``"aaaa"`` through), possessive quantifiers (``a++a``
  matched ``"aa"``), anchors inside the pattern (``a^b`` matched ``"ab"``), and escapes it does not
  know (``\\A``, ``\\Z``, ``\\z``, ``\\G``, ``\\Q``, ``\\h``, ``\\x{41}``... read as literal letters);
- a parse error in both: lookbehinds, backreferences (``\\1``, ``\\k<name>``, ``(?P=name)``), atomic
  groups ``(?>``, word boundaries ``\\b`` / ``\\B``, Unicode properties ``\\p{..}``, conditionals,
  recursion, comments ``(?#``, inline flags (``(?i)``; a leading one is honoured in a ``pattern`` but
  refused by ``compile_regex``, so both are refused), Python named groups ``(?P<name>``;
- control-character escapes (``\\t``, ``\\n``, ``\\x01``...) in a JSON ``pattern``: the grammar wants
  the raw character inside the JSON string, which JSON forbids.

:func:`check_regex` names the first such feature (a 400), so a regex is enforced or refused, never
silently relaxed. Supported: literals, ``.``, classes (``[^a-z\\d]``), ``\\d \\w \\s`` and their
negations, ``\\n \\r \\t \\f \\v \\e \\0 \\cX \\xNN \\uNNNN \\u{N}`` escapes, groups ``(..)``, ``(?:..)``,
``(?<name>..)``, alternation, greedy and lazy quantifiers, ``^`` / ``$`` where they anchor the whole
match (at the start / end of an alternative of the pattern, possibly inside groups).
"""

from __future__ import annotations

import re

from proxy.errors import InvalidRequestError

__all__ = ["check_regex"]

_GROUP_FEATURES = (
    ("(?<=", "a lookbehind"), ("(?<!", "a negative lookbehind"), ("(?=", "a lookahead"),
    ("(?!", "a negative lookahead"), ("(?>", "an atomic group"), ("(?P=", "a named backreference"),
    ("(?P<", "a Python-style named group (write (?<name>...))"), ("(?#", "a comment group"),
    ("(?(", "a conditional"), ("(?|", "a branch-reset group"), ("(?R", "recursion"), ("(?&", "recursion"),
)
_KNOWN_LETTER_ESCAPES = frozenset("dDwWsSnrtfvexuc")
_CONTROL_ESCAPES = frozenset("nrtfve0c")
_HEX = re.compile(r"x([0-9a-fA-F]{2})|u([0-9a-fA-F]{4})|u\{([0-9a-fA-F]{1,6})\}")


def check_regex(pattern: str, param: str, where: str = "the regex", in_json: bool = False) -> None:
    """Refuse a regex that uses a feature the grammar library cannot enforce.

    Args:
        pattern: the regular expression (ECMA-262 / Python syntax, as the request gave it).
        param: the request field it came from (the error's ``param``).
        where: how the message names it (``"the JSON Schema 'pattern' (at #/properties/a)"``).
        in_json: the pattern constrains a JSON string (control-character escapes are refused).

    Raises:
        InvalidRequestError: the message names ``where``, the feature and its position.
    """
    feature = _first_unsupported(pattern, in_json)
    if feature is not None:
        name, pos = feature
        raise InvalidRequestError(
            f"{param}: {where} uses {name} at position {pos} ({pattern[pos:pos + 8]!r}...), which this "
            "server's constrained decoding cannot enforce; rewrite the pattern without it",
            param=param,
        )


def _first_unsupported(p: str, in_json: bool) -> tuple[str, int] | None:
    # Per group level: [consumed in this alternative, consumed in any, "$" in this alternative, "$" in any]
    levels = [[False, False, False, False]]
    in_class = False
    i = 0
    while i < len(p):
        ch = p[i]
        if ch == "\\":
            found = _escape(p, i, in_class, in_json)
            if found is not None:
                return found
            if not in_class and _consume(levels):
                return "an anchor '$' inside the pattern", p.rfind("$", 0, i)
            i += 2
            continue
        if in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
            if _consume(levels):
                return "an anchor '$' inside the pattern", p.rfind("$", 0, i)
        elif ch == "(":
            for prefix, name in _GROUP_FEATURES:
                if p.startswith(prefix, i):
                    return name, i
            if p.startswith("(?", i) and not (p.startswith("(?:", i) or p.startswith("(?<", i)):
                return "an inline flag group", i
            levels.append([levels[-1][0], False, False, False])
            if p.startswith("(?:", i):
                i += 2
            elif p.startswith("(?<", i):
                i = max(i, p.find(">", i))
        elif ch in "|)":
            level = levels[-1]
            level[1] |= level[0]
            level[3] |= level[2]
            if ch == "|":
                level[0] = levels[-2][0] if len(levels) > 1 else False
                level[2] = False
            elif len(levels) > 1:
                levels.pop()
                levels[-1][0] |= level[1]
                levels[-1][2] |= level[3]
        elif ch == "^":
            if any(level[0] for level in levels):
                return "an anchor '^' inside the pattern", i
        elif ch == "$":
            levels[-1][2] = True
        elif ch in "*+?}" and i + 1 < len(p) and p[i + 1] == "+" and (ch != "}" or "{" in p[:i]):
            return "a possessive quantifier", i
        elif ch not in "{*+?" and _consume(levels):
            return "an anchor '$' inside the pattern", p.rfind("$", 0, i)
        i += 1
    return None


def _consume(levels: list[list[bool]]) -> bool:
    """Mark a consuming atom; True when a ``$`` before it (in this alternative) makes it unmatchable."""
    levels[-1][0] = True
    return any(level[2] for level in levels)


def _escape(p: str, i: int, in_class: bool, in_json: bool) -> tuple[str, int] | None:
    nxt = p[i + 1:i + 2]
    if not nxt:
        return "a trailing backslash", i
    if nxt in "123456789":
        return "a backreference", i
    if nxt == "k":
        return "a named backreference", i
    if nxt in "pP":
        return "a Unicode property escape", i
    if nxt in "bB" and not in_class:
        return "a word boundary", i
    if nxt.isascii() and nxt.isalpha() and nxt not in _KNOWN_LETTER_ESCAPES and not (in_class and nxt == "b"):
        return f"the escape \\{nxt} (read as a literal letter by the grammar library)", i
    if nxt in "xu" and _HEX.match(p, i + 1) is None:
        return f"the escape \\{nxt} without its hex digits", i
    if in_json and (nxt in _CONTROL_ESCAPES or (in_class and nxt == "b")):
        return "a control-character escape (a JSON string holds it only escaped)", i
    if in_json and nxt in "xu":
        m = _HEX.match(p, i + 1)
        assert m is not None
        if int(next(g for g in m.groups() if g), 16) < 0x20:
            return "a control-character escape (a JSON string holds it only escaped)", i
    return None
