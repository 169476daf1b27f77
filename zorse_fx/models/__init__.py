"""Models zorse_fx ships for tests, examples and the demo."""
