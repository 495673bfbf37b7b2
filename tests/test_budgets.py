"""The size budgets of DESIGN.md "Proportion": code tokens of the package and the tests, lines of the README.

A code token is counted as ``../shared/tools/code_tokens.py`` counts it: each file parsed, its string statements
(docstrings) removed, the tree unparsed by ``ast.unparse`` (comments, layout and parentheses gone) and tokenized;
every token counts except the layout ones. Formatting cannot move the number. A change that needs more raises its
budget here, on purpose, where an issue grants it.
"""

from __future__ import annotations

import ast
import io
import tokenize

import pytest

from helpers import ROOT

#: Code tokens allowed for the folders, lines for the README.
BUDGETS = {"timm_layerscale": 68_500, "tests": 101_000, "README.md": 500}

#: Tokens that are layout, not code.
LAYOUT_TOKENS = {tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING}
LAYOUT_TOKENS |= {tokenize.ENDMARKER, tokenize.COMMENT}


def is_string_statement(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def code_tokens(source: str) -> int:
    """The code tokens of one file's ``source``."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            setattr(node, "body", [s for s in body if not is_string_statement(s)] or [ast.Pass()])  # noqa: B010
    code = io.StringIO(ast.unparse(tree))
    return sum(t.type not in LAYOUT_TOKENS for t in tokenize.generate_tokens(code.readline))


def size(name: str) -> int:
    """Lines of a file, code tokens of a folder's ``.py`` files."""
    path = ROOT / name
    if path.is_file():
        return len(path.read_bytes().splitlines())
    return sum(code_tokens(f.read_text(encoding="utf-8")) for f in sorted(path.rglob("*.py")))


def test_code_tokens_ignore_layout():
    packed = "def f(a, b):  # a comment\n    '''Doc.'''\n    return (a +\n            b)\n"
    spread = "def f(\n    a,\n    b,\n):\n    return a + b\n"
    assert code_tokens(packed) == code_tokens(spread) == 12


@pytest.mark.parametrize("name", BUDGETS)
def test_within_budget(name):
    unit = "lines" if (ROOT / name).is_file() else "code tokens"
    assert size(name) <= BUDGETS[name], (
        f"{name} has {size(name)} {unit}, over its budget of {BUDGETS[name]}: "
        f"simplify it, or raise BUDGETS[{name!r}] in tests/test_budgets.py where an issue grants them"
    )
