"""The `calc` tool: an arithmetic expression in, its value out, over MCP.

One shared server per eval (`Taskset.toolsets`): it holds no per-rollout state.
verifiers starts it as `python -m prl_calc.tools`.
"""

from __future__ import annotations

import ast
import operator

import verifiers.v1 as vf

__all__ = ["CalcTools", "evaluate"]

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def evaluate(expression: str) -> int | float:
    """The value of `expression`: numbers, + - * / // %, unary signs and parentheses (no powers, names or
    calls, so a model cannot make the server compute for long). ValueError names what is not allowed."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from e

    def value(node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            return _BINARY[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))
        raise ValueError(f"not allowed in an expression: {ast.unparse(node)!r}")

    result = value(tree.body)
    return int(result) if isinstance(result, float) and result.is_integer() else result


class CalcTools(vf.Toolset[vf.SharedToolsetConfig]):
    TOOL_PREFIX = None  # the model calls it `calc`, as the system prompt says

    @vf.tool
    async def calc(self, expression: str) -> str:
        """Evaluate an arithmetic expression (numbers, + - * / // %, parentheses) and return its value."""
        return str(evaluate(expression))


if __name__ == "__main__":
    CalcTools.run()
