"""Alembic migrations of the profile store's schema (applied by the service at start-up)."""
