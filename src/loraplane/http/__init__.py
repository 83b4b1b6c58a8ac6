"""The HTTP face of the server: OpenAI-compatible API, admin API, Prometheus metrics. Imports the engine, never the reverse."""
