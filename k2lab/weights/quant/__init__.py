"""Stored weight formats: one module per format."""
