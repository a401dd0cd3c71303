"""Speculative decoding: drafters propose, the target verifies, exact acceptance decides."""
