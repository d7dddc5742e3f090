"""A stand-in for the parts of apple/axlearn (commit 34aed43c1b6e581c4753d06d7cbeedd5010ef26b)
that neuron_remat's axlearn adapter touches: the same module paths, class names and config
fields, written for the tests (no axlearn code). tests/cpu/axlearn_fixtures.py puts it on
sys.path; it is never installed."""
