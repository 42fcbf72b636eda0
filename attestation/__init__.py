"""TEE attestation: evidence that binds the node's metering key to SEV-SNP or TDX hardware, and its offline check."""
