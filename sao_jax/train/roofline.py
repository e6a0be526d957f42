"""The roofline of a compiled step: its FLOPs, HBM bytes and collective bytes per device, the
time each takes at the chip's peak, and which of the three bounds the step.

XLA's `compiled.cost_analysis()` counts the body of a loop once, and the learner step is loops
within loops (critic updates, micro-batches, layers, MoE token chunks, attention blocks): its
figures are short by orders of magnitude. The bytes here are counted from the optimized HLO
module (`compiled.as_text()`, one device's program), each computation weighted by how many times
it runs: a `while` body by its trip count, read from the loop itself (the condition `i < bound`,
the body's `i + 1`, the start and bound in the loop's initial tuple). A bound may move with an
enclosing loop's counter (causal attention's key blocks, `fori_loop(0, q + 1)` inside a map
over the query blocks `q`, `q` the map's counter or an `arange` sliced by it): the loop then
runs its average trips. A loop whose trips depend on the data (attention over packed segments)
counts once and is reported (`HloCounts.unknown_loops`): the bytes are then a lower bound. Both
branches of a conditional count.

- HBM bytes: each top-level instruction's operands and results in HBM (memory space 0: the
  TPU's prefetches into on-chip memory, `copy-start`, count as reads of HBM), as XLA's cost
  analysis counts a fusion: a slice of an operand counts as the slice, a buffer updated in
  place (`dynamic-update-slice`) as the update; a loop's state costs nothing between
  iterations.
- Collective bytes: each all-gather, all-reduce, reduce-scatter, all-to-all and
  collective-permute by its larger side (an all-gather's result, a reduce-scatter's operand):
  the buffer a device spreads or assembles.

FLOPs are not read from the HLO: the TPU compiler writes matmuls as convolutions and the MoE's
grouped matmuls as Mosaic kernels, whose FLOPs it does not state; the caller counts them from
the architecture (`plan.step_flops`). Each figure's time is a lower bound at the chip's peak
(`Roofline.seconds`); the largest names the bound.
"""

from __future__ import annotations

import dataclasses
import math
import re

# Bytes per element; sub-byte and 8-bit floats by their prefix (`_itemsize`).
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
             "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\](?:\{([^}]*)\})?")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%([^\s=]+)\s*=\s*(.*)$")
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%([^\s(]+)\s*\(.*\{\s*$")
_CALLEE = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation)"
                     r"=%([^\s,}]+)")
_CALLEES = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all",
                "collective-permute", "ragged-all-to-all")
# Instructions that move no HBM bytes of their own (control flow is counted in its bodies).
_NO_TRAFFIC = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call",
               "conditional", "after-all", "add-dependency", "partition-id", "replica-id",
               "opt-barrier", "domain"}
_SLICES = {"dynamic-slice", "slice", "gather"}
_IN_PLACE = {"dynamic-update-slice", "scatter"}


@dataclasses.dataclass(frozen=True)
class HloCounts:
    """Per device and per run of the program: `hbm_bytes` and `collective_bytes` (see the
    module docstring), and `unknown_loops`, the loops whose trip counts could not be read
    (each counted once)."""

    hbm_bytes: float
    collective_bytes: float
    unknown_loops: int


@dataclasses.dataclass(frozen=True)
class Roofline:
    """One step on one device: `flops`, `hbm_bytes` and `collective_bytes`, and the chip's
    peak FLOP/s, HBM bandwidth and interconnect (ICI) bandwidth, bytes per second."""

    flops: float
    hbm_bytes: float
    collective_bytes: float
    peak_flops: float
    hbm_bytes_per_s: float
    ici_bytes_per_s: float
    unknown_loops: int = 0

    @property
    def seconds(self) -> dict[str, float]:
        """The time each resource needs at its peak: "compute", "HBM", "ICI"."""
        return {"compute": self.flops / self.peak_flops,
                "HBM": self.hbm_bytes / self.hbm_bytes_per_s,
                "ICI": self.collective_bytes / self.ici_bytes_per_s}

    @property
    def bound(self) -> str:
        """The resource the step waits on longest at the peaks (the others may overlap it)."""
        seconds = self.seconds
        return max(seconds, key=seconds.get)

    def report(self) -> list[str]:
        seconds = self.seconds
        rows = (("compute", f"{self.flops:.3e} FLOPs", f"{self.peak_flops / 1e12:,.0f} TFLOP/s"),
                ("HBM", f"{self.hbm_bytes:.3e} bytes", f"{self.hbm_bytes_per_s / 1e9:,.0f} GB/s"),
                ("ICI", f"{self.collective_bytes:.3e} bytes",
                 f"{self.ici_bytes_per_s / 1e9:,.0f} GB/s"))
        lines = [f"  roofline per step and device, each at the chip's peak: {self.bound}-bound"]
        lines += [f"    {name:<10}{amount:>22}{_duration(seconds[name]):>12}  at {rate}"
                  for name, amount, rate in rows]
        if self.unknown_loops:
            lines.append(f"    ({self.unknown_loops} loop(s) whose trips depend on the data "
                         "counted once: the HBM and ICI bytes are lower bounds)")
        return lines


def _duration(seconds: float) -> str:
    unit, size = next(((u, x) for u, x in (("s", 1.0), ("ms", 1e-3)) if seconds >= x),
                      ("us", 1e-6))
    return f"{seconds / size:,.1f} {unit}"


def count(hlo: str) -> HloCounts:
    """The HBM and collective bytes of the optimized HLO module `hlo` (`compiled.as_text()`)."""
    return _Module(hlo).counts()


@dataclasses.dataclass
class _Instruction:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attributes: str


@dataclasses.dataclass
class _Computation:
    name: str
    entry: bool
    instructions: dict[str, _Instruction] = dataclasses.field(default_factory=dict)
    root: str = ""


@dataclasses.dataclass(frozen=True)
class _Affine:
    """`c0 + c1 * i`, `i` the counter of the loop whose body is being read (0 for constants)."""

    c0: float
    c1: float = 0.0

    def __add__(self, other):
        return _Affine(self.c0 + other.c0, self.c1 + other.c1)

    def __sub__(self, other):
        return _Affine(self.c0 - other.c0, self.c1 - other.c1)


@dataclasses.dataclass(frozen=True)
class _Loop:
    """A `while` body's place: the computation and instruction that run it, the tuple index of
    its counter, the counter's first value and the average number of trips."""

    caller: str
    instruction: _Instruction
    counter: int
    start: float
    trips: float


class _Module:
    def __init__(self, hlo: str):
        self.computations: dict[str, _Computation] = {}
        current = None
        for line in hlo.splitlines():
            if current is None:
                header = _COMPUTATION.match(line)
                if header:
                    current = _Computation(header.group(2), bool(header.group(1)))
                    self.computations[current.name] = current
                continue
            if line.startswith("}"):
                current = None
                continue
            parsed = _parse_instruction(line)
            if parsed is not None:
                root, instruction = parsed
                current.instructions[instruction.name] = instruction
                if root:
                    current.root = instruction.name
        # Computations whose instructions are not the device's own steps: a fusion's body
        # (the fusion reads and writes HBM as one), a reduction's or sort's scalar function.
        instructions = [i for c in self.computations.values() for i in c.instructions.values()]
        self.inlined = {callee for i in instructions if i.opcode == "fusion"
                        for callee in _callees(i)}
        self.inlined |= {m.group(1) for i in instructions
                         for m in re.finditer(r"\bto_apply=%([^\s,}]+)", i.attributes)}
        self.loops: dict[str, _Loop] = {}

    def counts(self) -> HloCounts:
        # Callees print before their callers: in reverse, every caller is weighed first.
        order = list(self.computations.values())[::-1]
        runs = {c.name: 0.0 for c in order}
        runs.update({c.name: 1.0 for c in order if c.entry})
        hbm = collective = 0.0
        unknown = 0
        for comp in order:
            n = runs[comp.name]
            if not n:
                continue
            for ins in comp.instructions.values():
                if ins.opcode == "while":
                    trips = self._trips(comp, ins)
                    if trips is None:
                        unknown += 1
                        trips = 1.0
                    body, cond = _attribute(ins, "body"), _attribute(ins, "condition")
                    runs[body] += n * trips
                    runs[cond] += n * (trips + 1)
                else:
                    for callee in _callees(ins):
                        if callee in runs:
                            runs[callee] += n
                if _collective(ins.opcode):
                    collective += n * self._collective_bytes(comp, ins)
                if comp.name not in self.inlined:
                    hbm += n * self._hbm_bytes(comp, ins)
        return HloCounts(hbm_bytes=hbm, collective_bytes=collective, unknown_loops=unknown)

    # -- bytes -------------------------------------------------------------------------------

    def _shape(self, comp: _Computation, name: str) -> str:
        ins = comp.instructions.get(name)
        return ins.shape if ins is not None else ""

    def _collective_bytes(self, comp, ins) -> float:
        operands = sum(_bytes(self._shape(comp, o)) for o in ins.operands)
        result = max((_bytes(a) for a in _arrays(ins.shape)), default=0)
        return max(operands, result)

    def _hbm_bytes(self, comp, ins) -> float:
        op = ins.opcode
        if op in _NO_TRAFFIC or op.endswith("-done") or \
                'custom_call_target="AllocateBuffer"' in ins.attributes:
            return 0.0
        operands = [self._shape(comp, o) for o in ins.operands]
        if op in _SLICES:
            return 2 * _bytes(ins.shape, hbm=True)
        if op in _IN_PLACE:  # (buffer, update, indices...) or (buffer, indices, updates)
            return 2 * _bytes(operands[1 if op == "dynamic-update-slice" else 2], hbm=True)
        if op == "copy-start" or (op.endswith("-start") and _collective(op)):
            result = max(_arrays(ins.shape), key=_bytes, default="")
            return sum(_bytes(s, hbm=True) for s in operands) + _bytes(result, hbm=True)
        if op == "fusion":
            fused = self.computations[_callees(ins)[0]]
            reads = sum(self._fusion_read(fused, k, s) for k, s in enumerate(operands))
            return reads + self._fusion_write(fused, fused.root, ins.shape)
        return sum(_bytes(s, hbm=True) for s in operands) + _bytes(ins.shape, hbm=True)

    def _fusion_read(self, fused: _Computation, k: int, shape: str) -> float:
        """Bytes a fusion reads of its operand `k` (of `shape`)."""
        if not _bytes(shape, hbm=True):
            return 0.0
        param = next((i.name for i in fused.instructions.values()
                      if i.opcode == "parameter" and i.attributes.startswith(f"{k})")), None)
        return min(self._read(fused, param), _bytes(shape))

    def _read(self, comp: _Computation, name: str) -> float:
        """Bytes read of value `name` inside the fused computation `comp`: the slices taken of
        it, nothing where it is a buffer updated in place, else the whole value (through
        bitcasts and nested fusions)."""
        total = 0.0
        for user in comp.instructions.values():
            if name not in user.operands:
                continue
            first = user.operands[0] == name
            if user.opcode in _SLICES and first:
                total += _bytes(user.shape)
            elif user.opcode in _IN_PLACE and first:
                continue
            elif user.opcode == "bitcast":
                total += self._read(comp, user.name)
            elif user.opcode == "fusion":
                nested = self.computations[_callees(user)[0]]
                total += sum(self._fusion_read(nested, k, self._shape(comp, name))
                             for k, o in enumerate(user.operands) if o == name)
            else:
                return _bytes(self._shape(comp, name))
        return total

    def _fusion_write(self, fused: _Computation, name: str, shape: str) -> float:
        """Bytes a fusion writes of its result `shape` (`name`, the root, in `fused`): the
        update of a buffer updated in place, else the whole result."""
        if not _bytes(shape, hbm=True):
            return 0.0
        root = fused.instructions[name]
        if root.opcode == "tuple":
            return sum(self._fusion_write(fused, o, s)
                       for o, s in zip(root.operands, _elements(shape), strict=True))
        if root.opcode == "bitcast":
            return self._fusion_write(fused, root.operands[0], shape)
        if root.opcode == "fusion":
            nested = self.computations[_callees(root)[0]]
            return self._fusion_write(nested, nested.root, shape)
        if root.opcode in _IN_PLACE:
            update = root.operands[1 if root.opcode == "dynamic-update-slice" else 2]
            return _bytes(self._shape(fused, update))
        return _bytes(shape)

    # -- trip counts -------------------------------------------------------------------------

    def _trips(self, comp: _Computation, loop: _Instruction) -> float | None:
        """The average trips of `loop` (a `while` in `comp`), or None; records the body's
        counter for the loops inside it."""
        cond = self.computations[_attribute(loop, "condition")]
        body = self.computations[_attribute(loop, "body")]
        compare = cond.instructions[cond.root]
        operands = compare.operands
        if compare.opcode == "fusion":  # the CPU compiler wraps the compare alone
            fused = self.computations[_callees(compare)[0]]
            compare = fused.instructions[fused.root]
            operands = [operands[int(fused.instructions[o].attributes.split(")")[0])]
                        if fused.instructions[o].opcode == "parameter" else None
                        for o in compare.operands]
        direction = re.search(r"direction=(\w+)", compare.attributes)
        init = comp.instructions.get(loop.operands[0])
        if compare.opcode != "compare" or direction is None or None in operands or \
                init is None or init.opcode != "tuple":
            return None
        direction = direction.group(1)
        if direction in ("GT", "GE"):  # bound > counter
            operands, direction = operands[::-1], {"GT": "LT", "GE": "LE"}[direction]
        if direction not in ("LT", "LE"):
            return None
        counter, rhs = (self._tuple_index(cond, o) for o in operands)
        if counter is None:
            return None
        if rhs is None:
            bound = self._value(cond, operands[1])
        elif self._invariant(body, rhs):
            bound = self._value(comp, init.operands[rhs])
        else:
            bound = None
        start = self._value(comp, init.operands[counter])
        if not isinstance(bound, _Affine) or not isinstance(start, _Affine):
            return None
        self.loops[body.name] = _Loop(comp.name, loop, counter, 0.0, 0.0)  # to read the step
        root = body.instructions[body.root]
        step = self._value(body, root.operands[counter]) if root.opcode == "tuple" else None
        if step != _Affine(1.0, 1.0):
            del self.loops[body.name]
            return None
        trips = bound - start + _Affine(1.0 if direction == "LE" else 0.0)
        if trips.c1:  # the bound or start moves with the enclosing loop's counter
            outer = self.loops.get(comp.name)
            if outer is None:
                del self.loops[body.name]
                return None
            trips = _Affine(trips.c0 + trips.c1 * (outer.start + (outer.trips - 1) / 2))
        if math.isnan(trips.c0):
            del self.loops[body.name]
            return None
        trips_avg = max(trips.c0, 0.0)
        first = start.c0 if not start.c1 else math.nan  # a moving start: inner loops give up
        self.loops[body.name] = _Loop(comp.name, loop, counter, first, trips_avg)
        return trips_avg

    def _tuple_index(self, comp: _Computation, name: str) -> int | None:
        """`i` when `name` is element `i` of `comp`'s parameter (through copies)."""
        ins = comp.instructions[name]
        while ins.opcode in ("copy", "bitcast", "convert", "reshape"):
            ins = comp.instructions[ins.operands[0]]
        if ins.opcode == "get-tuple-element" and \
                comp.instructions[ins.operands[0]].opcode == "parameter":
            return int(_attribute(ins, "index"))
        return None

    def _invariant(self, body: _Computation, index: int) -> bool:
        root = body.instructions[body.root]
        return root.opcode == "tuple" and \
            self._tuple_index(body, root.operands[index]) == index

    def _value(self, comp: _Computation, name: str, params=None):
        """The value of scalar `name` in `comp` as an `_Affine` of `comp`'s loop counter (when
        `comp` is a recorded loop body), a list (a constant or iota vector), or None. `params`:
        the values of a fused computation's parameters, by number."""
        ins = comp.instructions.get(name)
        if ins is None:
            return None
        op, args = ins.opcode, ins.operands
        if op == "constant":
            numbers = re.findall(r"-?\d+", ins.attributes.split(")")[0])
            if not numbers or not re.match(r"[su]\d+\[", ins.shape):  # integers only
                return None
            values = [float(x) for x in numbers]
            return _Affine(values[0]) if _is_scalar(ins.shape) else values
        if op == "iota":
            dims = _dims(ins.shape)
            return [float(x) for x in range(dims[0])] if len(dims) == 1 else None
        if op in ("copy", "bitcast", "convert", "reshape", "broadcast"):
            return self._value(comp, args[0], params)
        if op in ("add", "subtract", "multiply"):
            a, b = (self._value(comp, x, params) for x in args)
            if not isinstance(a, _Affine) or not isinstance(b, _Affine):
                return None
            if op == "add":
                return a + b
            if op == "subtract":
                return a - b
            if a.c1 and b.c1:
                return None
            return _Affine(a.c0 * b.c0, a.c0 * b.c1 + a.c1 * b.c0)
        if op == "dynamic-slice" and math.prod(_dims(ins.shape)) == 1:
            vector, index = self._value(comp, args[0], params), self._value(comp, args[1], params)
            if isinstance(vector, list) and isinstance(index, _Affine):
                step = vector[1] - vector[0] if len(vector) > 1 else 0.0
                if all(b - a == step for a, b in zip(vector, vector[1:], strict=False)):
                    return _Affine(vector[0] + step * index.c0, step * index.c1)
            return None
        if op == "parameter":
            return params(int(ins.attributes.split(")")[0])) if params else None
        if op == "fusion":
            fused = self.computations[_callees(ins)[0]]
            return self._value(fused, fused.root,
                               lambda k: self._value(comp, args[k], params))
        if op == "get-tuple-element" and comp.name in self.loops and \
                comp.instructions[args[0]].opcode == "parameter":
            loop, index = self.loops[comp.name], int(_attribute(ins, "index"))
            if index == loop.counter:
                return _Affine(0.0, 1.0)
            if self._invariant(comp, index):
                caller = self.computations[loop.caller]
                init = caller.instructions[loop.instruction.operands[0]]
                value = self._value(caller, init.operands[index])
                if isinstance(value, _Affine) and value.c1:
                    return None  # moves with the caller's own loop
                return value
        return None


def _parse_instruction(line: str) -> tuple[bool, _Instruction] | None:
    match = _INSTRUCTION.match(line)
    if match is None:
        return None
    root, name, rest = match.groups()
    if rest.startswith("("):
        end = _closing(rest, 0)
        shape, rest = rest[:end + 1], rest[end + 1:].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    opcode, paren, rest = rest.partition("(")
    if not paren:
        return None
    end = _closing(rest, -1)
    operands = re.findall(r"%([^\s,)]+)", rest[:end])
    # A constant's literal and a parameter's number stay in front of the attributes.
    attributes = rest if opcode in ("constant", "parameter") else rest[end + 1:]
    return bool(root), _Instruction(name, shape, opcode.strip(), operands, attributes)


def _closing(text: str, start: int) -> int:
    """The index in `text` of the parenthesis closing the one at `start` (-1: one already
    open before `text`)."""
    depth = 0 if start >= 0 else 1
    for i in range(max(start, 0), len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return i
    return len(text)


def _attribute(ins: _Instruction, key: str) -> str:
    match = re.search(rf"\b{key}=%?([^\s,}}]+)", ins.attributes)
    return match.group(1) if match else ""


def _callees(ins: _Instruction) -> list[str]:
    names = [m.group(2) for m in _CALLEE.finditer(ins.attributes)]
    for group in _CALLEES.finditer(ins.attributes):
        names += re.findall(r"%([^\s,}]+)", group.group(1))
    return names


def _collective(opcode: str) -> bool:
    return opcode.removesuffix("-start") in _COLLECTIVES


def _arrays(shape: str) -> list[str]:
    return [m.group(0) for m in _ARRAY.finditer(shape)]


def _elements(shape: str) -> list[str]:
    """The top-level elements of a tuple shape (one array: itself)."""
    if not shape.startswith("("):
        return [shape]
    elements, depth, start = [], 0, 1
    for i, ch in enumerate(shape):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if (ch == "," and depth == 1) or (depth == 0 and ch == ")"):
            elements.append(re.sub(r"/\*.*?\*/", "", shape[start:i]).strip())
            start = i + 1
    return elements


def _dims(shape: str) -> list[int]:
    match = _ARRAY.search(shape)
    return [int(d) for d in match.group(2).split(",") if d] if match else []


def _is_scalar(shape: str) -> bool:
    return math.prod(_dims(shape)) == 1


def _itemsize(dtype: str) -> float:
    if dtype in _ITEMSIZE:
        return _ITEMSIZE[dtype]
    if dtype.startswith(("f8", "s8", "u8")):
        return 1
    if dtype.startswith(("f4", "s4", "u4")):
        return 0.5
    return 0  # token and opaque types


def _bytes(shape: str, *, hbm: bool = False) -> float:
    """Bytes of every array in `shape`; with `hbm`, only those in memory space 0."""
    total = 0.0
    for match in _ARRAY.finditer(shape):
        dtype, dims, layout = match.groups()
        space = re.search(r"S\((\d+)\)", layout or "")
        if hbm and space and space.group(1) != "0":
            continue
        total += _itemsize(dtype) * math.prod(int(d) for d in dims.split(",") if d)
    return total
