"""Drafters: propose tokens for the target to verify (llama.cpp's common_speculative implementations)."""
