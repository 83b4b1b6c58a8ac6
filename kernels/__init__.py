"""Multi-LoRA kernels (Triton) and their plain-torch references. Imports nothing else of loraplane."""
