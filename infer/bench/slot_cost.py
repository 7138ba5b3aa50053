r"""What a loop step of the served program costs with 1 and with N busy slots.

  python -m infer.bench.slot_cost --dtype=bfloat16 --max_new_tokens=128 --max_prompt_tokens=256

Builds `infer.serve`'s decoder (`decoding.slots.SlotDecoder`, the server's config: batch-invariant,
every row its own settings) for each --slot_counts, fills every slot with the same greedy
prompt, and times --steps loop steps with each step kind forced, --rounds rounds over all
(slot count, kind) pairs, the fastest of each kept. Prints one JSON object: ms per step by slot
count and kind, and each kind's cost at N slots over its cost at the first count. A server's
throughput over one-by-one decoding is at most N / that ratio at equal tau. --max_prompt_tokens
(infer.serve's flag, default 512) sets the prompt buffer as the server's.
"""

from __future__ import annotations

from absl import app, flags

from dflash_jax import api
from dflash_jax.decoding.settings import kind_label
from dflash_jax.decoding.slots import SlotDecoder
from infer import cli, common, report, serve
from infer.serving.server import WARM_PROMPT

FLAGS = flags.FLAGS
flags.adopt_module_key_flags(common)  # --help lists the shared flags too
flags.DEFINE_list("slot_counts", ["1", "8"], "Slot counts to build and time (the first: the unit).")
flags.DEFINE_integer("steps", 6, "Timed loop steps per run.", lower_bound=1)
flags.DEFINE_integer(
    "rounds", 3, "Rounds over every (slots, kind); the fastest is kept.", lower_bound=1
)
flags.DEFINE_string("output", None, "Also write the JSON object here.")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    common.quiet_library_logs()
    common.enable_compilation_cache()
    if FLAGS.batch_invariant is None:
        FLAGS.batch_invariant = True  # as infer.serve
    with common.usage_errors():
        target, drafter, dtype, _ = common.load_models(choose_tile=False)
        cfg = serve.server_config(target, drafter)
        counts = [int(n) for n in FLAGS.slot_counts]
        decoders = {
            n: SlotDecoder(target, drafter, cfg, n, FLAGS.max_prompt_tokens) for n in counts
        }
    ids = api.render_prompt(target.tokenizer, WARM_PROMPT)
    kinds = range(len(cfg.all_kinds)) if cfg.adaptive else (-1,)
    best: dict[tuple[int, int], float] = {}
    for _ in range(FLAGS.rounds):
        for n, dec in decoders.items():
            for kind in kinds:
                for slot in range(n):
                    dec.insert(slot, ids, max_new=cfg.max_new_tokens)
                dec.advance(1, forced_kind=kind)  # the first step of a kind is not timed
                chunk = dec.advance(FLAGS.steps, forced_kind=kind)
                dec.release(range(n))
                ms = 1e3 * chunk.seconds / max(chunk.acc.shape[1], 1)
                best[n, kind] = min(best.get((n, kind), float("inf")), ms)
    label = lambda kind: kind_label(cfg.all_kinds[kind]) if kind >= 0 else str(cfg.block_size)
    result = {
        "dtype": dtype,
        "batch_invariant": bool(cfg.batch_invariant),
        "max_new_tokens": cfg.max_new_tokens,
        "max_prompt_tokens": FLAGS.max_prompt_tokens,
        "ms_per_step": {str(n): {label(k): best[n, k] for k in kinds} for n in counts},
        "over_first": {
            str(n): {label(k): best[n, k] / best[counts[0], k] for k in kinds} for n in counts[1:]
        },
    }
    report.emit_json(result, FLAGS.output)


if __name__ == "__main__":
    cli.run(main)
