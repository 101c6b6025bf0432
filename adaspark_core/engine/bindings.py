"""What the engine binds of llama.cpp beyond llama-cpp-python's own Python API: backend start-up,
the C++-linkage extensions a DSpark drafter needs, GGUF checks, requantisation, thread counts, and
the rule that a context is freed with its object. The model (llama.py), its contexts and targets
(llama_context.py, llama_target.py, llama_batch.py), a drafter's sequence (llama_sequence.py) and
dspark.py (the DSpark drafter's context) build on it; nothing else in the package calls llama.cpp.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import llama_cpp as L

from adaspark_core.base.errors import InputError

GGUF_MAGIC = b"GGUF"

# FLASH_ATTN_NOTE: flash attention is off by default. With it on, a row's logits change with the
# number of rows in the batch, so a tree would not verify the same text as a chain (and on a CPU it
# verifies slower; ARCHITECTURE.md, section 5). With it off, every batch of two rows or more
# computes each row bit for bit as a one-batch re-score does (paper 3.5: only the one-row kernel
# differs).
MAX_SEQ = 256  # LLAMA_MAX_SEQ in the vendored llama.cpp
UINT32_MAX = 2**32 - 1  # llama.cpp's context sizes are uint32_t

_backend_ready = False
_quiet_log = None  # keeps the ctypes callback alive


def init_backend(verbose: bool) -> None:
    global _backend_ready, _quiet_log
    if _backend_ready:
        return
    L.llama_backend_init()
    if not verbose:
        _quiet_log = L.llama_log_callback(lambda level, text, user: None)
        L.llama_log_set(_quiet_log, ctypes.c_void_p(0))
    _backend_ready = True


# --- llama.cpp's C++-linkage extensions (DSpark) ---------------------------------------------------
# The functions of the vendored llama-ext.h have C++ linkage: libllama.so exports them under
# Itanium-mangled names (llama_cpp_ext.py binds a few the same way). Bound on first use, so a
# build without them fails only when a DSpark drafter is asked for.
_EXT_SIGNATURES = {
    "set_embeddings_layer_inp": ("_Z30llama_set_embeddings_layer_inpP13llama_contextjb",
                                 [L.llama_context_p_ctypes, ctypes.c_uint32, ctypes.c_bool], None),
    "get_embeddings_layer_inp": ("_Z30llama_get_embeddings_layer_inpP13llama_contextj",
                                 [L.llama_context_p_ctypes, ctypes.c_uint32], ctypes.POINTER(ctypes.c_float)),
    "target_layer_ids": ("_Z28llama_model_target_layer_idsPK11llama_model",
                         [L.llama_model_p_ctypes], ctypes.POINTER(ctypes.c_int32)),
    "target_layer_ids_n": ("_Z30llama_model_target_layer_ids_nPK11llama_model",
                           [L.llama_model_p_ctypes], ctypes.c_uint32),
    "dflash_selector_top_k": ("_Z33llama_model_dflash_selector_top_kPK11llama_model",
                              [L.llama_model_p_ctypes], ctypes.c_int32),
    "set_embeddings_nextn": ("_Z26llama_set_embeddings_nextnP13llama_contextbb",
                             [L.llama_context_p_ctypes, ctypes.c_bool, ctypes.c_bool], None),
    "get_embeddings_nextn": ("_Z26llama_get_embeddings_nextnP13llama_context",
                             [L.llama_context_p_ctypes], ctypes.POINTER(ctypes.c_float)),
}
_bound: dict = {}


def ext(name: str):
    f = _bound.get(name)
    if f is None:
        symbol, argtypes, restype = _EXT_SIGNATURES[name]
        try:
            f = getattr(L.llama_cpp._lib, symbol)
        except AttributeError:
            raise InputError(f"this llama-cpp-python build does not export {symbol} (llama_{name}); "
                             "DSpark needs llama-cpp-python 0.3.36's libllama") from None
        f.argtypes, f.restype = argtypes, restype
        _bound[name] = f
    return f


# llama_get_logits returning the buffer's address as an int: llama-cpp-python's binding returns a
# float pointer, which costs a ctypes cast every verify (engine/llama_context.py: LlamaContext.logits).
_get_logits = L.llama_cpp._lib["llama_get_logits"]  # a function object of its own, not the package's
_get_logits.argtypes, _get_logits.restype = [L.llama_context_p_ctypes], ctypes.c_void_p


def logits_address(ctx) -> int:
    """Where the context's logits are, after its last decode (llama_get_logits)."""
    return _get_logits(ctx)


# Target architectures whose graph exposes its layers' inputs, which a DSpark drafter reads: the
# vendored src/models/*.cpp that set t_layer_inp, by their general.architecture names. On any
# other architecture llama.cpp aborts the process when the inputs are read, so it is checked here.
HIDDEN_STATE_ARCHS = frozenset({
    "bailingmoe3", "deepseek4", "gemma4", "gpt-oss", "hunyuan_vl", "lfm2", "llama", "mimo2", "minimax-01",
    "minimax-m2", "muse-glimmer", "nanbeige", "nemotron_h", "qwen3", "qwen35", "qwen35moe", "qwen3moe",
    "qwen3next", "qwen4exp",
})


def check_gguf(path: str | os.PathLike) -> Path:
    """The path, if it names a readable GGUF file; InputError otherwise."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"model file not found: {p}")
    try:
        with open(p, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise InputError(f"cannot read model file {p}: {e.strerror}") from None
    if magic != GGUF_MAGIC:
        raise InputError(f"not a GGUF model file: {p}")
    return p


def quantize(src: str | os.PathLike, dst: str | os.PathLike, ftype: int, threads: int = 0) -> None:
    """Write a requantised copy of ``src`` (llama_model_quantize with allow_requantize)."""
    init_backend(verbose=False)
    params = L.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True
    params.nthread = threads
    rc = L.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize failed ({rc}) for {src}")


def default_threads() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


MAX_THREADS = 512  # ggml's GGML_MAX_N_THREADS: past it a context segfaults (seen at 100000)


def thread_count(threads: int | None) -> int:
    """``threads``, or all the CPUs this process may use; InputError outside 1..MAX_THREADS
    before llama.cpp sees the number."""
    if threads is None:
        return default_threads()
    if not 1 <= threads <= MAX_THREADS:
        raise InputError(f"--threads must be between 1 and {MAX_THREADS} (ggml's limit), not {threads}")
    return threads


class FreedWithObject:
    """Contexts hold large buffers: free them (``close``) when the object goes."""

    def close(self) -> None:
        raise NotImplementedError

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
