"""Measuring a run: throughput, MFU, memory, and where metrics go."""
