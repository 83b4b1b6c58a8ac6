"""The adapter supply chain: torch-free (manifests, signatures, base hash, S3 host cache, CLI)."""
