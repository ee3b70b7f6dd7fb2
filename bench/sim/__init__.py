"""The serving simulator: the real engines on virtual time over a modeled GPU."""
