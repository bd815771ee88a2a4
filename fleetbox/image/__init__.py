"""Building images: the matrix, locks, the offline wheelhouse, system bases and hermetic builds."""
