"""The planner: the real engine loop, scheduler, block pool, arena arithmetic and morph controller on a virtual
clock, with step times from NVIDIA's measured TensorRT-LLM kernel tables (aiconfigurator-core) or from this
machine's own measurements (``--system local``). ``make plan`` / ``python -m sim`` (docs/planner.md).

Room rules (tests/project/test_layout.py): sim may import workload, serve and policy (never a bench tool); nothing
imports sim.
"""
