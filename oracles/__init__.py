"""Judging: metrics, tolerance budgets, verdicts and drift records."""
