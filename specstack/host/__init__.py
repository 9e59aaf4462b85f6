"""This host: ``sysinfo`` reads the CPU, memory and NUMA layout, and ``doctor`` turns that into
advice for CPU inference.  Neither loads a model."""
