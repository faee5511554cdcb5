"""Simulators: pure discrete-event drivers of the policy cores (seeded RNG, virtual time)."""
