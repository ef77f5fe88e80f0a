"""Redis connector: a shared, content-addressed store of full KV blocks."""
