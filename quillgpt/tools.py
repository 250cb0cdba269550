"""The calculator tool, as nanochat's Engine has it: a model writes `<|python_start|>17+25<|python_end|>`, the sampler
evaluates the expression and inserts `<|output_start|>42<|output_end|>`, and the model goes on (with the answer).

Every sampler does this the same way, through Calculator: ChatSession (chat.py, eval.py's chat tasks), serve.py's
batcher and the RL sampler (quillgpt/rl.py). The tool's tokens are part of the built-in ChatML
(quillgpt.chat_template.TOOL_TOKENS); a tokenizer without them has no tool, and nothing changes for it.

The expression is never given to `eval`: calculate() parses it with Python's own parser (ast.parse) and walks the tree
itself, taking numbers, + - * / // % ** and parentheses, and one string method as nanochat's calculator has it for
counting letters: 'strawberry'.count('r'), on string literals only. Nothing else: no name, other attribute or call,
subscript, string arithmetic or comparison. Limits keep a hostile expression cheap: its length, the depth of its tree,
the size of every intermediate number, and an exponent checked before the power is computed (9**9**9 is refused, not
computed). A refused or failing expression gets a short error text as its output, inside the conversation, as a real
tool's error would: the model sees it, the process goes on.
"""

from __future__ import annotations

import ast
import math
import operator
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from quillgpt.errors import UserError
from quillgpt.tokenizer import Tokenizer

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
OUTPUT_START, OUTPUT_END = "<|output_start|>", "<|output_end|>"
MAX_EXPRESSION_CHARS = 200  # a longer call is refused unparsed (what the parser's time and memory are bounded by)
MAX_DEPTH = 64  # nesting of operations (a sum of n terms nests n - 1 deep)
MAX_MAGNITUDE = 10**30  # every intermediate number stays within this
MAX_EXPONENT = 100
MAX_CALL_TOKENS = 256  # a call that runs on this long without <|python_end|> is answered at once

BINARY: dict[type, Callable] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
UNARY: dict[type, Callable] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class Refused(Exception):
    """An expression the calculator does not evaluate; its message is the output the model sees."""


def calculate(expression: str) -> str:
    """The calculator's output for an expression: its value, or `error: ...` (a short reason)."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        return f"error: expression longer than {MAX_EXPRESSION_CHARS} characters"
    try:
        with warnings.catch_warnings():  # the parser warns on stderr of text like `3in`: the model's, not the user's
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return "error: not an arithmetic expression"
    try:
        return format_number(evaluate(tree.body, 0))
    except Refused as e:
        return f"error: {e}"
    except ZeroDivisionError:
        return "error: division by zero"
    except (OverflowError, ValueError, RecursionError):
        return "error: number too large"


def evaluate(node: ast.AST, depth: int) -> int | float:
    """The value of an expression's tree, walked here: numbers, arithmetic operators and 'text'.count('x')."""
    if depth > MAX_DEPTH:
        raise Refused(f"nested deeper than {MAX_DEPTH}")
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
        return UNARY[type(node.op)](evaluate(node.operand, depth + 1))
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        left, right = evaluate(node.left, depth + 1), evaluate(node.right, depth + 1)
        if isinstance(node.op, ast.Pow):
            check_power(left, right)
        return checked(BINARY[type(node.op)](left, right))
    if is_letter_count(node):
        return node.func.value.value.count(node.args[0].value)
    raise Refused("only numbers, + - * / // % ** ( ) and 'text'.count('x') are allowed")


def is_letter_count(node: ast.AST) -> bool:
    """'text'.count('x'): the count method of a string literal, called with one string literal (the strings' length
    is bounded by the expression's)."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "count"
        and isinstance(node.func.value, ast.Constant)
        and type(node.func.value.value) is str
        and len(node.args) == 1
        and not node.keywords
        and isinstance(node.args[0], ast.Constant)
        and type(node.args[0].value) is str
    )


def check_power(base: int | float, exponent: int | float) -> None:
    """Refuse a power whose result would be out of bounds before computing it."""
    if abs(exponent) > MAX_EXPONENT:
        raise Refused(f"exponent larger than {MAX_EXPONENT}")
    if abs(base) > 1 and exponent > 0 and exponent * math.log10(abs(base)) > math.log10(MAX_MAGNITUDE):
        raise Refused("number too large")
    if base == 0 and exponent < 0:
        raise ZeroDivisionError
    if isinstance(exponent, float) and base < 0:
        raise Refused("a negative number to a fractional power")


def checked(value: int | float) -> int | float:
    if isinstance(value, complex) or not math.isfinite(value) or abs(value) > MAX_MAGNITUDE:
        raise Refused("number too large")
    return value


def format_number(value: int | float) -> str:
    """42, 3.5, 2 (not 2.0): what a person writes."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return f"{value:.10g}" if isinstance(value, float) else str(value)


# ---- the tool in a sampler -------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolTokens:
    """The ids of the tool's four tokens in a tokenizer."""

    python_start: int
    python_end: int
    output_start: int
    output_end: int

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> ToolTokens | None:
        """The tokenizer's tool tokens; None when it lacks any of them (no tool)."""
        specials = tokenizer.special_tokens
        names = (PYTHON_START, PYTHON_END, OUTPUT_START, OUTPUT_END)
        if not all(n in specials for n in names):
            return None
        return cls(*(specials[n] for n in names))


class Calculator:
    """One reply's tool state: fed every token of the reply (sampled or inserted), it answers a finished call with
    the tokens to insert next (<|output_start|> the output <|output_end|>)."""

    def __init__(self, tokenizer: Tokenizer, tokens: ToolTokens):
        self.tokenizer, self.tokens = tokenizer, tokens
        self.call: list[int] | None = None  # the ids of the call being written; None outside a call

    def after(self, token: int) -> list[int]:
        """The ids to insert after `token` (none, unless it ends a call)."""
        t = self.tokens
        if token == t.python_start:
            self.call = []
            return []
        if self.call is None:
            return []
        if token != t.python_end and len(self.call) < MAX_CALL_TOKENS:
            self.call.append(token)
            return []
        call, self.call = self.call, None
        expression = self.tokenizer.decode(call) if token == t.python_end else ""
        output = calculate(expression) if token == t.python_end else "error: call too long"
        return [t.output_start, *self.encode(output), t.output_end]

    def encode(self, output: str) -> list[int]:
        try:
            return self.tokenizer.encode(output)
        except UserError:  # a char vocabulary without one of the output's characters
            try:
                return self.tokenizer.encode("error")
            except UserError:
                return []


def calculator_for(tokenizer: Tokenizer) -> Callable[[], Calculator] | None:
    """A factory of one Calculator per reply, or None when the tokenizer has no tool tokens."""
    tokens = ToolTokens.of(tokenizer)
    return None if tokens is None else lambda: Calculator(tokenizer, tokens)


def reply_parts(tokenizer: Tokenizer, ids: list[int]) -> list[dict] | None:
    """A sampled reply that used the tool as a message's content: its parts (quillgpt.chat_template: text, python,
    python_output), which the template renders back to the same ids. None when it used no tool."""
    tokens = ToolTokens.of(tokenizer)
    if tokens is None or not {tokens.python_start, tokens.output_start} & set(ids):
        return None
    kinds = {tokens.python_start: "python", tokens.output_start: "python_output"}
    ends = {tokens.python_end, tokens.output_end}
    parts: list[dict] = []
    kind, piece = "text", []
    for token in ids + [None]:
        if token in kinds or token in ends or token is None:
            if piece or kind != "text":
                parts.append({"type": kind, "text": tokenizer.decode(piece)})
            kind, piece = kinds.get(token, "text"), []
        else:
            piece.append(token)
    return parts


def answer_text(content: str | list[dict]) -> str:
    """The answer a reply gives: its text after the last tool output (all of it, when it used no tool)."""
    if isinstance(content, str):
        return content
    last = max((i for i, p in enumerate(content) if p["type"] != "text"), default=-1)
    return "".join(p["text"] for p in content[last + 1 :])
