"""The engine as an NVIDIA Dynamo worker, and the launcher that puts N of them behind Dynamo's frontend.

- ``worker.py``: ``MorphServeWorker`` (a ``dynamo.common.backend.LLMEngine``), ``python -m serve.dynamo``
- ``requests.py``: Dynamo request <-> SamplingParams / response chunks (pure)
- ``bridge.py``: engine-thread callbacks -> asyncio streams
- ``metrics.py``: live KV snapshots for the router, morph gauges for ``/metrics``
- ``model_card.py``: the tokenizer directory the frontend reads
- ``cli.py``: the worker's command line
- ``cluster.py``: ``python -m serve.dynamo.cluster`` (``make serve-dynamo``): frontend + N workers

Only ``worker.py`` imports Dynamo; everything else runs in the project's own environment.
"""
