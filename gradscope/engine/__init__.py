"""The engine: which rule serves each parameter (plan), hook capture (session), the passes."""
