"""mia_stream."""
