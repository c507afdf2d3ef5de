"""Reading a score expression as ring attention's kernels compute it: ``softcap(scores · scale) + term``.

Used on a hand-written attention's scores (`find_attention`) and on a ``flex_attention`` call's ``score_mod``
(`flex_mods`). Each ``peel_*`` returns what is under the term it recognises and appends the nodes it looked
through to ``internal`` (the nodes the rewrite removes).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch.fx as fx

from ringpass.fx.spellings import ADD, DIV, MUL, TANH, calls


def split_sum(node: fx.Node, is_scores: Callable[[fx.Node], bool]):
    """(the scores, the other term) of ``scores + term``, or None; ``is_scores`` tells the scores' side."""
    if not calls(node, ADD) or len(node.args) != 2 or not all(isinstance(a, fx.Node) for a in node.args) or node.kwargs:
        return None
    left, right = node.args
    if is_scores(left) and not is_scores(right):
        return left, right
    return (right, left) if is_scores(right) and not is_scores(left) else None


def peel_softcap(scores: fx.Node, internal: list):
    """(x, c) of ``tanh(x / c) · c`` (or ``tanh(x · (1/c)) · c``), else (scores, None)."""
    outer = _constant_factor(scores, MUL)
    if outer is None or not calls(outer[0], TANH):
        return scores, None
    tanh = outer[0]
    inner = _constant_factor(tanh.args[0], DIV) if isinstance(tanh.args[0], fx.Node) else None
    inner_cap = None if inner is None else inner[1]
    if inner is None:
        inner = _constant_factor(tanh.args[0], MUL) if isinstance(tanh.args[0], fx.Node) else None
        inner_cap = None if inner is None or inner[1] == 0 else 1.0 / inner[1]
    if inner is None or not math.isclose(inner_cap, outer[1], rel_tol=1e-6):
        return scores, None
    internal += [scores, tanh, tanh.args[0]]
    return inner[0], float(outer[1])


def peel_scale(scores: fx.Node, internal: list):
    """(x, c) of ``x · c``, or of ``x / d`` with c = 1/d, for a Python number; else (scores, 1.0)."""
    for ops, as_factor in ((MUL, lambda c: c), (DIV, lambda c: 1.0 / c)):
        found = _constant_factor(scores, ops)
        if found is not None:
            internal.append(scores)
            return found[0], as_factor(found[1])
    return scores, 1.0


def _constant_factor(node: fx.Node, ops):
    """(x, c) of ``x op c`` (or ``c * x`` for a product) with a Python number c, else None."""
    if not calls(node, ops) or len(node.args) != 2:
        return None
    x, c = node.args
    if isinstance(x, (int, float)) and isinstance(c, fx.Node) and ops is MUL:
        x, c = c, x
    return (x, float(c)) if isinstance(x, fx.Node) and isinstance(c, (int, float)) else None
