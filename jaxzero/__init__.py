"""jaxzero: data parallelism and ZeRO stages 1-3 for JAX."""
