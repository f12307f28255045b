"""`djax serve`: an OpenAI-compatible HTTP server with continuous batching at block
boundaries."""
