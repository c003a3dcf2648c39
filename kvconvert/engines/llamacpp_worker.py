"""Score token windows in stock llama.cpp contexts. Runs in its own process (kvconvert.engines.llamacpp).

    python -P -m kvconvert.engines.llamacpp_worker CONFIG.json  < requests  > answers

llama.cpp is reached through llama-cpp-python's ctypes bindings of its C API (llama_cpp.llama_cpp) only.
One JSON request per line on stdin, one JSON answer per line on stdout; file descriptor 1 is moved to
stderr before llama.cpp loads, so nothing it prints can corrupt the answers (the caller logs stderr).

CONFIG: {"contexts": [{"name", "gguf", "cache", "cache_v", "flash_attn", "rotation"}, ...],
         "n_ctx": int, "threads": int}
First answer: {"op": "ready", "contexts": {name: {...}}} once every model and context is made, or
{"op": "ready", "error": "..."} when llama.cpp refuses one (it logs why on stderr).
Requests:
    {"op": "info"} -> llama.cpp's system info and each context's settings
    {"op": "score", "ids": [int], "reference": name | null} -> {"sums": {name: {nll, kl, tokens, top1}}}:
        every context decodes the window from an empty cache (positions 0..T-1, one sequence, logits for
        every position) and its sums come from kvconvert.token_stats.window_sums against the reference
        context's logits of the same window.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time
from dataclasses import asdict

# ggml's CPU threads are OpenMP threads; spinning waits are ~3x slower than sleeping ones on a CPU other work
# shares (measured: 256 tokens of SmolLM2 on 2 busy cores, 2 threads 11.1 s spinning, 4.8 s passive). Set before
# llama.cpp (and libgomp) load; an OMP_WAIT_POLICY in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# A failed GGML_ASSERT prints its message, then would attach gdb (when installed) for a backtrace before
# aborting: slow, and nothing kvconvert reports. The message is enough.
os.environ.setdefault("GGML_NO_BACKTRACE", "1")

FLASH_ATTN_TYPES = {"auto": -1, "off": 0, "on": 1}  # enum llama_flash_attn_type
ROT_ENV = "LLAMA_ATTN_ROT_DISABLE"  # read by llama.cpp's KV cache when a context is made


class BadRequest(ValueError):
    """A request refused before llama.cpp sees it (the worker stays usable)."""


def fail(message: str) -> None:
    print(f"llamacpp_worker: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


class Context:
    """One llama.cpp context on a loaded model, scoring whole windows."""

    def __init__(self, L, model, spec: dict, n_ctx: int, threads: int):
        from kvconvert.engines.llamacpp import cache_type

        self.L, self.model, self.spec = L, model, spec
        self.n_batch = min(n_ctx, 512)
        params = L.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = n_ctx, self.n_batch, self.n_batch, 1
        params.n_outputs_max = self.n_batch
        params.n_outputs_max_per_seq = 0  # every position of the sequence has an output (0 = n_outputs_max)
        params.n_threads = params.n_threads_batch = threads
        params.type_k = cache_type(spec["cache"]).ggml_type
        params.type_v = cache_type(spec.get("cache_v") or spec["cache"]).ggml_type
        params.flash_attn_type = FLASH_ATTN_TYPES[spec["flash_attn"]]
        params.embeddings, params.no_perf = False, True
        before = os.environ.get(ROT_ENV)
        os.environ[ROT_ENV] = "0" if spec["rotation"] else "1"
        try:
            self.ctx = L.llama_init_from_model(model, params)
        finally:
            if before is None:
                os.environ.pop(ROT_ENV)
            else:
                os.environ[ROT_ENV] = before
        if not self.ctx:
            raise RuntimeError(f"llama.cpp refused context {spec['name']!r} (K {spec['cache']}, V "
                               f"{spec.get('cache_v') or spec['cache']}, flash_attn {spec['flash_attn']}); its log says why")
        self.vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
        self.batch = L.llama_batch_init(self.n_batch, 0, 1)

    def logits(self, ids: list[int]):
        """fp32 [T, vocab] logits of every position of the window, from an empty cache."""
        import numpy as np

        L, batch = self.L, self.batch
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
        out = np.empty((len(ids), self.vocab), dtype=np.float32)
        for start in range(0, len(ids), self.n_batch):
            n = min(self.n_batch, len(ids) - start)
            batch.n_tokens = n
            for j in range(n):
                batch.token[j], batch.pos[j], batch.n_seq_id[j], batch.logits[j] = ids[start + j], start + j, 1, 1
                batch.seq_id[j][0] = 0
            code = L.llama_decode(self.ctx, batch)
            if code != 0:
                raise RuntimeError(f"llama_decode returned {code} for context {self.spec['name']!r}")
            rows = ctypes.cast(L.llama_get_logits(self.ctx), ctypes.POINTER(ctypes.c_float))
            out[start:start + n] = np.ctypeslib.as_array(rows, shape=(n, self.vocab))
        return out

    def close(self) -> None:
        self.L.llama_batch_free(self.batch)
        self.L.llama_free(self.ctx)


class Engine:
    """The models (each GGUF loaded once) and their contexts, in the config's order."""

    def __init__(self, config: dict):
        import llama_cpp.llama_cpp as L

        L.llama_log_set(L.llama_log_callback(), None)  # NULL: llama.cpp's own stderr logging, not llama-cpp-python's Python callback
        import torch

        L.llama_backend_init()
        self.L, self.models, self.contexts = L, {}, {}
        n_ctx, threads = int(config["n_ctx"]), int(config["threads"])
        torch.set_num_threads(threads)  # window_sums' log-softmax, between llama.cpp's decodes
        for spec in config["contexts"]:
            path = spec["gguf"]
            if path not in self.models:
                params = L.llama_model_default_params()
                params.n_gpu_layers = 0
                model = L.llama_model_load_from_file(path.encode(), params)
                if not model:
                    raise RuntimeError(f"llama.cpp could not load {path}; its log says why")
                self.models[path] = model
            self.contexts[spec["name"]] = Context(L, self.models[path], spec, n_ctx, threads)

    def describe(self) -> dict:
        L = self.L
        out = {}
        for name, c in self.contexts.items():
            desc = ctypes.create_string_buffer(256)
            L.llama_model_desc(c.model, desc, len(desc))
            out[name] = {**c.spec, "model": desc.value.decode(errors="replace"), "vocab": c.vocab,
                         "n_params": int(L.llama_model_n_params(c.model))}
        return out

    def info(self, _request: dict) -> dict:
        import llama_cpp

        return {"llama_cpp_python": llama_cpp.__version__,
                "system_info": self.L.llama_print_system_info().decode(errors="replace").strip(),
                "contexts": self.describe()}

    def score(self, request: dict) -> dict:
        import torch

        from kvconvert.token_stats import window_sums

        ids = [int(t) for t in request.get("ids") or []]
        reference = request.get("reference")
        if len(ids) < 2:
            raise BadRequest("score needs a window of at least 2 tokens")
        if reference is not None and reference not in self.contexts:
            raise BadRequest(f"reference {reference!r} is not a context ({', '.join(self.contexts)})")
        if max(ids) >= min(c.vocab for c in self.contexts.values()) or min(ids) < 0:
            raise BadRequest("token ids outside the model's vocabulary")
        logits = {name: torch.from_numpy(c.logits(ids)) for name, c in self.contexts.items()}
        target = torch.tensor(ids)
        ref = logits.get(reference)
        return {"sums": {name: asdict(window_sums(x, target, None if name == reference else ref))
                         for name, x in logits.items()}}

    def close(self) -> None:
        for c in self.contexts.values():
            c.close()
        for model in self.models.values():
            self.L.llama_model_free(model)


def serve(engine: Engine, answers) -> None:
    ops = {"info": engine.info, "score": engine.score}
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        op, started = request.get("op"), time.time()
        try:
            if op not in ops:
                raise BadRequest(f"unknown op {op!r}; choose from {sorted(ops)}")
            answer = ops[op](request)
        except (BadRequest, RuntimeError) as exc:
            answer = {"error": str(exc)}
        answer.update(op=op, seconds=round(time.time() - started, 3))
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        fail("usage: python -m kvconvert.engines.llamacpp_worker CONFIG.json  (requests on stdin, answers on stdout)")
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    with open(argv[1]) as f:
        config = json.load(f)
    started = time.time()
    try:
        engine = Engine(config)
    except ImportError as exc:
        fail(f"llama_cpp does not import in {sys.executable}: {exc}")
    except RuntimeError as exc:
        answers.write(json.dumps({"op": "ready", "error": str(exc)}) + "\n")
        answers.flush()
        return
    answers.write(json.dumps({"op": "ready", "seconds": round(time.time() - started, 2),
                              "contexts": engine.describe()}) + "\n")
    answers.flush()
    try:
        serve(engine, answers)
    finally:
        engine.close()


if __name__ == "__main__":
    main(sys.argv)
