"""Shared basics every layer may use: error types, start-up helpers, timers."""
