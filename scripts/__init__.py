"""Benchmarks, checks and generators that sit beside the otdus package, run from the repository root
as modules: ``python -m scripts.NAME`` (each one's make target is in the Makefile). They import otdus_cli,
each other (``from scripts import make_synthetic``) and the test suite's tiny models (tests.support),
never a path of their own."""
