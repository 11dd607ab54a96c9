"""Scripts that run inside a peer's own virtual environment (vLLM, llama-cpp-python), started by
bench.peer as subprocesses. They import only the standard library and the peer: never the project."""
