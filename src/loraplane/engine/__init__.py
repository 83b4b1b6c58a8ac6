"""The serving engine core. Imports only torch, triton, safetensors, numpy and loraplane.kernels/artifacts."""
