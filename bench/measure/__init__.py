"""Measurement: a ``Trial`` (``trial``) run in one of three modes (``run``) into one result row."""
