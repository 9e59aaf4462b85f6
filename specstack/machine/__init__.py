"""What is on this machine: model files and hardware.

``gguf_meta`` reads GGUF metadata without loading weights (``gguf_read`` parses
the file, ``archs`` knows the recurrent architectures), ``check`` decides
whether one model can draft for another, ``models_scan`` inventories a folder
of GGUF files, ``sysinfo`` reads the CPU, memory and NUMA layout, and
``doctor`` turns that into advice for CPU inference.  None of them loads a
model; llama.cpp is reached only through ``specstack.target``.
"""
