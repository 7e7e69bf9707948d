"""The multi-host drill (`make drill`, scripts/drill.sh, docs/many-hosts.md): three hosts as Linux network
namespaces on one machine, disturbed while OpenAI, Anthropic and native batches run across them.

Modules, bottom up: topology.py (names, addresses, the environment of every process), upstream.py (the
fake provider, which tags every answer with the host that asked), stack.py (the processes of each
host), ledger.py (what the database says about a scenario's items: lost, duplicated, fenced),
workload.py (the catalog, the submissions), run.py (the scenarios and the report)."""
