"""Helpers the tests share: an independent reference loop, and what they need to start processes."""
