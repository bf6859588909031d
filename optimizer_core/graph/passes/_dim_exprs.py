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


Monomial = tuple[int, dict[str, int]]  # coefficient, name -> power


def monomial(value: int | str) -> Monomial:
    """``value`` as a coefficient times a product of names: ``(4*batch)`` is ``4 * batch``; a
    sum of several terms (``(past+1)``) is one name of its own."""
    if isinstance(value, int):
        return value, {}
    t = terms(value)
    syms = [(s, c) for s, c in t.items() if s and c]
    if len(syms) == 1 and not t.get("", 0):
        return syms[0][1], {syms[0][0]: 1}
    return 1, {str(name(t)): 1}


def product(values: list[int | str]) -> Monomial:
    coef = 1
    powers: dict[str, int] = {}
    for v in values:
        c, p = monomial(v)
        coef *= c
        for s, k in p.items():
            powers[s] = powers.get(s, 0) + k
    return coef, powers


def quotient(num: Monomial, den: Monomial) -> int | str | None:
    """``num / den`` as a size or a dim name, or ``None`` when it is no whole size or name for
    every value of the names (a fraction, a name left in the denominator, or a product of
    names, which no dim name writes). Nothing is divided by a zero-sized product."""
    (nc, np_), (dc, dp) = num, den
    if nc == 0 or dc == 0 or nc % dc:
        return None
    powers = dict(np_)
    for s, k in dp.items():
        powers[s] = powers.get(s, 0) - k
    left = {s: k for s, k in powers.items() if k}
    if any(k < 0 for k in left.values()):
        return None
    coef = nc // dc
    if not left:
        return coef
    if len(left) == 1 and next(iter(left.values())) == 1:
        return scale(next(iter(left)), coef)
    return None
