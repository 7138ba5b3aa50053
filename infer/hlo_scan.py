"""What a compiled program's HLO text says about its loops: how many cache-sized buffers its
while loops copy every step (`cache_copies_in_loop`), read by `infer.bench.device_check` and the
tests of the loops that must update their caches in place. No flags: tests import it."""

from __future__ import annotations

import re

import numpy as np

_SHAPE = re.compile(r"\b(bf16|f16|f32|s32|u32|s8|u8|pred)\[([0-9,]*)\]")
_CALLS = re.compile(r"(?:body|condition|calls|to_apply|branch_computations)=\{?([^}\n]*)\}?")


def _computations(hlo: str) -> dict[str, list[str]]:
    """HLO module text -> computation name -> its instruction lines."""
    comps, name = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if head and not line.startswith(" "):
            name = head.group(1)
            comps[name] = []
        elif name is not None and line.startswith(" "):
            comps[name].append(line)
    return comps


def _reachable(comps: dict, roots: list[str]) -> set[str]:
    seen, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        for line in comps[name]:
            for group in _CALLS.findall(line):
                todo += [c.strip().lstrip("%") for c in group.split(",") if c.strip()]
    return seen


def loop_copy_shapes(hlo: str) -> list[tuple[int, ...]]:
    """The result shape (the largest, for a tuple) of every copy instruction (copy,
    copy-start) inside the while loops' bodies and what they call, in XLA:CPU, GPU and TPU
    HLO text alike (a TPU shape's tiled layout is ignored)."""
    comps = _computations(hlo)
    bodies = [
        m.group(1)
        for lines in comps.values()
        for line in lines
        if " while(" in line
        for m in [re.search(r"body=%?([\w.\-]+)", line)]
        if m
    ]
    shapes = []
    for name in _reachable(comps, bodies):
        for line in comps[name]:
            m = re.search(r"=\s*(\S.*?)\s(copy|copy-start)\(", line)
            if not m:
                continue
            found = [tuple(int(d) for d in dims.split(",") if d)
                     for _, dims in _SHAPE.findall(m.group(1))]  # fmt: skip
            if found:
                shapes.append(max(found, key=lambda s: int(np.prod(s))))
    return shapes


def cache_copies_in_loop(hlo: str, cache_elements: int) -> int:
    """Copy instructions (copy, copy-start) inside the while loops' bodies (and what they
    call) whose result holds at least `cache_elements` elements: a cache buffer copied every
    step instead of updated in place."""
    return sum(int(np.prod(s)) >= cache_elements for s in loop_copy_shapes(hlo))


def copies_of_shapes_in_loop(hlo: str, shapes) -> int:
    """Copies inside the while loops' bodies whose result has one of `shapes` (a cache's or a
    recurrent state's per-device shapes): what `infer.lower --device` reports, exact where an
    element threshold would also count a logits or weight copy."""
    shapes = {tuple(s) for s in shapes}
    return sum(s in shapes for s in loop_copy_shapes(hlo))
