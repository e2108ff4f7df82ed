"""Artifacts between stages: atomic files, manifests, shards, tables, prompts, figures."""
