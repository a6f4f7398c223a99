"""Evaluation and generation."""
