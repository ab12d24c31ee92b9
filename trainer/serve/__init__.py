"""The drafter as it serves: acceptance length by speculative decoding, the ``export`` command,
and ``served-check`` (vLLM serves the export; served τ against trained τ)."""
