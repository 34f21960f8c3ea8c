"""Checks the property modules share (properties/test_*.py import these, never one another)."""
