"""Command-line entry points (absl): generate, benchmark, convert."""
