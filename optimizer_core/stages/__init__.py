"""Pipeline stages: plain functions, URIs in, small result records out (in progress)."""
