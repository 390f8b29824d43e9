"""Safe arithmetic: a recursive-descent parser over + - * / and parentheses on exact rationals.

Never ``eval``: the text is tokenized into numbers, operators and parentheses, anything else is
an :class:`ArithmeticError_`, and the grammar has no exponent, names or calls, so the work is
bounded by the input length (:data:`MAX_CHARS`).

    expr   := term (("+" | "-") term)*
    term   := factor (("*" | "/") factor)*
    factor := ("+" | "-") factor | NUMBER | "(" expr ")"
    NUMBER := digits ["." digits]
"""

from __future__ import annotations

import re
from fractions import Fraction

MAX_CHARS = 128
"""Longest expression accepted."""
MAX_DEPTH = 32
"""Deepest nesting of parentheses and signs accepted."""
_TOKEN = re.compile(r"\s*(?:(\d+(?:\.\d+)?)|(.))")


class ArithmeticError_(ValueError):
    """The text is not an arithmetic expression this parser accepts (or divides by zero)."""


def _tokens(text: str) -> list[str]:
    out = []
    for number, other in _TOKEN.findall(text):
        if number:
            out.append(number)
        elif other.strip():
            if other not in "+-*/()":
                raise ArithmeticError_(f"unexpected character {other!r}")
            out.append(other)
    return out


class _Parser:
    def __init__(self, tokens: list[str]) -> None:
        self.tokens = tokens
        self.i = 0
        self.depth = 0

    def peek(self) -> str | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self) -> str:
        token = self.peek()
        if token is None:
            raise ArithmeticError_("unexpected end of expression")
        self.i += 1
        return token

    def expr(self) -> Fraction:
        value = self.term()
        while self.peek() in ("+", "-"):
            value = value + self.term() if self.take() == "+" else value - self.term()
        return value

    def term(self) -> Fraction:
        value = self.factor()
        while self.peek() in ("*", "/"):
            op, rhs = self.take(), self.factor()
            if op == "*":
                value = value * rhs
            elif rhs == 0:
                raise ArithmeticError_("division by zero")
            else:
                value = value / rhs
        return value

    def factor(self) -> Fraction:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise ArithmeticError_(f"nested deeper than {MAX_DEPTH}")
        try:
            token = self.take()
            if token in ("+", "-"):
                value = self.factor()
                return value if token == "+" else -value
            if token == "(":
                value = self.expr()
                if self.take() != ")":
                    raise ArithmeticError_("missing ')'")
                return value
            if token in "*/)":
                raise ArithmeticError_(f"unexpected {token!r}")
            return Fraction(token)
        finally:
            self.depth -= 1


def evaluate(text: str) -> Fraction:
    """The exact value of an arithmetic expression; ArithmeticError_ for anything else."""
    if len(text) > MAX_CHARS:
        raise ArithmeticError_(f"longer than {MAX_CHARS} characters")
    tokens = _tokens(text)
    if not tokens:
        raise ArithmeticError_("empty expression")
    parser = _Parser(tokens)
    value = parser.expr()
    if parser.peek() is not None:
        raise ArithmeticError_(f"unexpected {parser.peek()!r}")
    return value


def format_number(value: Fraction) -> str:
    """An integer as digits, anything else as a decimal with up to 6 places."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.6f}".rstrip("0").rstrip(".")
