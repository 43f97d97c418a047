"""TEST-ONLY: a package of the vllm stand-in (see vllm/__init__.py)."""
