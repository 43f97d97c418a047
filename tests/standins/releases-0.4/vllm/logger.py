"""TEST-ONLY: vllm's logger, which sglang 0.4.x quiets at each scheduler's start."""

import logging

logger = logging.getLogger("vllm")
