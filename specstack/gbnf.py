"""GBNF grammars as untrusted input: the checks a grammar passes before llama.cpp's GBNF parser sees it.

llama.cpp's GBNF parser trusts its input.  A repetition ``x{3,1}`` (maximum below minimum) wraps an unsigned
count and allocates until the process is killed; a repetition over 2000 is silently made unbounded (``x{0,5000}``
becomes ``x*``); parentheses nested some 30,000 deep overflow the C stack of its recursive parser (a JSON schema's
``maxItems: 30000`` is converted into exactly that); a character range ``[b-a]`` parses and then allows nothing.
So every grammar a request, a roles file or the command line gives is read here first, without recursion, and
refused with an ``InvalidParameterError`` that names the limit, before llama.cpp parses it.

What is checked: the text's size, NUL characters (llama.cpp reads the text as a C string), the number of rules,
how deep groups nest, each repetition's bounds, each character range's order, empty classes ``[]``, hex escapes
past Unicode (``\\U7fffffff``), and the size of the grammar once llama.cpp has expanded every repetition into rules
(``x{0,n}`` becomes n rules holding x).  Syntax itself is llama.cpp's to judge: its parser's reason is passed on
(``llama.grammar``).  The limits are measured on this machine class (``docs/constraints.md``).
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import InvalidParameterError

MAX_BYTES = 256 << 10  # the grammar text
MAX_RULES = 4096  # rules defined in the text
MAX_NESTING = 2100  # groups inside groups (the JSON-schema converter nests one group per optional array item)
MAX_REPEAT = 2000  # a repetition's bound (llama.cpp's MAX_REPETITION_THRESHOLD: above it a maximum is dropped)
MAX_EXPANDED = 400_000  # grammar elements after llama.cpp expands every repetition

_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_")
_SIMPLE_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", '"': '"', "[": "[", "]": "]", "-": "-", "^": "^",
                   "/": "/", "'": "'", "0": "\0"}
_HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}
_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")


class GrammarLimitError(InvalidParameterError):
    """A grammar over one of this module's limits, or one that can never match (the message says which)."""


@dataclass
class _Frame:
    """One rule body or group being read: the elements its alternatives hold, and its last element's size."""

    size: int = 0
    last: int = 0  # the last element's size, which a following repetition multiplies
    start: int = 0  # where the group opened, for messages


def check_gbnf(text: str) -> None:
    """Raise ``GrammarLimitError`` if ``text`` is over a limit or holds an empty range or repetition."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_BYTES:
        raise GrammarLimitError(f"the grammar is {size:,} bytes; the limit is {MAX_BYTES:,} (a grammar this large "
                                "takes many seconds to build and slows every token); send a smaller one")
    nul = text.find("\0")
    if nul >= 0:
        raise GrammarLimitError(f"the grammar holds a NUL character (grammar line {text.count(chr(10), 0, nul) + 1}), "
                                "where llama.cpp's parser would stop reading it (it reads the text as a C string) and "
                                "say something about what came before; remove it, or write \\x00 inside a quoted "
                                "literal or a character class to mean that character")
    _Reader(text).read()


class _Reader:
    """Reads GBNF without recursion, counting what llama.cpp would build."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.i = 0
        self.rules = 0
        self.total = 0
        self.stack: list[_Frame] = []

    def fail(self, message: str) -> None:
        line = self.text.count("\n", 0, self.i) + 1
        raise GrammarLimitError(f"{message} (grammar line {line})")

    def read(self) -> None:
        text, n = self.text, len(self.text)
        while self.i < n:
            c = text[self.i]
            if c == "#":
                end = text.find("\n", self.i)
                self.i = n if end < 0 else end
            elif c == ":" and text.startswith("::=", self.i):
                self._rule_starts()
                self.i += 3
            elif c == '"':
                self._element(self._literal())
            elif c == "[":
                self._element(self._char_class())
            elif c == "<":
                end = text.find(">", self.i)
                self.i = n if end < 0 else end + 1
                self._element(1)
            elif c == "(":
                if len(self.stack) > MAX_NESTING:
                    self.fail(f"groups nest more than {MAX_NESTING} deep (llama.cpp's parser would overflow its stack); "
                              "flatten the grammar or lower the repetition that nests it")
                self.stack.append(_Frame(start=self.i))
                self.i += 1
            elif c == ")":
                self._close_group()
            elif c == "{":
                self._repetition()
            elif c in "*+":
                self._repeat(1)
                self.i += 1
            elif c == "?":
                self.i += 1  # x? is x once
            elif c == ".":
                self._element(1)
                self.i += 1
            elif c in _NAME_CHARS:
                while self.i < n and text[self.i] in _NAME_CHARS:
                    self.i += 1
                if not text.startswith("::=", self._skip_space(self.i)):
                    self._element(1)  # a reference; a name followed by ::= is a rule's head
            else:
                self.i += 1
        self._end_rule()

    # -- structure --------------------------------------------------------------

    def _skip_space(self, i: int) -> int:
        while i < len(self.text) and self.text[i] in " \t\r\n":
            i += 1
        return i

    def _rule_starts(self) -> None:
        self._end_rule()
        self.rules += 1
        if self.rules > MAX_RULES:
            self.fail(f"the grammar defines more than {MAX_RULES} rules; send a smaller one")
        self.stack = [_Frame(start=self.i)]

    def _end_rule(self) -> None:
        if len(self.stack) > 1:
            self.i = self.stack[-1].start
            self.fail("a group opened with '(' is not closed")
        if self.stack:
            self._add_total(self.stack[0].size)
        self.stack = []

    def _element(self, size: int) -> None:
        if not self.stack:
            return  # text outside a rule: llama.cpp's parser will say what is wrong with it
        frame = self.stack[-1]
        frame.size += size
        frame.last = size

    def _close_group(self) -> None:
        self.i += 1
        if len(self.stack) < 2:
            return  # an unbalanced ')': llama.cpp's parser reports it
        group = self.stack.pop()
        self._add_total(group.size)  # a group is a rule of its own; where it stands, one reference
        self._element(1)

    def _add_total(self, size: int) -> None:
        self.total += size + 1
        if self.total > MAX_EXPANDED:
            self.fail(f"the grammar expands to more than {MAX_EXPANDED:,} elements once its repetitions are "
                      "written out (llama.cpp writes x{m,n} as n copies of x); lower its repetition bounds")

    # -- repetitions ------------------------------------------------------------

    def _repetition(self) -> None:
        end = self.text.find("}", self.i)
        body = self.text[self.i + 1: end] if end >= 0 else ""
        low, comma, high = body.partition(",")
        try:
            lo = int(low.strip())
            hi = int(high.strip()) if high.strip() else None
        except ValueError:
            self.i += 1
            return  # malformed: llama.cpp's parser says where
        shown = "{" + body.replace(" ", "") + "}"
        if hi is not None and hi < lo:
            self.fail(f"the repetition {shown} has its maximum below its minimum, so it can never match; "
                      f"write {{{hi},{lo}}}")
        for bound in (lo, hi):
            if bound is not None and bound > MAX_REPEAT:
                self.fail(f"the repetition {shown} is over the limit of {MAX_REPEAT} (llama.cpp would silently drop "
                          "the bound, and a larger one takes the server's memory); lower it or use * or +")
        self._repeat(max(lo, hi if hi is not None else 1 if comma else lo))
        self.i = end + 1

    def _repeat(self, times: int) -> None:
        if not self.stack:
            return
        frame = self.stack[-1]
        extra = frame.last * (times - 1) + times  # the copies, and a rule a copy for the optional ones
        frame.size += extra
        frame.last += extra
        if frame.size > MAX_EXPANDED:
            self.fail(f"the grammar expands to more than {MAX_EXPANDED:,} elements once its repetitions are "
                      "written out (llama.cpp writes x{m,n} as n copies of x); lower its repetition bounds")

    # -- terminals ----------------------------------------------------------------

    def _literal(self) -> int:
        """Skip a quoted literal; its size is its characters (one element each)."""
        text, n = self.text, len(self.text)
        self.i += 1
        count = 0
        while self.i < n and text[self.i] != '"':
            if text[self.i] == "\\" and self.i + 1 < n and text[self.i + 1] in _HEX_ESCAPES:
                self._code_point(self.i)
            self.i += 2 if text[self.i] == "\\" else 1
            count += 1
        self.i += 1
        return max(count, 1)

    def _char_class(self) -> int:
        """Skip a character class, refusing a range whose end comes before its start; its size is its ranges."""
        text, n = self.text, len(self.text)
        start_class = self.i
        self.i += 1
        negated = self.i < n and text[self.i] == "^"
        if negated:
            self.i += 1
        ranges = 0
        while self.i < n and text[self.i] != "]":
            start = self.i
            lo = self._char()
            if lo is None:
                return ranges
            ranges += 1
            if self.i + 1 < n and text[self.i] == "-" and text[self.i + 1] != "]":
                self.i += 1
                hi = self._char()
                if hi is None:
                    return ranges
                if ord(hi) < ord(lo):
                    self.fail(f"the character range [{text[start:self.i]}] is empty (its end comes before its "
                              "start), so the grammar can never match there; swap its ends")
        if ranges == 0 and not negated and self.i < n:
            self.i = start_class
            self.fail("the character class [] is empty, so it matches no character and the grammar can never match "
                      "there; put the characters it should allow inside it")
        self.i += 1
        return max(ranges, 1)

    def _code_point(self, at: int) -> int | None:
        """The character a hex escape at ``at`` (``\\x41``, ``\\u00e9``, ``\\U0001F600``) names; refused past
        Unicode's last code point (llama.cpp's parser took ``\\U7fffffff`` and the grammar then matched nothing).
        None: malformed, left to llama.cpp's parser, which says where."""
        e = self.text[at + 1]
        digits = self.text[at + 2: at + 2 + _HEX_ESCAPES[e]]
        if len(digits) != _HEX_ESCAPES[e] or not all(c in _HEX_DIGITS for c in digits):
            return None
        value = int(digits, 16)
        if value > 0x10FFFF:
            self.i = at
            self.fail(f"the escape \\{e}{digits} names no character: Unicode ends at \\U0010FFFF, so no text "
                      "can hold it and the grammar could never match there; write a code point up to 10FFFF")
        return value

    def _char(self) -> str | None:
        """One character of a class, escapes decoded (None: malformed, left to llama.cpp's parser)."""
        text, n = self.text, len(self.text)
        if self.i >= n:
            return None
        c = text[self.i]
        if c != "\\":
            self.i += 1
            return c
        if self.i + 1 >= n:
            return None
        e = text[self.i + 1]
        if e in _HEX_ESCAPES:
            value = self._code_point(self.i)
            if value is None:
                return None
            self.i += 2 + _HEX_ESCAPES[e]
            return chr(value)
        self.i += 2
        return _SIMPLE_ESCAPES.get(e, e)
