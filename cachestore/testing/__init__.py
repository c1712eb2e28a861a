"""Test support shipped with cachestore: the contract every store passes (cachestore.testing.contract)."""
