"""Dense in-memory oracles of the metric engine (tests only; not installed)."""
