"""Countdown's answer scoring (RAGEN ``countdown``, ragen-reference.md §1.4), in plain Python and inside jit.

RAGEN scores an answer ``expr`` against ``nums`` and ``target``:

- 0 if the integers ``re.findall(r"\\d+", expr)`` are not ``nums`` as a multiset;
- else 1.0 if ``eval(expr)`` (no builtins) is within 1e-5 of the target;
- else 0.1 (also when ``eval`` fails: a syntax error, a division by zero).

``ragen_score`` is that code, the oracle. ``score_answer`` computes the same inside the graph from
the answer's bytes: ``answer_numbers`` (the digit runs) and ``evaluate`` (a byte-level expression
evaluator) in two passes. ``parse`` reads the bytes once (a shunting-yard, no arithmetic) into a
straight-line program: the literals, then the binary operations in the order eager evaluation
applies them, each naming its operands (a literal or an earlier result, negated by unary signs).
``run_program`` then does the exact arithmetic, at most ``n - 1`` operations for ``n`` literals.
An answer of more literals than the task has numbers scores 0 by the number check whatever its
value, so ``score_answer`` reads at most that many (4) and the arithmetic is a few fixed steps per
answer instead of one reduction per byte.

The evaluator follows Python's arithmetic grammar exactly: integer and decimal literals (Python's
rules, e.g. ``03`` is a syntax error, ``03.5`` is not), ``+ - * / // % **`` with Python's
precedence and associativity, unary signs, parentheses, spaces and tabs, and newlines inside
parentheses. Values are exact fractions of int32 integers, each literal and each operation's
result reduced, so ``8 / (3 - 8 / 3)`` is exactly 24 where Python's doubles are 24 - 1.4e-14;
both are within the tolerance.

Where ``eval`` would do more, the answer counts as not equal to the target (score 0.1 when its
numbers are right), a documented departure: Python syntax beyond arithmetic (names, keywords,
comparisons, bit operators, comments, ``1_000``, ``0x1f``, ``1e3``, ``2j``, a backslash line
continuation), a fractional power (``4 ** 0.5``), and values whose numerator or denominator leaves
int32 (``99 ** 9``). None of these can use each of 3-4 numbers below 100 once to hit a target
below 1000 except through such syntax, and the property tests compare both scorers on random and
adversarial arithmetic. One more departure: ``//`` and ``%`` of non-integers are exact here, where
Python's doubles can land on the other side of an integer (``1 // (1 / 5)`` is 5 here, 4.0 in
Python, as ``1 / 5`` is a double a little above 0.2).
"""

from __future__ import annotations

import re
from functools import partial

import jax
import jax.numpy as jnp

FORMAT_SCORE, SCORE = 0.1, 1.0  # RAGEN's CountdownEnvConfig; a wrong-number answer pays int 0

# ---- the oracle: RAGEN's code ----------------------------------------------------------------


def ragen_check_format(equation: str, nums) -> bool:
    try:
        return sorted(int(n) for n in re.findall(r"\d+", equation)) == sorted(nums)
    except Exception:
        return False


def ragen_check_correctness(equation: str, target) -> bool:
    try:
        result = eval(equation, {"__builtins__": None}, {})
        return abs(result - target) < 1e-5
    except Exception:
        return False


def ragen_score(equation: str, nums, target):
    """RAGEN's ``compute_reward``: 0 (an int), 0.1 or 1.0."""
    if not ragen_check_format(equation, nums):
        return 0
    return SCORE if ragen_check_correctness(equation, target) else FORMAT_SCORE


# ---- in the graph ------------------------------------------------------------------------------

# Operator codes on the operator stack; precedence by code.
LPAREN, ADD, SUB, MUL, DIV, FLOORDIV, MOD, NEG, POS, POW = range(10)
PRECEDENCE = (0, 1, 1, 2, 2, 2, 2, 3, 3, 4)  # a tuple: no module of ours makes arrays at import
LIMIT = 2**30  # magnitudes past this count as overflow (products are checked in float32 first)
MAX_NUMBERS = 4  # literals ``evaluate`` reads by default: a task has at most 4 numbers
MAX_DIGIT_RUNS = 8  # digit runs kept for the number check; more can never match 3-4 numbers
BIG = 2**30  # a digit run too long to matter (it matches no task number)


def _byte(data, i, length):
    return jnp.where(i < length, data[jnp.minimum(i, data.shape[0] - 1)], 0).astype(jnp.int32)


def _is_digit(c):
    return (c >= 48) & (c <= 57)


def answer_numbers(data, length):
    """``(int32[MAX_DIGIT_RUNS] padded with -1, count)``: the answer's maximal runs of ASCII digits
    as integers (``re.findall(r"\\d+")``), in order; runs past ``MAX_DIGIT_RUNS`` are counted only."""

    def body(i, carry):
        runs, count, value, in_run = carry
        c = _byte(data, i, length)
        digit = _is_digit(c)
        value = jnp.where(digit, jnp.where(value > BIG // 10, BIG, value * 10 + (c - 48)), value)
        ends = in_run & ~digit
        runs = jnp.where(ends & (jnp.arange(MAX_DIGIT_RUNS) == count), value, runs)
        count = count + ends
        value = jnp.where(digit, value, 0)
        return runs, count, value, digit

    init = (jnp.full((MAX_DIGIT_RUNS,), -1, jnp.int32), jnp.int32(0), jnp.int32(0), jnp.bool_(False))
    # One step past the end: the byte there reads 0 (not a digit) and closes a last run.
    runs, count, _, _ = jax.lax.fori_loop(0, jnp.minimum(length, data.shape[0]) + 1, body, init)
    return runs, count


def numbers_match(data, length, nums, num_count):
    """RAGEN's format check: the digit runs are ``nums[:num_count]`` as a multiset."""
    runs, count = answer_numbers(data, length)
    slots = jnp.arange(MAX_DIGIT_RUNS)
    want = jnp.where(slots < num_count, jnp.pad(nums, (0, MAX_DIGIT_RUNS - nums.shape[0]), constant_values=-1), -1)
    return (count == num_count) & jnp.all(jnp.sort(runs) == jnp.sort(want))


def _gcd(a, b):
    """Euclid's algorithm, elementwise; it stops when every pair is done (at most 46 steps for
    int32, usually a handful: a literal ``p / 1`` takes one)."""
    def body(ab):
        a, b = ab
        return jnp.where(b == 0, a, b), jnp.where(b == 0, 0, a % jnp.maximum(b, 1))

    a, _ = jax.lax.while_loop(lambda ab: jnp.any(ab[1] != 0), body, (jnp.abs(a), jnp.abs(b)))
    return jnp.maximum(a, 1)


def _fraction(p, q, ok):
    """A reduced fraction with a positive denominator, and whether it is representable."""
    sign = jnp.where(q < 0, -1, 1)
    p, q = p * sign, q * sign
    g = _gcd(p, q)
    p, q = p // g, q // g
    ok = ok & (q != 0) & (jnp.abs(p) < LIMIT) & (q < LIMIT)
    return jnp.where(ok, p, 0), jnp.where(ok, q, 1), ok


def _product_fits(*factors):
    """Whether a product of int32 values stays below ``LIMIT``, so that a sum of two such products
    cannot overflow int32 (a float32 estimate: within a few units of LIMIT it may refuse a product
    that fits, never accept one that does not fit in int32)."""
    size = jnp.float32(1.0)
    for f in factors:
        size = size * jnp.abs(f).astype(jnp.float32)
    return size < LIMIT


def _power(p, q, ep, eq):
    """``(p/q) ** (ep/eq)`` for an integer exponent; a fractional one is not evaluated. Square and
    multiply over the exponent's 5 bits; every factor is at most the result in magnitude, so the
    overflow checks refuse exactly the powers whose result leaves ``LIMIT``."""
    integral = eq == 1
    n = jnp.abs(ep)
    trivial = (jnp.abs(p) <= 1) & (q == 1)
    ok = integral & ((n <= 30) | trivial)
    n = jnp.where(n > 30, 30 + n % 2, n)  # past 30 only 0 and +-1 are left: keep the parity
    rp, rq = jnp.int32(1), jnp.int32(1)
    for bit in range(5):
        use = (n >> bit) & 1 == 1
        ok = ok & (~use | _product_fits(rp, p) & _product_fits(rq, q))
        rp, rq = jnp.where(use & ok, rp * p, rp), jnp.where(use & ok, rq * q, rq)
        more = (n >> (bit + 1)) > 0  # square only while higher bits remain
        ok = ok & (~more | _product_fits(p, p) & _product_fits(q, q))
        p, q = jnp.where(more & ok, p * p, p), jnp.where(more & ok, q * q, q)
    negative = ep < 0  # x ** -n = 1 / x ** n; 0 ** -n divides by zero
    ok = ok & ~(negative & (rp == 0))
    rp, rq = jnp.where(negative, rq, rp), jnp.where(negative, rp, rq)
    return rp, rq, ok


def _apply(op, a, b):
    """``a op b`` on fractions ``(p, q)``; returns ``(p, q, ok)``."""
    (ap, aq), (bp, bq) = a, b
    cross = _product_fits(ap, bq) & _product_fits(bp, aq) & _product_fits(aq, bq)
    add = (ap * bq + bp * aq, aq * bq, cross)
    sub = (ap * bq - bp * aq, aq * bq, cross)
    mul = (ap * bp, aq * bq, _product_fits(ap, bp) & _product_fits(aq, bq))
    div = (ap * bq, aq * bp, _product_fits(ap, bq) & _product_fits(aq, bp) & (bp != 0))
    # Python's floor division and modulo: a // b = floor(a / b), a % b = a - b * (a // b).
    num, den = ap * bq, jnp.where(aq * bp == 0, 1, aq * bp)
    floor = jnp.floor_divide(num, den)
    floordiv = (floor, jnp.int32(1), cross & (bp != 0))
    mod = (ap * bq - bp * aq * floor, aq * bq, cross & (bp != 0) & _product_fits(bp, aq, floor))
    power = _power(ap, aq, bp, bq)
    options = [add, sub, mul, div, floordiv, mod, power]
    codes = [ADD, SUB, MUL, DIV, FLOORDIV, MOD, POW]
    index = jnp.select([op == c for c in codes], list(range(len(codes))), 0)
    p = jnp.stack([o[0] for o in options])[index]
    q = jnp.stack([o[1] for o in options])[index]
    ok = jnp.stack([jnp.asarray(o[2]) for o in options])[index]
    return _fraction(p, q, ok)


def parse(data, length, max_numbers: int = MAX_NUMBERS):
    """Pass 1 of ``evaluate``, no arithmetic: read ``data[:length]`` (bytes) with Python's grammar
    (a shunting-yard over the bytes) into a straight-line program over at most ``max_numbers``
    literals. Returns ``(lit_p, lit_q, code, left, right, count, result, ok)``: the literals as
    unreduced fractions ``lit_p / lit_q``; binary operation ``k < count`` computes
    ``left[k] code[k] right[k]`` into slot ``max_numbers + k``; a reference ``r`` names slot
    ``r >> 1``, negated if ``r & 1`` (unary signs only flip it); the value is ``result``. ``ok`` is
    False for a syntax error and for more than ``max_numbers`` literals."""
    width = data.shape[0]
    depth = width + 2
    n_ops = max_numbers - 1  # a valid expression of n literals has n - 1 binary operations

    def put(array, index, value):  # a select over the slots: no scatter under vmap
        return jnp.where(jnp.arange(array.shape[0]) == index, value, array)

    def get(array, index):
        return array[jnp.clip(index, 0, array.shape[0] - 1)]

    def reduce_top(ops, c):
        """Apply the operator on top of the operator stack to the reference stack: a unary sign
        flips the top reference; a binary operator becomes the next operation of the program.
        (Popping only moves ``otop``: ``ops`` stays out of the loop's carry.)"""
        otop, refs, rtop, code, left, right, count, ok = c
        op = get(ops, otop - 1).astype(jnp.int32)
        unary = (op == NEG) | (op == POS)
        b, a = get(refs, rtop - 1), get(refs, rtop - 2)
        ok = ok & (rtop >= jnp.where(unary, 1, 2)) & (otop > 0) & (unary | (count < n_ops))
        code, left, right = put(code, count, op), put(left, count, a), put(right, count, b)  # kept if binary
        ref = jnp.where(unary, b ^ (op == NEG), 2 * (max_numbers + count))
        rtop = rtop - jnp.where(unary, 1, 2)
        return otop - 1, put(refs, rtop, ref), rtop + 1, code, left, right, count + ~unary, ok

    def body(i, carry):
        (reduce_state, lit_p, lit_q, n_lits, expect_operand, skip,
         in_num, num_p, num_q, seen_dot, int_digits, leading_zero, nonzero, depth_paren) = carry
        ops, (otop, refs, rtop, code, left, right, count, ok) = reduce_state
        c = _byte(data, i, length)
        nxt = _byte(data, i + 1, length)
        at_end = i == length
        live = i <= length

        # 1. A number ends at any byte that is neither a digit nor '.': it becomes the next literal.
        digit, dot = _is_digit(c), c == 46
        continues = in_num & (digit | (dot & ~seen_dot))
        finishing = in_num & ~continues & live
        # Python: an integer literal with a leading zero must be all zeros ("00" ok, "03" not).
        bad_literal = finishing & ~seen_dot & leading_zero & nonzero & (int_digits > 1)
        bad_literal = bad_literal | (finishing & seen_dot & (int_digits == 0) & (num_q == 1))  # a lone "."
        ok = ok & ~bad_literal & ~(finishing & ~expect_operand) & ~(finishing & (n_lits >= max_numbers))
        lit_p = jnp.where(finishing, put(lit_p, n_lits, num_p), lit_p)
        lit_q = jnp.where(finishing, put(lit_q, n_lits, num_q), lit_q)
        refs = jnp.where(finishing, put(refs, rtop, 2 * n_lits), refs)
        rtop, n_lits = rtop + finishing, n_lits + finishing
        expect_operand = jnp.where(finishing, False, expect_operand)
        in_num = in_num & continues

        # 2. The byte itself (skipped: the second byte of "**" or "//").
        act = live & ~skip & ~in_num
        starts_num = act & (digit | dot) & ~at_end
        ok = ok & ~(starts_num & ~expect_operand)
        space = (c == 32) | (c == 9) | (c == 12)
        newline = (c == 10) | (c == 13)
        ok = ok & ~(act & newline & (depth_paren == 0))
        star2 = (c == 42) & (nxt == 42)
        slash2 = (c == 47) & (nxt == 47)
        op = jnp.select(
            [star2, slash2, c == 42, c == 47, c == 37, c == 43, c == 45],
            [POW, FLOORDIV, MUL, DIV, MOD, ADD, SUB], -1,
        )
        is_op = act & (op >= 0)
        unary = is_op & expect_operand & ((op == ADD) | (op == SUB))
        binary = is_op & ~unary
        ok = ok & ~(binary & expect_operand)
        lparen, rparen = act & (c == 40), act & (c == 41)
        ok = ok & ~(lparen & ~expect_operand) & ~(rparen & expect_operand)
        known = space | newline | digit | dot | (op >= 0) | (c == 40) | (c == 41) | at_end
        ok = ok & ~(act & ~known)

        # One reduction loop: a binary operator pops higher precedence (equal too, unless
        # right-associative **); ")" pops to the matching "(" and the end pops everything.
        precedence = jnp.array(PRECEDENCE, jnp.int32)
        prec = precedence[jnp.maximum(op, 0)]
        act_end = at_end & act

        def should_pop(c):
            otop, ok = c[0], c[-1]
            top = get(ops, otop - 1).astype(jnp.int32)
            outranks = (precedence[top] > prec) | ((precedence[top] == prec) & (op != POW))
            return ok & (otop > 0) & (top != LPAREN) & (rparen | act_end | (binary & outranks))

        reduced = jax.lax.while_loop(should_pop, partial(reduce_top, ops), (otop, refs, rtop, code, left, right, count, ok))
        otop, refs, rtop, code, left, right, count, ok = reduced
        matched = otop > 0
        ok = ok & ~(rparen & ~matched)
        otop = jnp.where(rparen & matched, otop - 1, otop)
        ok = ok & ~(act_end & ((otop != 0) | (rtop != 1) | expect_operand))

        pushed_op = jnp.where(unary, jnp.where(op == SUB, NEG, POS), jnp.where(lparen, LPAREN, op))
        pushing = (binary | unary | lparen) & ok
        ops = jnp.where(pushing, put(ops, otop, pushed_op.astype(ops.dtype)), ops)  # int8: a small carry
        otop = otop + pushing
        depth_paren = depth_paren + lparen - (rparen & matched)
        expect_operand = jnp.where(binary | unary | lparen, True, jnp.where(rparen, False, expect_operand))

        # Number accumulation: p / q with q = 10 ** (digits after the point).
        first = starts_num
        d = jnp.where(digit, c - 48, 0)
        fits = (num_p < LIMIT // 10) & (num_q < LIMIT // 10)  # room for one more digit
        ok = ok & ~(continues & digit & ~fits)
        num_p = jnp.where(first, d, jnp.where(continues & digit, num_p * 10 + d, num_p))
        num_q = jnp.where(first, 1, jnp.where(continues & digit & seen_dot, num_q * 10, num_q))
        seen_dot = jnp.where(first, dot, seen_dot | (continues & dot))
        int_digits = jnp.where(first, digit.astype(jnp.int32), int_digits + (continues & digit & ~seen_dot))
        leading_zero = jnp.where(first, digit & (c == 48), leading_zero)
        nonzero = jnp.where(first, digit & (c != 48), nonzero | (continues & digit & ~seen_dot & (c != 48)))
        in_num = in_num | first
        skip = act & (star2 | slash2)
        return ((ops, (otop, refs, rtop, code, left, right, count, ok)), lit_p, lit_q, n_lits, expect_operand, skip,
                in_num, num_p, num_q, seen_dot, int_digits, leading_zero, nonzero, depth_paren)

    zero, false = jnp.int32(0), jnp.bool_(False)
    program = jnp.zeros((max(n_ops, 1),), jnp.int32)
    reduce_state = (jnp.zeros((depth,), jnp.int8), (zero, jnp.zeros((max_numbers,), jnp.int32), zero,
                    program, program, program, zero, jnp.bool_(True)))
    literals = jnp.zeros((max_numbers,), jnp.int32), jnp.ones((max_numbers,), jnp.int32)
    init = (reduce_state, *literals, zero, jnp.bool_(True), false, false, zero, jnp.int32(1), false, zero,
            false, false, zero)
    out = jax.lax.fori_loop(0, jnp.minimum(length, width) + 1, body, init)
    (_, (_, refs, _, code, left, right, count, ok)), lit_p, lit_q = out[0], out[1], out[2]
    return lit_p, lit_q, code, left, right, count, refs[0], ok & (length > 0)


def run_program(lit_p, lit_q, code, left, right, count, result, ok):
    """Pass 2 of ``evaluate``: the program's value as a reduced fraction ``(p, q, ok)``, each
    literal reduced and each operation reduced after it is applied, as eager evaluation would."""
    max_numbers = lit_p.shape[0]
    p, q, lit_ok = _fraction(lit_p, lit_q, jnp.bool_(True))  # all literal slots at once
    ok = ok & jnp.all(lit_ok)
    slots = jnp.arange(max_numbers + code.shape[0])
    p = jnp.zeros(slots.shape, jnp.int32).at[:max_numbers].set(p)
    q = jnp.ones(slots.shape, jnp.int32).at[:max_numbers].set(q)

    def operand(ref):
        sign = 1 - 2 * (ref & 1)
        return p[ref >> 1] * sign, q[ref >> 1]

    for k in range(code.shape[0]):  # at most 3 operations: unrolled
        rp, rq, op_ok = _apply(code[k], operand(left[k]), operand(right[k]))
        live = k < count
        ok = ok & (~live | op_ok)
        p, q = p.at[max_numbers + k].set(rp), q.at[max_numbers + k].set(rq)
    rp, rq = operand(result)
    return jnp.where(ok, rp, 0), jnp.where(ok, rq, 1), ok


def evaluate(data, length, max_numbers: int = MAX_NUMBERS):
    """Jittable: the value of the arithmetic expression in ``data[:length]`` (bytes) as a reduced
    fraction ``(p, q, ok)``; ``ok`` is False where Python's ``eval`` fails or is not followed (see
    the module docstring), and for an expression of more than ``max_numbers`` literals."""
    return run_program(*parse(data, length, max_numbers))


def equals_target(p, q, ok, target):
    """``abs(p / q - target) < 1e-5``: exact for equal values; otherwise the fractions differ by at
    least ``1 / q``, and the float32 quotient decides only where ``q`` exceeds 1e5."""
    diff_fits = _product_fits(target, q)
    d = p - target * q
    close = jnp.abs(d.astype(jnp.float32)) < jnp.float32(1e-5) * q.astype(jnp.float32)
    return ok & diff_fits & ((d == 0) | close)


def score_answer(data, length, nums, num_count, target):
    """Jittable: RAGEN's Countdown score of the answer ``data[:length]`` (float32 0, 0.1 or 1)."""
    right_numbers = numbers_match(data, length, nums, num_count)
    # An answer of more literals than ``nums`` holds has more digit runs than the task's numbers,
    # so it scores 0 whatever its value: ``evaluate`` need not read more.
    p, q, ok = evaluate(data, length, max_numbers=nums.shape[0])
    correct = equals_target(p, q, ok, target)
    return jnp.where(right_numbers, jnp.where(correct, SCORE, FORMAT_SCORE), 0.0).astype(jnp.float32)
