"""The multi-process deployment (`python -m app --workers N`, N > 1): the launcher, one engine process
that holds the session and the batcher, N HTTP worker processes, and the link between them. It plugs
into the serving core through app.backend (a Batcher and an EngineInfo); nothing in the core imports it."""
