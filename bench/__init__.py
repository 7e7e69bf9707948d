"""Benchmarks for Relay batch. They print figures; they never assert timings. See bench/README.md."""
