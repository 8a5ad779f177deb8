"""Benchmarks: `python -m overlap_tp.bench {ops,norm} ...` (see each subcommand's --help)."""
