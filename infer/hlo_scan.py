"""What a compiled program's HLO text says about its loops: how many cache-sized buffers its
while loops copy every step (`cache_copies_in_loop`), read by `infer.bench.device_check`,
`infer.lower` and the tests of the loops that must update their caches in place, and how many
they only move between memory spaces (`cache_prefetches_in_loop`). No flags: tests import it.

The text is any backend's optimised HLO (`compiled.as_text()`): XLA:CPU's, XLA:GPU's or
XLA:TPU's, whose layouts carry tiles and memory spaces (`{3,2,1,0:T(8,128)(2,1)S(1)}`)."""

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


def _loop_copies(hlo: str) -> list[tuple[str, str]]:
    """(result type, operand type) of each copy instruction (copy, copy-start) inside the while
    loops' bodies (and what they call)."""
    comps = _computations(hlo)
    bodies = [
        m.group(1)
        for lines in comps.values()
        for line in lines
        if " while(" in line
        for m in [re.search(r"body=%?([\w.\-]+)", line)]
        if m
    ]
    types = {
        m.group(1): m.group(2)
        for lines in comps.values()
        for line in lines
        for m in [re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\S.*?)\s[\w\-]+\(", line)]
        if m
    }
    found = []
    for name in _reachable(comps, bodies):
        for line in comps[name]:
            m = re.search(r"=\s*(\S.*?)\s(?:copy|copy-start)\(%?([\w.\-]+)", line)
            if m:
                found.append((m.group(1), types.get(m.group(2), "")))
    return found


def _dims(hlo_type: str) -> list[tuple[int, ...]]:
    """The dims of each array in an HLO type (a tuple's elements in order)."""
    return [tuple(int(d) for d in ds.split(",") if d) for _, ds in _SHAPE.findall(hlo_type)]


def _cache_sized(hlo: str, cache_elements: int) -> list[tuple[str, str]]:
    """`_loop_copies` whose result holds at least `cache_elements` elements."""
    return [
        (out, arg)
        for out, arg in _loop_copies(hlo)
        if (dims := _dims(out)) and max(np.prod(d) for d in dims) >= cache_elements
    ]


def _placement(hlo_type: str) -> tuple[str, int]:
    """(layout less its memory space, memory space) of an HLO type's first array: `S(n)` in
    its layout (0, device memory, when absent)."""
    m = re.match(r"\(?\s*\w+\[[0-9,]*\](?:\{([^}]*)\})?", hlo_type)
    layout = (m.group(1) or "") if m else ""
    space = re.search(r"S\((\d+)\)", layout)
    return re.sub(r"S\(\d+\)", "", layout), int(space.group(1)) if space else 0


def _moved(out: str, arg: str) -> bool:
    """Whether a copy from type `arg` to `out` only moves a buffer to another memory space (the
    same layout): XLA:TPU's memory-space assignment prefetching it into VMEM, or evicting it."""
    (out_layout, out_space), (arg_layout, arg_space) = _placement(out), _placement(arg)
    return out_space != arg_space and out_layout == arg_layout


def cache_copies_in_loop(hlo: str, cache_elements: int) -> int:
    """Copy instructions (copy, copy-start) inside the while loops' bodies (and what they
    call) whose result holds at least `cache_elements` elements: a cache buffer copied every
    step instead of updated in place (a transpose to another layout included). A buffer only
    moved to or from another memory space in the same layout (XLA:TPU's memory-space
    assignment prefetching a kernel's operand into VMEM, `S(1)`) is counted by
    `cache_prefetches_in_loop` instead."""
    return sum(not _moved(out, arg) for out, arg in _cache_sized(hlo, cache_elements))


def cache_prefetches_in_loop(hlo: str, cache_elements: int) -> int:
    """The copies `cache_copies_in_loop` leaves out: cache-sized buffers moved between memory
    spaces inside the loop (prefetched into a TPU's VMEM for a fusion or kernel, or evicted
    back), each step's traffic but no second buffer of the cache."""
    return sum(_moved(out, arg) for out, arg in _cache_sized(hlo, cache_elements))


def copies_of_shapes_in_loop(hlo: str, shapes) -> int:
    """Copies (copy, copy-start) inside the while loops' bodies and what they call whose result
    has one of `shapes` (a cache's or a recurrent state's per-device dims; a TPU layout's tiles
    ignored): what `infer.lower --device` reports, exact where an element threshold would also
    count a logits or weight copy. A buffer only moved to another memory space in the same
    layout (XLA:TPU prefetching a kernel's operand into VMEM, `S(1)`) is not a copy."""
    shapes = {tuple(s) for s in shapes}
    return sum(
        bool(dims := _dims(out)) and max(dims, key=np.prod) in shapes and not _moved(out, arg)
        for out, arg in _loop_copies(hlo)
    )
