"""Usage reports API: usage events, summaries and budgets, read across usage and batches."""
