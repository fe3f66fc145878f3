"""Countdown scoring inside the graph against RAGEN's plain-Python scorer (the oracle), on random
and adversarial expressions: precedence, parentheses, division by zero, unused or repeated
numbers, literals Python refuses, garbage."""

import ast
import operator
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from envs_jax.countdown_score import evaluate, ragen_score, score_answer

WIDTH = 48
NUMS = (3, 5, 7, 12)
score = jax.jit(score_answer)
value = jax.jit(evaluate)
SETTINGS = settings(max_examples=300, deadline=None, derandomize=True,  # the same examples on every machine
                     suppress_health_check=[HealthCheck.too_slow])


def encode(text: str):
    data = np.zeros(WIDTH, np.uint8)
    raw = text.encode()
    data[: len(raw)] = list(raw)
    return jnp.asarray(data), jnp.int32(len(raw))


def in_graph_score(text, nums, target):
    padded = jnp.asarray(list(nums) + [0] * (4 - len(nums)), jnp.int32)
    return float(score(*encode(text), padded, len(nums), jnp.int32(target)))


BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
          ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}


def outside_int32_fractions(text) -> bool:
    """Whether evaluating ``text`` with exact fractions leaves what the in-graph evaluator holds (a
    numerator or denominator of 2**30 or more, a fractional power, or ``//`` / ``%`` of a
    non-integer, which it computes exactly): the documented departures."""
    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant):
            value = Fraction(str(node.value))
        elif isinstance(node, ast.UnaryOp):
            value = -walk(node.operand) if isinstance(node.op, ast.USub) else walk(node.operand)
        elif isinstance(node, ast.BinOp):
            a, b = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow):
                if b.denominator != 1 or (abs(b) > 64 and abs(a) not in (0, 1)):
                    raise OverflowError
            elif isinstance(node.op, (ast.FloorDiv, ast.Mod)) and (a.denominator != 1 or b.denominator != 1):
                raise OverflowError  # exact where Python's doubles round: 1 // (1 / 5) is 5, not 4.0
            else:  # the evaluator's cross products
                products = {ast.Mult: (a.numerator * b.numerator, a.denominator * b.denominator),
                            ast.Div: (a.numerator * b.denominator, a.denominator * b.numerator)}.get(
                    type(node.op), (a.numerator * b.denominator, b.numerator * a.denominator, a.denominator * b.denominator))
                if any(abs(x) >= 2**30 for x in products):
                    raise OverflowError
            value = Fraction(BINARY[type(node.op)](a, b))
        else:
            raise ValueError  # not arithmetic: Python fails, and so does the evaluator
        if abs(value.numerator) >= 2**30 or value.denominator >= 2**30:
            raise OverflowError
        return value

    try:
        walk(ast.parse(text, mode="eval"))
    except OverflowError:
        return True
    except Exception:
        return False
    return False


def assert_same_score(text, nums, target):
    want = ragen_score(text, list(nums), target)
    got = in_graph_score(text, nums, target)
    assert np.float32(got) == np.float32(want), (text, nums, target, got, want)


# Each number of the task once, joined by random operators, signs and parentheses: the format
# check passes, so the evaluator decides (and sometimes hits the target).
OPS = st.sampled_from(["+", "-", "*", "/", "//", "%", " + ", " - ", " * ", " / ", "**"])


@st.composite
def expressions(draw, numbers):
    order = draw(st.permutations(numbers))
    text = ""
    for i, n in enumerate(order):
        sign = draw(st.sampled_from(["", "", "", "-", "+", "- ", "--"]))
        text += draw(st.sampled_from(["", "", "("])) + sign + str(n)
        if i < len(order) - 1:
            text += draw(OPS)
    opened = text.count("(")
    text += ")" * opened
    if draw(st.booleans()):  # wrap a random prefix: other groupings
        cut = draw(st.integers(0, len(text)))
        text = "(" + text[:cut] + ")" + text[cut:]
    if text.count("**") > 1:  # keep the oracle fast: one power at most (its operands are small)
        text = text.replace("**", "*")
    return text


@SETTINGS
@given(st.data())
def test_expressions_of_the_tasks_numbers_score_as_ragen(data):
    nums = data.draw(st.lists(st.integers(0, 99), min_size=3, max_size=4))
    text = data.draw(expressions(nums))
    try:  # a target the expression hits, when Python can say
        result = eval(text, {"__builtins__": None}, {})
        hit = int(round(result.real)) if isinstance(result, (int, float, complex)) else 1
    except Exception:
        hit = 1
    target = data.draw(st.sampled_from([hit, hit + 1, 24, 1]))
    if not -(2**24) < target < 2**24:
        target = 1
    assume(not outside_int32_fractions(text))  # the departure past int32: its own test below
    assert_same_score(text, nums, target)


ALPHABET = "0123456789+-*/%.() \t\n" + "?:;,[]{}$qzk'\""


@SETTINGS
@given(st.text(ALPHABET, max_size=WIDTH), st.sampled_from([1, 3, 7, 10, 24]))
def test_random_strings_score_as_ragen(text, target):
    text = text.strip()  # the rollout passes the stripped action
    if text.count("**") > 1 or any(len(run) > 3 for run in "".join(c if c.isdigit() else " " for c in text).split()):
        text = text.replace("**", "*")[:12]  # keep the oracle's powers small
    nums = [int(r) for r in "".join(c if c.isdigit() else " " for c in text).split()][:4]
    if len(nums) < 3:
        nums = (nums + [3, 5, 7])[:3]
    assume(not outside_int32_fractions(text))
    assert_same_score(text, nums, target)


ADVERSARIAL = [
    ("2 + 5 - 3", (3, 5, 2), 4),  # RAGEN's example
    ("8 / (3 - 8 / 3)", (8, 3, 8, 3), 24),  # exact fractions vs doubles
    ("3 + 5 * 7", (3, 5, 7), 38), ("(3 + 5) * 7", (3, 5, 7), 56),  # precedence, parentheses
    ("-2 ** 2 + 8", (2, 2, 8), 4), ("2 ** -1 * 8", (2, 1, 8), 4),  # unary vs power
    ("2 ** 3 ** 2 - 500", (2, 3, 2, 500), 12),  # power is right-associative
    ("7 // 2 + 1", (7, 2, 1), 4), ("-7 // 2 + 9", (7, 2, 9), 5), ("7 % -3 + 5", (7, 3, 5), 3),
    ("5 / 0 + 3", (5, 0, 3), 8), ("5 % 0 + 3", (5, 0, 3), 8), ("0 ** -1 + 3", (0, 1, 3), 3),  # division by zero
    ("3 + 5", (3, 5, 7), 8), ("3 + 3 + 5", (3, 5, 7), 11), ("3 + 5 + 7 + 7", (3, 5, 7), 22),  # unused, repeated
    ("03 + 5 + 7", (3, 5, 7), 15), ("00 + 5 + 7", (0, 5, 7), 12), ("3. + 5 + 7", (3, 5, 7), 15),  # literals
    ("1.5 * 4 + 7", (1, 5, 4, 7), 13), (".5 * 4 + 7", (5, 4, 7), 9), ("3 5 + 7", (3, 5, 7), 15),
    ("(3 +\n5) * 7", (3, 5, 7), 56), ("3 +\n5 * 7", (3, 5, 7), 38),  # newlines only inside parentheses
    ("3(5) + 7", (3, 5, 7), 22), ("() + 3 + 5 + 7", (3, 5, 7), 15), ("(3 + 5 + 7", (3, 5, 7), 15),
    ("3 + 5 + 7)", (3, 5, 7), 15), ("3 ++ 5 -- 7", (3, 5, 7), 15), ("[3] + 5 + 7", (3, 5, 7), 15),
    ("", (3, 5, 7), 15), ("garbage", (3, 5, 7), 15),
]


@pytest.mark.parametrize("text,nums,target", ADVERSARIAL)
def test_adversarial_expressions_score_as_ragen(text, nums, target):
    assert not outside_int32_fractions(text)
    assert_same_score(text, nums, target)


def test_values_past_int32_are_not_evaluated():
    """The documented departure: Python's big integers cancel, the fractions overflow."""
    text, nums = "99 ** 9 - 99 ** 9", [99, 9, 99, 9]
    assert ragen_score(text, nums, 0) == 1.0
    assert in_graph_score(text, nums, 0) == pytest.approx(0.1)


def test_values_are_exact_fractions():
    cases = {"8/(3-8/3)": (24, 1), "2**-1": (1, 2), "7%-3": (-2, 1), "-7//2": (-4, 1), "1.25*2": (5, 2),
             "-(2)**2": (-4, 1), "2**-(1+1)**2": (1, 16), "--(-3)*2": (-6, 1), "123456789+1": (123456790, 1)}
    for text, (p, q) in cases.items():
        got = value(*encode(text))
        assert (int(got[0]), int(got[1]), bool(got[2])) == (p, q, True), text


def test_evaluate_reads_at_most_max_numbers_literals():
    """More literals than the task has numbers cannot pass the number check: not evaluated."""
    data, length = encode("1+2+3+4+5")
    assert not bool(value(data, length)[2])  # 4 by default
    p, q, ok = jax.jit(evaluate, static_argnums=2)(data, length, 5)
    assert (int(p), int(q), bool(ok)) == (15, 1, True)
