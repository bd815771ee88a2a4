"""Scripts that run inside containers (passed as `python -c`, so nothing needs to be baked or mounted)."""
