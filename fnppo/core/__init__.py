"""fnppo.core."""
