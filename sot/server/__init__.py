"""The OpenAI-compatible server (``sot serve``) and its load generator (``sot bench-serve``)."""
