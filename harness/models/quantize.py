"""`python -m harness.models.quantize SOURCE DEST TYPE`: `llama-quantize --allow-requantize --pure SOURCE DEST
TYPE 1` through llama-cpp-python's `llama_model_quantize` (the same llama.cpp code, byte-identical output: the
Gemma draft's sha256 769b4662… from both on 0c1e570). A process of its own, so llama.cpp's log goes to its
stderr (the caller keeps the last line for the error) and the registry needs no llama-server build."""

import ctypes
import sys


def quantize(source: str, dest: str, ftype_name: str) -> int:
    """llama_model_quantize's status (0 on success) for SOURCE → DEST at LLAMA_FTYPE_MOSTLY_<TYPE>, pure, one
    thread, requantizing allowed."""
    import llama_cpp

    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype_name.upper()}", None)
    if ftype is None:
        print(f"unknown quantization type {ftype_name}", file=sys.stderr)
        return 2
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread, params.allow_requantize, params.pure = ftype, 1, True, True
    return llama_cpp.llama_model_quantize(source.encode(), dest.encode(), ctypes.byref(params))


if __name__ == "__main__":
    sys.exit(1 if quantize(*sys.argv[1:4]) else 0)
