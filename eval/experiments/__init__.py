"""One-off tuning sweeps and accuracy questions behind eval/PERF_NOTES.md (see README.md here).

Run from the repository root as ``python -m eval.experiments.<module>``. Not part of the benchmarks users run
(those are the ``eval.bench_*`` modules and the accuracy harness); kept so that a PERF_NOTES entry can be re-measured.
"""
