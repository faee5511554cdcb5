"""Tests of the per-GPU dispatcher."""
