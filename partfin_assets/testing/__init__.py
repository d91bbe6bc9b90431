"""Test support that ships with the package: fault-injection hooks and real Dagster processes for tests and benchmarks."""
