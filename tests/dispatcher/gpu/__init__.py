"""Tests of the dispatcher's GPU backends (simulated, and NVML against a fake pynvml)."""
