"""Activate: the instrumentor that wires the checks into sglang and unwires them, and `doctor`, which says what it would do."""
