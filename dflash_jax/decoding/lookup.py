"""Prompt lookup: the free baseline every drafter is compared with (`infer.benchmark`).

The proposer copies: it finds the longest suffix (up to `max_ngram` tokens) of the text so far
(prompt + answer) that occurred earlier, and proposes the tokens that followed its latest earlier
occurrence. Simulated offline on the target's own greedy answer: a step commits the matching
prefix of the proposal plus one target token, exactly as a verify step would, so the tau it
reports is what a copying drafter would reach on the same text at the same block size.
"""

from __future__ import annotations

from collections.abc import Sequence


def _proposal(context: Sequence[int], length: int, max_ngram: int) -> list[int]:
    for n in range(min(max_ngram, len(context) - 1), 0, -1):
        suffix = list(context[-n:])
        for start in range(len(context) - n - 1, -1, -1):
            if list(context[start : start + n]) == suffix:
                return list(context[start + n : start + n + length])
    return []


def prompt_lookup_taus(
    prompt: Sequence[int], answer: Sequence[int], block_size: int, max_ngram: int = 3
) -> list[int]:
    """Tokens committed per step (bonus included) when a prompt-lookup proposer drafts
    `block_size - 1` tokens a step and `answer` is what the target decodes greedily after
    `prompt`. The first answer token comes from the prefill, as in `speculative_decode`."""
    context = list(prompt) + list(answer[:1])
    done, taus = 1, []
    while done < len(answer):
        proposal = _proposal(context, block_size - 1, max_ngram)
        accepted = 0
        for token in proposal:
            if done + accepted < len(answer) and token == answer[done + accepted]:
                accepted += 1
            else:
                break
        step = min(accepted + 1, len(answer) - done)
        context += answer[done : done + step]
        done += step
        taus.append(step)
    return taus
