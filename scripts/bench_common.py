"""Kept only for scripts/acceptance_study.py (owned elsewhere): the benchmark harness is
`specdec_jax.harness`; import from there."""

from specdec_jax.harness import result_header, write_results  # noqa: F401
