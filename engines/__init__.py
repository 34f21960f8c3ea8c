"""Adapters that expose the code under test (mirror, vllm, sglang, tokenspeed) as subjects."""
