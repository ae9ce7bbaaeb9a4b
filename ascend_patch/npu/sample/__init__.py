"""Sampling on the NPU."""
