"""Pure outer-loop math: torch + stdlib only (no asyncio, network, metrics or wall clock)."""
