"""Kiln's HTTP service: the database layer, the object store and the FastAPI app.

Nothing here imports torch or the engine: the API enqueues jobs by task name.
"""
