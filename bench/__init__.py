"""Benchmarks: HTTP clients of a node, which they run through its command line and never import."""
