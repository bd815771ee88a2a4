"""Running jobs: one spec, one plan, backends (Docker, Slurm) and container runtimes."""
