"""The llama.cpp layer: the only package that imports ``llama_cpp``."""
