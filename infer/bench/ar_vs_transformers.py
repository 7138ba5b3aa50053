r"""AR decode speed: our jitted `autoregressive_decode` beside transformers' `generate`.

Same model and prompt, batch 1, greedy, one token per step.

  python -m infer.bench.ar_vs_transformers --max_new_tokens=128

Both load the same GGUF (transformers dequantises it itself; needs `accelerate` and torch).
Compilation and warm-up are excluded; the target prefill is excluded from both by subtracting a
prefill-only run. Prints one JSON object.
"""

from __future__ import annotations

import json
import time

import numpy as np
from absl import flags

from dflash_jax import api
from dflash_jax.decoding.settings import DecodeConfig
from infer import cli

FLAGS = flags.FLAGS
flags.DEFINE_string(
    "prompt",
    "Write a Python function that checks whether a number is prime.",
    "User prompt (chat template applied).",
)
flags.DEFINE_integer("max_new_tokens", 128, "Tokens to generate (no early stop).")
flags.DEFINE_integer("repeats", 3, "Timed repetitions; the median is reported.")
flags.DEFINE_integer("torch_threads", 0, "torch.set_num_threads (0 = torch's default).")


def main(argv):
    del argv
    import torch
    from transformers import AutoModelForCausalLM

    from dflash_jax.io import assets, load_target

    if FLAGS.torch_threads:
        torch.set_num_threads(FLAGS.torch_threads)
    target = load_target(assets.SMOLLM2_NAME)
    ids = api.render_prompt(target.tokenizer, FLAGS.prompt)
    n = FLAGS.max_new_tokens
    gguf = assets.smollm2_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    x = torch.tensor([ids])

    def hf_times():
        with torch.no_grad():
            t0 = time.perf_counter()
            out = model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            total = time.perf_counter() - t0
            t0 = time.perf_counter()
            model(x)
            return total, time.perf_counter() - t0, out[0, len(ids) :].tolist()

    hf_times()  # warm-up
    hf = [hf_times() for _ in range(FLAGS.repeats)]
    prompt, lengths = api.pad_prompts([ids])
    cfg = DecodeConfig(max_new_tokens=n, block_size=1)  # no stop ids: exactly n tokens
    prefill_cfg = DecodeConfig(max_new_tokens=1, block_size=1)
    for c in (cfg, prefill_cfg):
        api.timed_decode(target, None, prompt, lengths, 0, c)  # compile + warm-up
    ours = [
        (
            api.timed_decode(target, None, prompt, lengths, 0, cfg),
            api.timed_decode(target, None, prompt, lengths, 0, prefill_cfg),
        )
        for _ in range(FLAGS.repeats)
    ]
    hf_decode = float(np.median([(n - 1) / (t - p) for t, p, _ in hf]))
    jax_decode = float(np.median([(n - 1) / (r.run_s - p.run_s) for r, p in ours]))
    tokens = np.asarray(ours[0][0].output.tokens[0]).tolist()
    # transformers' min_new_tokens masks the stop token; compare up to our first stop token.
    stops = [i for i, t in enumerate(tokens) if t in api.stop_token_ids(target)]
    k = stops[0] if stops else n
    print(
        json.dumps(
            {
                "model": "SmolLM2-135M-Instruct (GGUF Q4_1 dequantised, fp32)",
                "prompt_tokens": len(ids),
                "new_tokens": n,
                "transformers_decode_tokens_per_s": hf_decode,
                "jax_decode_tokens_per_s": jax_decode,
                "jax_over_transformers": jax_decode / hf_decode,
                "same_tokens_before_first_stop": tokens[:k] == hf[0][2][:k],
                "torch_threads": torch.get_num_threads(),
            }
        )
    )


if __name__ == "__main__":
    cli.run(main)
