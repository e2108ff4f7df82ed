"""The Snakemake workflow's Python side: experiments expanded into runs and files."""
