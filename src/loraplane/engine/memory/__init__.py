"""Unified memory: one GPU budget whose chunks change hands between KV blocks and adapter pages."""
