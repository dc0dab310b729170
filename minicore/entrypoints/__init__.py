"""Entry points that serve minicore over the network: the OpenAI-compatible HTTP server."""
