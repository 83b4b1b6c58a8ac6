"""The base model on the device: weights, attention, the model runner, sampling, detokenizing, CUDA graphs."""
