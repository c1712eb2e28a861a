"""Tiers kept as blobs: the blob contract (`contract`), the one tier written on it (`tier`), and its leases."""
