"""Support code, not the algorithm: the machine a figure was measured on and the noise of
repeated measurements, resident memory, CPU math settings, files written whole, data packages
and datasets from the package index, optional plotting."""
