"""Facts of llama.cpp the harness mirrors exactly: its sampling and server defaults (`defaults`), its log format
(`log`) and the GGUF files it reads (`gguf`). Nothing here serves or judges anything."""
