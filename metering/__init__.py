"""Signed usage metering: prices, usage records, the hash-chained ledger, Merkle tree heads, audits."""
