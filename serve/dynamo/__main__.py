"""``python -m serve.dynamo [options]``: one MorphServe worker for NVIDIA Dynamo (see serve/dynamo/worker.py)."""

from serve.dynamo.worker import main

if __name__ == "__main__":
    main()
