"""Persistent cache tiers: the tier contract, Redis and embedded backends, entry format, reports."""
