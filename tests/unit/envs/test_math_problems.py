"""Every MathPython family's answer, recomputed independently (brute force or sympy)."""

import itertools
import math
import random
from fractions import Fraction

import pytest
import sympy
from sympy.parsing.sympy_parser import (
    implicit_multiplication_application,
    parse_expr,
    standard_transformations,
)

from tir_rl.envs.math_problems import FAMILIES, Problem


def _square_and_multiply(a: int, b: int, m: int) -> int:
    result, base = 1 % m, a % m
    for bit in bin(b)[2:]:
        result = result * result % m
        if bit == "1":
            result = result * base % m
    return result


def _integer_roots_by_rational_root_theorem(coeffs: list[int]) -> set[int]:
    roots = set()
    while coeffs[-1] == 0:
        roots.add(0)
        coeffs = coeffs[:-1]
    for d in sympy.divisors(abs(coeffs[-1])):
        for r in (d, -d):
            value = 0
            for c in coeffs:
                value = value * r + c
            if value == 0:
                roots.add(r)
    return roots


def _independent_answer(problem: Problem) -> Fraction:
    p = problem.params
    match problem.family:
        case "big_arithmetic":
            value = sympy.Integer(p["a"]) * sympy.Integer(p["b"]) - sympy.Integer(p["c"]) ** p["e"]
            return Fraction(int(value))
        case "digit_sum_of_power":
            digits = sympy.ntheory.digits(sympy.Integer(p["base"]) ** p["exponent"], 10)
            return Fraction(sum(digits[1:]))  # digits[0] is the base
        case "power_mod":
            return Fraction(_square_and_multiply(p["a"], p["b"], p["m"]))
        case "modular_inverse":
            x = int(sympy.mod_inverse(p["a"], p["m"]))
            assert p["a"] * x % p["m"] == 1
            return Fraction(x)
        case "digit_sum_count":
            return Fraction(
                sum(1 for n in range(1, p["n"] + 1) if sum(map(int, str(n))) % p["k"] == 0)
            )
        case "coprime_count":
            # coprimality to m is periodic with period m: full periods count phi(m) each
            full, rest = divmod(p["n"], p["m"])
            tail = sum(1 for n in range(1, rest + 1) if math.gcd(n, p["m"]) == 1)
            return Fraction(full * int(sympy.totient(p["m"])) + tail)
        case "subset_sums":
            combos = itertools.combinations(range(1, p["n"] + 1), p["k"])
            return Fraction(sum(1 for c in combos if sum(c) % p["m"] == 0))
        case "integer_roots":
            x = sympy.Symbol("x")
            poly = sympy.Poly(p["coefficients"], x)
            roots = {r for r in sympy.roots(poly, multiple=True) if r.is_integer}
            brute = _integer_roots_by_rational_root_theorem(p["coefficients"])
            assert roots == brute
            return Fraction(sum(roots))
        case "linear_system":
            solution = sympy.Matrix(p["matrix"]).LUsolve(sympy.Matrix(p["rhs"]))
            value = sympy.Rational(solution[p["target"]])
            return Fraction(int(value.p), int(value.q))
    raise AssertionError(f"no independent check for family {problem.family}")


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("difficulty", [1, 2])
def test_generated_answer_matches_an_independent_computation(family, difficulty):
    for seed in range(3):
        problem = FAMILIES[family](random.Random(f"{family}/{seed}"), difficulty)
        assert problem.answer == _independent_answer(problem), problem.question


@pytest.mark.parametrize(
    "family",
    [
        "coprime_count",
        "big_arithmetic",
        "power_mod",
        "modular_inverse",
        "integer_roots",
        "linear_system",
        "digit_sum_of_power",
    ],
)
def test_hardest_difficulty_answers_match_too(family):
    problem = FAMILIES[family](random.Random(f"hard/{family}"), 3)
    assert problem.answer == _independent_answer(problem)


def test_question_states_every_parameter():
    for family, make in FAMILIES.items():
        problem = make(random.Random(family), 2)
        for value in problem.params.values():
            for number in value if isinstance(value, list) else [value]:
                if isinstance(number, int) and family not in ("integer_roots", "linear_system"):
                    assert str(number) in problem.question, (family, number)


def test_polynomial_text_round_trips_through_sympy():
    problem = FAMILIES["integer_roots"](random.Random(7), 2)
    text = problem.question.split("= ", 1)[1].rstrip("?").replace("^", "**")
    transformations = (*standard_transformations, implicit_multiplication_application)
    x = sympy.Symbol("x")
    parsed = sympy.Poly(parse_expr(text, transformations=transformations), x)
    assert parsed.all_coeffs() == problem.params["coefficients"]


def test_linear_system_text_matches_the_matrix():
    problem = FAMILIES["linear_system"](random.Random(3), 2)
    lines = problem.question.splitlines()[1:4]
    names = sympy.symbols("x1 x2 x3")
    for line, row, rhs in zip(lines, problem.params["matrix"], problem.params["rhs"], strict=True):
        left, right = line.split("=")
        expr = sympy.sympify(left)
        assert [expr.coeff(v) for v in names] == row
        assert int(right) == rhs
