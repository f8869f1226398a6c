"""What many test files share, and what scripts that use the test suite's tiny models import
(scripts/coverage.py, scripts/widen_tiny_ppl.py): tiny model builders, checks of a CLI run's outcome,
CUDA emulated on the CPU. tests/conftest.py holds only pytest fixtures and hooks."""
