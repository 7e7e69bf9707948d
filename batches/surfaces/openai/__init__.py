"""The openai batch surface (see batches/surfaces/__init__.py)."""
