"""The serving side. Kept import-free: the operator imports ``loraplane.server.artifacts`` through it."""
