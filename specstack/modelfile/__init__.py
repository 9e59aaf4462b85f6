"""GGUF model files: read, described and written without loading weights into llama.cpp.

``read`` parses the file, ``meta`` turns its metadata into a model description,
``archs`` knows the recurrent architectures, ``compat`` decides whether one model
can draft for another, ``scan`` inventories a folder of GGUF files, and
``standin`` writes random-weight stand-ins with a real model's shapes.  Loading a
model goes through ``specstack.llama``; the host's CPU and memory are ``specstack.host``.
"""
