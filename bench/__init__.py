"""Development tooling of the source checkout, never shipped (pyproject.toml packages bridge, cachestore and
workers only): `nkicache bench`'s command (`cli.py`) and measurements, the scripts beside them (each run as
`python bench/NAME.py`), and what the benchmarks and the tests share: a throwaway redis-server (`dev_redis.py`)
and a proxy that trickles a Redis's replies (`trickle_proxy.py`)."""
