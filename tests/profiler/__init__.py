"""Tests of the profiler service."""
