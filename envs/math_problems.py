"""Problem families of MathPython: easy with a Python interpreter, hard without one.

Each family is a function ``(rng, difficulty) -> Problem``. A problem's parameters are
JSON-able and fully determine its question and answer; ``Problem.canonical`` (the question
text) decides its split, so train and test never share a question.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any


@dataclass(frozen=True)
class Problem:
    """One generated problem with its exact answer."""

    family: str
    difficulty: int
    params: dict[str, Any]
    """The generator's inputs (JSON-able); tests recompute the answer from them."""
    question: str
    answer: Fraction

    @property
    def canonical(self) -> str:
        """Canonical form: the question text, since it is exactly what the model sees.

        (Family and parameters would not do: ranges of neighbouring difficulties overlap, so
        one question can come from two difficulties.)
        """
        return self.question

    @property
    def answer_text(self) -> str:
        """The answer as ``n`` or ``p/q``."""
        return str(self.answer)


def _digits(rng: random.Random, num_digits: int) -> int:
    return rng.randint(10 ** (num_digits - 1), 10**num_digits - 1)


def big_arithmetic(rng: random.Random, difficulty: int) -> Problem:
    """``a * b - c ** e`` with many-digit numbers."""
    a, b = _digits(rng, 8 * difficulty), _digits(rng, 6 * difficulty + 2)
    c, e = rng.randint(3, 99), rng.randint(10 * difficulty, 25 * difficulty)
    question = f"Compute {a} * {b} - {c}^{e} exactly."
    return Problem(
        "big_arithmetic",
        difficulty,
        {"a": a, "b": b, "c": c, "e": e},
        question,
        Fraction(a * b - c**e),
    )


def digit_sum_of_power(rng: random.Random, difficulty: int) -> Problem:
    """Sum of the decimal digits of ``base ** exponent``."""
    base, exponent = rng.randint(2, 99), rng.randint(40 * difficulty, 150 * difficulty)
    question = f"What is the sum of the decimal digits of {base}^{exponent}?"
    answer = sum(int(d) for d in str(base**exponent))
    return Problem(
        "digit_sum_of_power",
        difficulty,
        {"base": base, "exponent": exponent},
        question,
        Fraction(answer),
    )


def power_mod(rng: random.Random, difficulty: int) -> Problem:
    """``a ** b mod m`` with a huge exponent."""
    a, b = _digits(rng, 2 + difficulty), _digits(rng, 6 * difficulty)
    m = _digits(rng, 2 + 2 * difficulty)
    question = f"What is the remainder when {a}^{b} is divided by {m}?"
    return Problem(
        "power_mod", difficulty, {"a": a, "b": b, "m": m}, question, Fraction(pow(a, b, m))
    )


def modular_inverse(rng: random.Random, difficulty: int) -> Problem:
    """The inverse of ``a`` modulo ``m``."""
    m = _digits(rng, 3 + 2 * difficulty)
    a = rng.randrange(2, m)
    while math.gcd(a, m) != 1:
        a = rng.randrange(2, m)
    question = (
        f"Find the integer x with 0 <= x < {m} such that {a} * x leaves remainder 1 "
        f"when divided by {m}."
    )
    return Problem(
        "modular_inverse", difficulty, {"a": a, "m": m}, question, Fraction(pow(a, -1, m))
    )


def digit_sum_count(rng: random.Random, difficulty: int) -> Problem:
    """How many of ``1..n`` have a digit sum divisible by ``k``."""
    n, k = rng.randint(10 ** (2 + difficulty), 10 ** (3 + difficulty)), rng.randint(3, 13)
    question = (
        f"How many integers from 1 to {n} (inclusive) have a sum of decimal digits "
        f"that is divisible by {k}?"
    )
    return Problem(
        "digit_sum_count", difficulty, {"n": n, "k": k}, question, Fraction(_count_digit_sums(n, k))
    )


def _count_digit_sums(n: int, k: int) -> int:
    """Digit DP: numbers in 0..n whose digit sum is 0 mod k, minus the number 0."""
    ways = [1] + [0] * (k - 1)  # residues of the digit sums of the free suffixes (none yet)
    prefix_sum, total = 0, 0
    digits = [int(d) for d in str(n)]
    suffix_ways = [ways]
    for _ in digits:  # suffix_ways[i]: residue counts over all digit strings of length i
        prev = suffix_ways[-1]
        suffix_ways.append([sum(prev[(r - d) % k] for d in range(10)) for r in range(k)])
    for i, digit in enumerate(digits):
        free = suffix_ways[len(digits) - i - 1]
        for d in range(digit):
            total += free[(-(prefix_sum + d)) % k]
        prefix_sum += digit
    total += prefix_sum % k == 0  # n itself
    return total - 1  # 0 was counted (digit sum 0)


def coprime_count(rng: random.Random, difficulty: int) -> Problem:
    """How many of ``1..n`` share no factor with ``m``."""
    n, m = _digits(rng, 4 + 2 * difficulty), _digits(rng, 3 + difficulty)
    question = f"How many integers from 1 to {n} (inclusive) are coprime to {m}?"
    primes = _prime_factors(m)
    total = 0
    for mask in range(1 << len(primes)):
        divisor = math.prod(p for i, p in enumerate(primes) if mask >> i & 1)
        total += (-1) ** bin(mask).count("1") * (n // divisor)
    return Problem("coprime_count", difficulty, {"n": n, "m": m}, question, Fraction(total))


def _prime_factors(m: int) -> list[int]:
    primes, p = [], 2
    while p * p <= m:
        if m % p == 0:
            primes.append(p)
            while m % p == 0:
                m //= p
        p += 1
    return primes + ([m] if m > 1 else [])


def subset_sums(rng: random.Random, difficulty: int) -> Problem:
    """How many ``k``-element subsets of ``{1..n}`` have a sum divisible by ``m``."""
    n, k, m = (
        rng.randint(8 + 4 * difficulty, 12 + 4 * difficulty),
        rng.randint(3, 5),
        rng.randint(5, 17),
    )
    question = (
        f"How many {k}-element subsets of {{1, 2, ..., {n}}} have a sum that is divisible by {m}?"
    )
    # counts[j][r]: subsets of size j of the numbers seen so far with sum = r (mod m)
    counts = [[0] * m for _ in range(k + 1)]
    counts[0][0] = 1
    for x in range(1, n + 1):
        for j in range(k, 0, -1):
            counts[j] = [counts[j][r] + counts[j - 1][(r - x) % m] for r in range(m)]
    return Problem(
        "subset_sums", difficulty, {"n": n, "k": k, "m": m}, question, Fraction(counts[k][0])
    )


def integer_roots(rng: random.Random, difficulty: int) -> Problem:
    """Sum of the distinct integer roots of a polynomial with an extra root-free factor."""
    roots = [rng.randint(-12 * difficulty, 12 * difficulty) for _ in range(1 + difficulty)]
    extra = [1, rng.randint(-9, 9), rng.randint(10, 60)]  # x^2 + b x + c, b^2 < 4c: no real root
    coeffs = extra
    for r in roots:
        coeffs = _times_linear(coeffs, -r)
    terms = _poly_text(coeffs)
    question = f"What is the sum of the distinct integer roots of p(x) = {terms}?"
    return Problem(
        "integer_roots", difficulty, {"coefficients": coeffs}, question, Fraction(sum(set(roots)))
    )


def _times_linear(coeffs: list[int], c: int) -> list[int]:
    """Multiply a polynomial (highest degree first) by ``x + c``."""
    return [a + c * b for a, b in zip([*coeffs, 0], [0, *coeffs], strict=True)]


def _poly_text(coeffs: list[int]) -> str:
    degree, parts = len(coeffs) - 1, []
    for i, c in enumerate(coeffs):
        power = degree - i
        if c == 0:
            continue
        sign = "-" if c < 0 else "+"
        mag = abs(c)
        body = ("" if mag == 1 and power else str(mag)) + (
            f"x^{power}" if power > 1 else "x" if power == 1 else ""
        )
        parts.append(f"{sign} {body}")
    text = " ".join(parts)
    return text[2:] if text.startswith("+ ") else "-" + text[2:]


def linear_system(rng: random.Random, difficulty: int) -> Problem:
    """One unknown of a random integer linear system (the answer may be a fraction)."""
    n = 1 + difficulty
    names = [f"x{i + 1}" for i in range(n)]
    while True:
        matrix = [[rng.randint(-6, 6) for _ in range(n)] for _ in range(n)]
        rhs = [rng.randint(-30, 30) for _ in range(n)]
        solution = _solve(matrix, rhs)
        if solution is not None:
            break
    target = rng.randrange(n)
    lines = [f"{_linear_text(row, names)} = {b}" for row, b in zip(matrix, rhs, strict=True)]
    question = (
        "Solve the system of equations\n"
        + "\n".join(lines)
        + f"\nWhat is the exact value of {names[target]}? Give a fraction p/q if needed."
    )
    return Problem(
        "linear_system",
        difficulty,
        {"matrix": matrix, "rhs": rhs, "target": target},
        question,
        solution[target],
    )


def _linear_text(row: list[int], names: list[str]) -> str:
    terms = [(a, v) for a, v in zip(row, names, strict=True) if a != 0] or [(0, names[0])]
    text = " ".join(f"{'-' if a < 0 else '+'} {abs(a)}*{v}" for a, v in terms)
    return text[2:] if text.startswith("+ ") else "-" + text[2:]


def _solve(matrix: list[list[int]], rhs: list[int]) -> list[Fraction] | None:
    """Gauss-Jordan elimination over the rationals; None when the matrix is singular."""
    n = len(matrix)
    rows = [[Fraction(v) for v in row] + [Fraction(b)] for row, b in zip(matrix, rhs, strict=True)]
    for col in range(n):
        pivot = next((r for r in range(col, n) if rows[r][col] != 0), None)
        if pivot is None:
            return None
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(n):
            if r != col and rows[r][col] != 0:
                f = rows[r][col] / rows[col][col]
                rows[r] = [a - f * b for a, b in zip(rows[r], rows[col], strict=True)]
    return [rows[i][n] / rows[i][i] for i in range(n)]


FAMILIES: dict[str, Callable[[random.Random, int], Problem]] = {
    "big_arithmetic": big_arithmetic,
    "digit_sum_of_power": digit_sum_of_power,
    "power_mod": power_mod,
    "modular_inverse": modular_inverse,
    "digit_sum_count": digit_sum_count,
    "coprime_count": coprime_count,
    "subset_sums": subset_sums,
    "integer_roots": integer_roots,
    "linear_system": linear_system,
}
"""Every problem family by name."""
