"""The gateway: routing, adapters, the upstream choke point, the pipeline's stages, streaming and the live API.
Above policies and usage, below batches and the project shell (tests/test_layers.py)."""
