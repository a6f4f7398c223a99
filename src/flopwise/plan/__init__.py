"""Reasoning before running: parameters, FLOPs, memory, time and cost from the config."""
