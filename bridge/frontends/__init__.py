"""The two NKI frontends: beta3 (AST parser to BIR, live) and beta2 (tracer to KLIR, dormant in the bridge)."""
