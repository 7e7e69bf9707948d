"""The item worker's runtime, bottom up: bookkeeper.py (heartbeats and handed-over writes),
execute.py (one item), drain.py (the worker loop), warmup.py (a process's start). A second way to
run records is a module beside these."""
