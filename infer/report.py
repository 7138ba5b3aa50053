"""The end-of-run summaries of infer.generate and infer.benchmark: a title line, then aligned
`label  value` lines. No flags are defined here, so that any CLI can import it."""

from __future__ import annotations


def kind_words(label: str) -> str:
    """A step kind's label (`config.kind_label`: "1", "8", "-8", "tree16") in words: "plain",
    "block 8", "copy 8" (a block copied by prompt lookup), "tree 16"."""
    if label == "1":
        return "plain"
    if label.startswith("tree"):
        return f"tree {label[4:]}"
    if label.startswith("-"):
        return f"copy {label[1:]}"
    return f"block {label}"


def kind_mix(mix: dict[str, float], share: bool = False) -> str:
    """{kind label: steps} (or, with `share`, {label: fraction of steps}) as one line, the most
    taken kind first: "35 plain, 30 copy 8, 2 block 4" or "70% plain, 23% copy 8"."""
    ranked = sorted(mix.items(), key=lambda kv: -kv[1])
    count = (lambda v: f"{100 * v:.0f}%" if v >= 0.005 else "<1%") if share else str
    return ", ".join(f"{count(v)} {kind_words(k)}" for k, v in ranked)


def block(title: str, rows: list[tuple[str, str]]) -> str:
    """The title, then one `  label  value` line per row, the values in one column."""
    width = max(len(label) for label, _ in rows)
    return "\n".join([title] + [f"  {label:<{width}}  {value}" for label, value in rows])


def identical(same: bool, to: str = "the target alone") -> str:
    return f"identical to {to}" if same else f"DIFFERENT from {to}"
