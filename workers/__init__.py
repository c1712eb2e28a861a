"""Compile workers and the `nkicache` command line."""
