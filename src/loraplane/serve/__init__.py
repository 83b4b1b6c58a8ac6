"""The server pod's process: ``loraplane serve`` and ``loraplane demo`` wire the engine to the HTTP apps."""
