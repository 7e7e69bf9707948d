"""The bottom layer: tenancy, the catalog, credentials, auth, Redis, errors, crypto, host kinds. Every app may
import it; it imports no other app of the project (tests/test_layers.py)."""
