"""The parts of `infer.serve`: the engine (a queue and the thread that drives the slots of
one running decode) and the OpenAI-compatible HTTP app."""
