"""Searches over trials: ``chunk_heads=auto`` (``autochunk``), max context (``maxctx``), the planner (``plan``)."""
