"""The HTTP server: OpenAI-compatible and plain endpoints over an `AsyncEngine` (`app.create_app`)."""
