"""Backends that serve requests: the in-process engine adapter and llama-server."""
