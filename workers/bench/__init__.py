"""`nkicache bench`: the benchmark measurements and the command that reports them."""
