"""GPU memory: the arbiter that hands out the KV blocks (the split's fixed shares, or one unified budget whose
chunks change hands between KV blocks and adapter rows), and the layout that builds it for each mode."""
