"""What the planner and the benchmark tools share: workloads from traces, an engine driven through one on a
clock (the replay), latency summaries by vLLM's definitions, repeated runs' medians and their plots."""
