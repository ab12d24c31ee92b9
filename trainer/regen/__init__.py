"""The ``regenerate`` job: the target writes the answers through OpenAI-compatible endpoints,
each source row exactly once, resumable."""
