"""fnppo.steps."""
