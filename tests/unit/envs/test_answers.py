from fractions import Fraction

import pytest

from tir_rl.envs.answers import extract_answer, normalize_name, numbers_equal, parse_number


@pytest.mark.parametrize(
    ("text", "answer", "tagged"),
    [
        ("The result is <answer>42</answer>.", "42", True),
        ("<answer> 1 </answer> then <answer>2</answer>", "2", True),
        ("<ANSWER>\n7\n</ANSWER>", "7", True),
        ("<answer>\\boxed{13}</answer>", "13", True),
        ("so the answer is $\\boxed{\\frac{3}{4}}$", "\\frac{3}{4}", False),
        ("\\boxed{1} and finally \\boxed{{2}+1}", "{2}+1", False),
    ],
)
def test_extract_answer_finds_the_last_answer(text, answer, tagged):
    extracted = extract_answer(text)
    assert extracted is not None
    assert (extracted.text, extracted.tagged) == (answer, tagged)


@pytest.mark.parametrize("text", ["no answer here", "<answer>unclosed", "\\boxed{unclosed"])
def test_extract_answer_returns_none_without_an_answer(text):
    assert extract_answer(text) is None


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1234567", Fraction(1234567)),
        ("1,234,567", Fraction(1234567)),
        ("1 234 567", Fraction(1234567)),
        ("-1,000", Fraction(-1000)),
        ("\u22125", Fraction(-5)),
        ("3/4", Fraction(3, 4)),
        ("-6/8", Fraction(-3, 4)),
        ("\\frac{3}{4}", Fraction(3, 4)),
        ("-\\dfrac{1}{3}", Fraction(-1, 3)),
        ("0.75", Fraction(3, 4)),
        ("$42$", Fraction(42)),
        ("x = 17.", Fraction(17)),
        ("\\text{12}", Fraction(12)),
        ("+8", Fraction(8)),
    ],
)
def test_parse_number_reads_common_spellings(text, value):
    assert parse_number(text) == value


@pytest.mark.parametrize("text", ["", "forty-two", "1,23", "1/0", "2, 3", "nan", "inf", "1/2/3"])
def test_parse_number_refuses_non_numbers(text):
    assert parse_number(text) is None


def test_numbers_equal_is_exact():
    assert numbers_equal("1/3", Fraction(1, 3))
    assert not numbers_equal("0.3333333333", Fraction(1, 3))
    assert numbers_equal("100", 100)
    assert not numbers_equal("101", 100)


def test_normalize_name_ignores_case_spacing_quotes_and_period():
    assert normalize_name('  "Ada   Vorbeck". ') == normalize_name("ada vorbeck")
    assert normalize_name("Ada Vorbeck") != normalize_name("Ada Vorbeckx")
