"""Bytes an optimised HLO module moves (``hlo_bytes``), read off its text: what a memory-bound
program such as one decode step costs, loops counted by their trip counts. ``bench.step
--cost-analysis`` uses it on the decode step.
"""

from __future__ import annotations

import re

import numpy as np

_SHAPE = re.compile(r"\b(pred|s8|u8|s16|u16|s32|u32|s64|u64|f16|bf16|f32|f64)\[([\d,]*)\]")
_BITS = {"pred": 8, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "f16": 16, "bf16": 16,
         "s32": 32, "u32": 32, "f32": 32, "s64": 64, "u64": 64, "f64": 64}  # fmt: skip
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.+?) ([\w-]+)\((.*?)\)(.*)$")
TOP = 12  # items listed by hlo_bytes
_IN_PLACE = {"dynamic-update-slice", "scatter"}  # XLA updates the operand's buffer in place
_FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while", "conditional", "call",
         "after-all", "partition-id", "replica-id", "iota"}  # fmt: skip


def _elements(dims: str) -> int:
    """Elements of an array of dimensions ``dims`` as the HLO writes them (``3,4``; empty: a scalar)."""
    return int(np.prod([int(d) for d in dims.split(",") if d] or [1]))


def _dims(shape: str) -> list[int]:
    """The dimensions of the first array in ``shape`` (``f32[3,4]{1,0}`` -> [3, 4])."""
    return [int(d) for d in _group(r"\[([\d,]*)\]", shape).split(",") if d]


def _shape_bytes(text: str) -> int:
    return sum(_BITS[t] // 8 * _elements(dims) for t, dims in _SHAPE.findall(text))


def _without_workspace(shape: str) -> str:
    """A library call's result without its scratch buffer (cuBLAS returns ``(result, s8[bytes])``):
    scratch space is not data the program moves."""
    return re.sub(r",\s*s8\[\d+\]\{0\}\)$", ")", shape)


def _group(pattern: str, text: str) -> str:
    """The first group of ``pattern``'s first match in ``text``, which the HLO's grammar guarantees
    (a ``ValueError`` naming both if the text is not such HLO)."""
    found = re.search(pattern, text)
    if found is None:
        raise ValueError(f"HLO text without {pattern!r}: {text!r}")
    return found.group(1)


def _sliced_parameters(parsed) -> dict[int, int]:
    """Fused parameters read only through (dynamic-)slices or as a gather's table: parameter index ->
    bytes read (the slices, or the rows gathered)."""
    params = {inst: int(_group(r"parameter\((\d+)\)", f"{op}({operands})"))
              for inst, _, op, operands, _ in parsed if op == "parameter"}  # fmt: skip
    uses: dict[str, list[tuple[str, str, bool]]] = {p: [] for p in params}
    for inst, shape, op, operands, _ in parsed:
        for i, name in enumerate(re.findall(r"%([\w.-]+)", operands)):
            if name in uses:
                uses[name].append((op, shape, i == 0))
    return {
        params[p]: sum(_shape_bytes(shape) for _, shape, _ in u)
        for p, u in uses.items()
        if u and all(op in ("dynamic-slice", "slice", "gather") and first for op, _, first in u)
    }


def _computations(hlo_text: str) -> tuple[dict[str, list[str]], str]:
    """The module's computations (name -> instruction lines) and the entry computation's name."""
    computations: dict[str, list[str]] = {}
    name, entry = None, ""
    for line in hlo_text.splitlines():
        header = re.match(r"^(?:ENTRY )?%(\S+) \(.*\{$", line)
        if header:
            name = header.group(1)
            computations[name] = []
            if line.startswith("ENTRY"):
                entry = name
        elif name and line.strip() and line.strip() != "}":
            computations[name].append(line)
    return computations, entry


def _instructions(lines: list[str], shapes: dict[str, str]):
    """Each instruction of a computation's ``lines`` as ``(name, shape, op, operands, attributes)``,
    its result shape recorded in ``shapes`` (what later operands are looked up in)."""
    for line in lines:
        m = _INSTRUCTION.match(line)
        if m:
            shapes[m.group(1)] = m.group(2)
            yield m.groups()


def _trips(attrs: str, unknown_trips: int) -> int:
    """A while loop's known trip count, else ``unknown_trips`` (a loop that ends on its data)."""
    trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', attrs)
    return int(trips.group(1)) if trips else unknown_trips


#: The custom call of starpo-jax's CPU products kernel (``cpu_kernels.PRODUCT``): x [..., rows, in]
#: times each of its weights, one result [..., rows, out_i] each. Named here rather than imported,
#: so that this module stays a reader of text that imports no jax (a test checks the two agree).
KERNEL_PRODUCTS = "starpo_row_products"


def hlo_flops(hlo_text: str, unknown_trips: int = 1) -> int:
    """FLOPs of an optimised HLO module's matrix products (``dot``: 2 × result elements × the
    contracted size), fused ones included, and of the weight products it hands to the CPU products
    kernel (``KERNEL_PRODUCTS``: 2 × each result's elements × x's features), loops counted by their
    trip counts (``unknown_trips`` for a loop without a known one, such as a decode loop that ends
    when every row has stopped). Elementwise work is left out: in a transformer it is a few per
    cent of the products'. So is the CPU attention kernel's: its work depends on the lengths the
    program reads at run time."""
    computations, entry = _computations(hlo_text)

    def walk(comp: str, times: int) -> int:
        shapes: dict[str, str] = {}
        total = 0
        for inst, shape, op, operands, attrs in _instructions(computations[comp], shapes):
            if op == "while":
                total += walk(_group(r"body=%(\S+?)[,\s]", attrs + " "), times * _trips(attrs, unknown_trips))
                continue
            if op == "dot":
                lhs = _group(r"%([\w.-]+)", operands)
                dims = _dims(shapes.get(lhs, "[]"))
                contracted = [int(i) for i in _group(r"lhs_contracting_dims=\{([\d,]*)\}", attrs).split(",") if i]
                out = _dims(shape)
                total += 2 * int(np.prod(out or [1])) * int(np.prod([dims[i] for i in contracted] or [1])) * times
            if op == "custom-call" and f'custom_call_target="{KERNEL_PRODUCTS}"' in attrs:
                x = _group(r"%([\w.-]+)", operands)
                results = sum(_elements(dims) for _, dims in _SHAPE.findall(shape))
                total += 2 * results * _dims(shapes[x])[-1] * times
            calls = r"(?:to_apply=|calls=|branch_computations=\{|, )" if op == "call" else r"(?:calls=|branch_computations=\{|, )"
            for called in re.findall(calls + r"%([\w.-]+)", attrs):
                if called in computations:  # a fusion's computation, or every branch (an upper bound)
                    total += walk(called, times)
        return total

    return walk(entry, 1)


def hlo_bytes(hlo_text: str, unknown_trips: int = 1) -> tuple[int, list[tuple[int, str]]]:
    """Bytes an optimised HLO module reads and writes, loops counted by their trip counts.

    XLA's own ``cost_analysis`` counts a while loop's body once, and a decode step is a loop over
    the layers. Here every executed instruction outside fused computations (fusions, copies, dots,
    custom calls, slices, updates, ...) counts its operands' and result's bytes, times the known
    trip counts of the loops around it; an operand that is only sliced or gathered from counts the
    part read. An
    in-place update (``dynamic-update-slice``, or a fusion
    whose result aliases its first operand and whose root is one) counts the bytes it writes twice
    (read and write) instead of the whole buffer. Returns the total and the biggest items
    (bytes, instruction name and ``op_name``). ``unknown_trips``: the trips counted for a loop
    without a known trip count (a decode loop that ends when every row has stopped).
    """
    computations, entry = _computations(hlo_text)
    fused_roots, sliced, wrapped = {}, {}, {}
    for comp, lines in computations.items():
        parsed = [m.groups() for m in map(_INSTRUCTION.match, lines) if m]
        root = next(((op, attrs) for line, (_, _, op, _, attrs) in zip(lines, parsed) if "ROOT" in line), ("", ""))
        fused_roots[comp] = root[0]
        sliced[comp] = _sliced_parameters(parsed)
        inner = re.search(r"calls=%([\w.-]+)", root[1]) if root[0] == "fusion" else None
        if inner:  # XLA:GPU's async computations wrap one fusion, their parameters passed through
            wrapped[comp] = inner.group(1)

    items: list[tuple[int, str]] = []

    def walk(comp: str, times: int) -> int:
        shapes: dict[str, str] = {}
        starts, total = {}, 0
        for inst, shape, op, operands, attrs in _instructions(computations[comp], shapes):
            # An asynchronous pair (XLA:GPU's fusion-start/-done, copy-start/-done) counts once, at its
            # end, as the fusion or copy it runs: the start's result only echoes its operands.
            if op.endswith("-start"):
                starts[inst] = operands, attrs
                continue
            if op.endswith("-done"):
                operands, attrs = starts[_group(r"%([\w.-]+)", operands)]
                op = "copy" if op == "copy-done" else "fusion"
            if op == "while":
                body = _group(r"body=%(\S+?)[,\s]", attrs + " ")
                total += walk(body, times * _trips(attrs, unknown_trips))
                continue
            if op in ("call", "conditional"):  # conditional: every branch counted (an upper bound)
                for called in re.findall(r"(?:to_apply=|branch_computations=\{|, )%([\w.-]+)", attrs):
                    if called in computations:
                        total += walk(called, times)
                continue
            if op in _FREE:
                continue
            names = re.findall(r"%([\w.-]+)", operands)
            called = re.search(r"calls=%([\w.-]+)", attrs)
            called = called and wrapped.get(called.group(1), called.group(1))
            root = fused_roots.get(called, "") if called else op
            read = {i: _shape_bytes(shapes.get(n, "")) for i, n in enumerate(names)}
            if called:  # a fused operand that is only sliced is read only in part
                read |= sliced.get(called, {})
            if op in ("dynamic-slice", "slice", "gather"):
                read[0] = _shape_bytes(shape)
            if root in _IN_PLACE and names:  # the first operand is the buffer updated in place
                nbytes = 2 * sum(v for i, v in read.items() if i > 0)
            else:
                nbytes = _shape_bytes(_without_workspace(shape) if op == "custom-call" else shape) + sum(read.values())
            meta = re.search(r'op_name="([^"]*)"', attrs)
            items.append((nbytes * times, f"{op} {inst} {shape} x{times} {meta.group(1) if meta else ''}"))
            total += nbytes * times
        return total

    total = walk(entry, 1)
    return total, sorted(items, reverse=True)[:TOP]
