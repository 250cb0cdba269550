"""serve.py's library, an OpenAI-compatible server in three parts:

    batcher    continuous batching: one thread owns the model and decodes every active request in one step
    requests   what the API accepts: request bodies, settings, OpenAI's error shape, a body -> the batcher's request
    app        the FastAPI app on uvicorn: endpoints, streaming, the API-key and body-size guard, run_server

Importing this package imports none of them: serve.py checks the `serve` extra (fastapi, uvicorn) before it needs it.
"""
