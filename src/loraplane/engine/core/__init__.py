"""The engine loop and its torch-free bookkeeping: sequences, scheduler, block manager, configs."""
