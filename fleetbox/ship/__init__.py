"""Getting images onto HPC platforms: exports, registry push, pull commands."""
