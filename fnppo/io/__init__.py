"""fnppo.io."""
