"""The arguments of the functional calls the tap serves, bound by name as the functions take them."""

from __future__ import annotations

from torch import Tensor

GROUPED = {"grouped_mm", "_grouped_mm", "grouped_mm_fallback"}  # torch's, transformers'


def einsum_terms(equation: object, operands: tuple) -> tuple | None:
    """((operand, its indices), (operand, its indices), the output's indices) of a two-operand
    einsum; None for other equations (an ellipsis, an implicit output, a repeated index)."""
    if not isinstance(equation, str) or len(operands) != 2 or "->" not in equation:
        return None
    equation = equation.replace(" ", "")
    inputs, out = equation.split("->")
    terms = inputs.split(",")
    if "." in equation or len(terms) != 2 or any(len(set(t)) != len(t) for t in (*terms, out)):
        return None
    if not all(
        isinstance(t, Tensor) and t.dim() == len(s) for t, s in zip(operands, terms, strict=True)
    ):
        return None
    return (operands[0], terms[0]), (operands[1], terms[1]), out
