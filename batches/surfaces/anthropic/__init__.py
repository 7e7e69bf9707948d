"""The anthropic batch surface (see batches/surfaces/__init__.py)."""
