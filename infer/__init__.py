"""Command-line entry points (absl): generate, benchmark, acceptance, convert, lower,
memory_plan; the measuring scripts are in infer.bench."""
