"""Checks: the write wrappers, the step check, the write map, owners and liveness, and the guard state they share."""
