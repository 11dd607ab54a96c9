"""Fault bench of a Dynamo cluster of hosts (network namespaces): python -m bench.dynamo_faults --help."""
