"""Measurement harnesses: kernel timings per device type and link alpha-beta fits."""
