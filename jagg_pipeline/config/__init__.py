"""Configuration: the typed config of a run, its loading, schema and model sources."""
