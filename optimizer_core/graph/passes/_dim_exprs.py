"""Dims that are sums of named dims and sizes, named canonically (``(past+1)``, ``(2*h+-1)``).

A KV-cache decoder's total length is its past length plus the new tokens: onnx's inference
cannot name it, and every shape after it is unknown to it. Written as a linear expression over
the names it is made of, in one canonical form (terms sorted by name, the size last), two dims
with the same name have the same size, which is all the ``symbolic-shapes`` pass reasons with.
Names of this form are only ever parsed back from what :func:`name` wrote.
"""

from __future__ import annotations

Terms = dict[str, int]  # name -> coefficient; "" -> the static part


def terms(value: int | str) -> Terms:
    """The linear terms of a static size, a plain name or a name :func:`name` wrote."""
    if isinstance(value, int):
        return {"": value}
    if value.startswith("(") and value.endswith(")") and len(value) > 2:
        out: Terms = {}
        for part in value[1:-1].split("+"):
            if not part:
                return {value: 1}  # not one of ours: a name like any other
            coef, _, sym = part.rpartition("*") if "*" in part else ("", "", part)
            try:
                if coef:
                    out[sym] = out.get(sym, 0) + int(coef)
                else:
                    out[""] = out.get("", 0) + int(sym)
            except ValueError:
                if coef:
                    return {value: 1}
                out[sym] = out.get(sym, 0) + 1
        return out
    return {value: 1}


def name(t: Terms) -> int | str:
    """The size, the plain name, or the canonical name of ``t``."""
    syms = sorted((s, c) for s, c in t.items() if s and c)
    const = t.get("", 0)
    if not syms:
        return const
    if len(syms) == 1 and syms[0][1] == 1 and const == 0:
        return syms[0][0]
    parts = [s if c == 1 else f"{c}*{s}" for s, c in syms]
    if const:
        parts.append(str(const))
    return "(" + "+".join(parts) + ")"


def add(a: int | str, b: int | str, sign: int = 1) -> int | str:
    out = dict(terms(a))
    for s, c in terms(b).items():
        out[s] = out.get(s, 0) + sign * c
    return name(out)


def scale(a: int | str, k: int) -> int | str:
    return name({s: c * k for s, c in terms(a).items()})
