"""Compiled Triton refuses what its interpreter accepts: a @triton.jit function reading a plain module
global (`LN2 = 0.69...`) fails to compile on a GPU (NameError: only tl.constexpr globals), while CI's
interpreter runs it fine. This static check catches that on CPU: no jit function in kernels/ may
read a module-level name bound by a plain assignment."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

KERNELS = Path(__file__).resolve().parents[2] / "kernels"


def _is_jit(node: ast.FunctionDef) -> bool:
    return any("jit" in ast.unparse(d) for d in node.decorator_list)


def _module_constants(tree: ast.Module) -> set[str]:
    """Names bound at module level (or under a top-level `if`) by plain assignments, not tl.constexpr(...)."""
    names: set[str] = set()
    blocks = [tree.body] + [n.body + n.orelse for n in tree.body if isinstance(n, ast.If)]
    for body in blocks:
        for node in body:
            if isinstance(node, ast.Assign) and "constexpr(" not in ast.unparse(node.value):
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def _jit_functions(tree: ast.Module):
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and _is_jit(node):
            yield node


def _local_names(fn: ast.FunctionDef) -> set[str]:
    bound = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
    return bound


@pytest.mark.parametrize("path", sorted(KERNELS.glob("*.py")), ids=lambda p: p.name)
def test_jit_functions_read_no_plain_module_globals(path):
    tree = ast.parse(path.read_text())
    constants = _module_constants(tree)
    bad = []
    for fn in _jit_functions(tree):
        local = _local_names(fn)
        reads = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        bad += [f"{fn.name} reads {name}" for name in sorted((reads & constants) - local)]
    assert not bad, f"{path.name}: jit code reading plain globals (inline the value or use tl.constexpr): {bad}"


def test_the_check_sees_a_plain_global():
    tree = ast.parse("X = 1.0\n@triton.jit\ndef k(a):\n    return a * X\n")
    fn = next(_jit_functions(tree))
    reads = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    assert "X" in reads & _module_constants(tree)
