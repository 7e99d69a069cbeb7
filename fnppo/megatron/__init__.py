"""fnppo.megatron."""
