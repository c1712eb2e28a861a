"""A stand-in of neuronx-cc for the tests of nkicache exec (tests/test_exec.py); not neuronx-cc."""
