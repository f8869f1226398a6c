"""The test suite, a package so that tests and scripts import tests/support/ by one name."""
