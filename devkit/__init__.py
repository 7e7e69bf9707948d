"""Development kit: the demo catalog, the fake providers and their batch APIs. Never imported by the relay
itself; `make run`, the tests, the benchmarks and the drills start or import it."""
