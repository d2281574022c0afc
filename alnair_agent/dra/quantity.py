"""Kubernetes resource quantities ("4Gi", "30", "1500m", "2e3") as exact fractions, and back.

Capacities and consumed capacities in resource.k8s.io arrive as quantity strings. They are parsed exactly (no
floats: 4Gi must compare equal to 4294967296), and anything that is not a quantity is refused with the text named.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

_BINARY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60}
_DECIMAL = {"n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 1000), "": Fraction(1),
            "k": Fraction(10**3), "M": Fraction(10**6), "G": Fraction(10**9), "T": Fraction(10**12),
            "P": Fraction(10**15), "E": Fraction(10**18)}
# The API server's grammar: a signed decimal number, then a binary or decimal SI suffix or a decimal exponent.
_QUANTITY = re.compile(r"^([+-]?)([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?[0-9]{1,3})?$",
                       re.ASCII)


class QuantityError(ValueError):
    """Not a Kubernetes quantity; the message quotes what was found."""


def parse_quantity(value: object) -> Fraction:
    """The exact value of a quantity string (or an int, as YAML may give); QuantityError otherwise."""
    if isinstance(value, bool):
        raise QuantityError(f"{value!r} is not a quantity")
    if isinstance(value, int):
        return Fraction(value)
    if not isinstance(value, str) or len(value) > 64:
        raise QuantityError(f"{value!r:.80} is not a quantity")
    m = _QUANTITY.match(value)
    if m is None:
        raise QuantityError(f"{value!r} is not a quantity (e.g. 4Gi, 30, 1500m)")
    sign, number, suffix = m.group(1), m.group(2), m.group(3) or ""
    amount = Fraction(number)
    if suffix in _BINARY:
        amount *= _BINARY[suffix]
    elif suffix[:1] in ("e", "E"):
        amount *= Fraction(10) ** int(suffix[1:])
    else:
        amount *= _DECIMAL[suffix]
    return -amount if sign == "-" else amount


def ceil_int(amount: Fraction) -> int:
    """The quantity as a whole number, rounded up (the API machinery's Quantity.Value())."""
    return math.ceil(amount)


def format_bytes(n: int) -> str:
    """Bytes as the API server writes them: the largest binary suffix that is exact ("16Gi", "1536Mi", "1000")."""
    for suffix, size in sorted(_BINARY.items(), key=lambda kv: -kv[1]):
        if n and n % size == 0:
            return f"{n // size}{suffix}"
    return str(n)
