"""The `kiln` command line, the demo and the embedded default."""
