"""The kopf operator for LoRABase and LoRAAdapter. Reaches server pods only over HTTP."""
