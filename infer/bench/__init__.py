"""Measuring scripts: each times one thing and prints (or writes) one JSON object for results/.

kernel_bench        attention kernels against XLA, one layer at Qwen3-8B shapes (time, memory)
ar_vs_transformers  our jitted AR decode beside transformers' `generate`, same model and prompt
ar_context_scaling  how a batched AR step grows with the prompt buffer
step_cost           each adaptive step kind's cost, in AR steps of the same run
stream_cost         the same decode streamed in chunks of steps and run in one call
serve_load          infer.serve under 8 concurrent openai clients against one by one
slot_cost           a step of the served program with 1 and with N busy slots
serve_alone         one request alone through infer.serve against infer.generate, same prompt
structured_client   structured output through the openai client against a running server
invariance_cost     bf16 with and without batch invariance (and fp32), same prompt, one run
quant_speed         fp32, bf16, int8 and int4 targets, alone and default decode, one run
first_answer        infer.generate --compare_ar phase by phase (imports, load, programs, decodes)

docs/results.md says which script made which figure. The user CLIs are the modules of infer/.
"""
