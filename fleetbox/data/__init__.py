"""Data for offline training: verified downloads and Paddle dataset caches."""
