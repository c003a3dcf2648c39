"""Stock llama.cpp, driven through llama-cpp-python's ctypes bindings of its C API, in a worker process.

llama-cpp-python (scripts/setup_llamacpp.sh builds it into kvconvert's ./.venv) is used only for its
low-level bindings (llama_cpp.llama_cpp): model load, a context per (model, KV-cache type), llama_batch,
llama_decode with logits for every position, llama_get_logits. That C code aborts the process on a
failed GGML_ASSERT, so it runs in a subprocess (kvconvert/engines/llamacpp_worker.py, kvconvert's own
python): an abort there becomes a KVConvertError here with llama.cpp's own message, and kvconvert goes on.

    contexts = [LlamaCppContext(name="reference", gguf="src.gguf", cache="f32"),
                LlamaCppContext(name="candidate", gguf="src.gguf", cache="q4_0")]
    with LlamaCppScorer(contexts, n_ctx=1024) as engine:
        sums = engine.score(ids)                 # {"reference": TokenSums, "candidate": TokenSums}
        sums["candidate"].kl_mean, sums["candidate"].top1_rate, sums["candidate"].ppl

Every context scores the same window; the worker sums NLL, KL(reference || context) and top-1 agreement
per window with kvconvert.token_stats.window_sums (float64), so no logits leave the worker or touch a
disk. One GGUF loaded once serves all the contexts that name it.

The KV-cache types are those llama.cpp accepts for K and V (LLAMA_CACHE_TYPES, common/arg.cpp's list),
named as llama.cpp names them. What its source requires (src/llama-context.cpp, llama-kv-cache.cpp):
- a quantized V cache needs flash attention (llama.cpp turns "auto" on for it, refuses "off");
- with flash attention, a quantized cache's block (32 values) must divide the head size it stores;
- an MLA model (DEEPSEEK2 with key_length_mla) caches [latent | k_rope] once, in the K cache, V being a
  view of its latent part: K and V types must be equal;
- a quantized K (V) cache whose head size is a multiple of 64 is rotated by a Hadamard transform
  (queries and keys alike, so scores are unchanged up to rounding); LLAMA_ATTN_ROT_DISABLE=1 turns it
  off. `rotation=False` sets that variable for that one context (it is read when the context is made).
  Only the per-head K/V attention (build_attn on llm_graph_input_attn_kv) applies it: the MLA path
  (llm_graph_input_attn_k) stores the latent row unrotated whatever the variable says (src/llama-graph.cpp;
  measured: identical sums with and without it).
These are checked here, before the worker starts, from the GGUF's own metadata.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from kvconvert.engines.worker import WorkerProcess
from kvconvert.errors import KVConvertError
from kvconvert.targets import llamacpp_shape_problem
from kvconvert.token_stats import TokenSums

SETUP_HINT = "run `bash scripts/setup_llamacpp.sh` in the kvconvert checkout (builds llama-cpp-python into ./.venv)"
FLASH_ATTN = ("auto", "on", "off")


@dataclass(frozen=True)
class CacheType:
    name: str  # llama.cpp's name (-ctk / -ctv)
    ggml_type: int  # enum ggml_type (gguf.GGMLQuantizationType: the same numbers)
    block: int  # values per block (1 for float types)

    @property
    def quantized(self) -> bool:
        return self.block > 1


def _cache_types() -> dict[str, CacheType]:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

    names = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "q4_1": Q.Q4_1,
             "iq4_nl": Q.IQ4_NL, "q5_0": Q.Q5_0, "q5_1": Q.Q5_1}
    return {name: CacheType(name, int(q), GGML_QUANT_SIZES[q][0]) for name, q in names.items()}


LLAMA_CACHE_TYPES = _cache_types()


def cache_type(name: str) -> CacheType:
    try:
        return LLAMA_CACHE_TYPES[name.lower()]
    except KeyError:
        raise KVConvertError(f"llama.cpp KV-cache type {name!r} is unknown; llama.cpp takes "
                             f"{', '.join(LLAMA_CACHE_TYPES)}") from None


@dataclass(frozen=True)
class LlamaCppContext:
    """One llama.cpp context: a GGUF model with a KV cache. cache: the K type (and V's unless cache_v);
    flash_attn: llama.cpp's -fa (auto lets llama.cpp decide); rotation: llama.cpp's Hadamard rotation of
    quantized caches (False = LLAMA_ATTN_ROT_DISABLE=1 for this context)."""

    name: str
    gguf: str
    cache: str = "f16"
    cache_v: str | None = None
    flash_attn: Literal[FLASH_ATTN] = "auto"
    rotation: bool = True

    @property
    def type_v(self) -> str:
        return self.cache_v or self.cache


@dataclass(frozen=True)
class GGUFShape:
    """What llama.cpp's cache checks read from a GGUF's metadata."""

    arch: str
    mla: bool
    head_k: int  # values per cached K row and head (MLA: kv_lora_rank + rope)
    head_v: int  # ... V (MLA: kv_lora_rank)
    vocab: int


def gguf_shape(path: str | os.PathLike) -> GGUFShape:
    """The cache-relevant metadata of a GGUF file (gguf-py's reader: header and metadata, no weights read)."""
    from gguf import GGUFReader

    path = Path(path)
    if not path.is_file():
        raise KVConvertError(f"{path}: GGUF file not found; write one with `kvconvert export-gguf`")
    try:
        reader = GGUFReader(path)
    except Exception as exc:  # gguf-py raises ValueError, struct.error, ... for a broken file
        raise KVConvertError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from None

    def value(key: str, default=None):
        field = reader.fields.get(key)
        return default if field is None else field.contents()

    arch = value("general.architecture")
    heads = value(f"{arch}.attention.head_count")
    head = value(f"{arch}.embedding_length", 0) // heads if heads else 0
    tokens = value("tokenizer.ggml.tokens")
    return GGUFShape(arch=arch, mla=value(f"{arch}.attention.key_length_mla") is not None,
                     head_k=value(f"{arch}.attention.key_length", head), head_v=value(f"{arch}.attention.value_length", head),
                     vocab=value(f"{arch}.vocab_size", len(tokens) if tokens else 0))


def check_context(spec: LlamaCppContext, shape: GGUFShape) -> None:
    """Refuse, with the reason, a context llama.cpp would refuse or abort on (module docstring)."""
    k, v = cache_type(spec.cache), cache_type(spec.type_v)
    if spec.flash_attn not in FLASH_ATTN:
        raise KVConvertError(f"flash_attn {spec.flash_attn!r}: choose one of {', '.join(FLASH_ATTN)}")
    where = f"llama.cpp context {spec.name!r} ({Path(spec.gguf).name}, K {k.name}, V {v.name})"
    if shape.mla and k != v:
        raise KVConvertError(f"{where}: an MLA model caches its latent once, in the K cache (V is a view of it); "
                             "llama.cpp requires equal K and V cache types: give one type")
    if v.quantized and spec.flash_attn == "off":
        raise KVConvertError(f"{where}: a quantized V cache needs flash attention; llama.cpp refuses it with "
                             "flash attention off: use flash_attn auto or on")
    problem = llamacpp_shape_problem(shape.head_k, shape.head_v, k.quantized, v.quantized)
    if spec.flash_attn != "off" and problem:
        raise KVConvertError(f"{where}: {problem}; llama.cpp refuses it (choose a float cache, or an MLA latent whose "
                             "kv_lora_rank and rope are multiples of 32)")


_LOADS: dict[str, str | None] = {}  # python -> why llama.cpp does not load there (None: it loads), probed once


def check_installed() -> None:
    """llama-cpp-python installed in this python (kvconvert's venv) and its llama.cpp library loading, probed in a
    child process (the worker's own import, `python -P -c "import llama_cpp.llama_cpp"`) so that a broken install
    (a missing or mismatched libllama, an unresolved symbol) is refused before any work, not after it; llama.cpp
    is never loaded into this process."""
    import subprocess

    if importlib.util.find_spec("llama_cpp") is None:
        raise KVConvertError(f"llama-cpp-python is not installed in {sys.executable}; {SETUP_HINT}")
    if sys.executable not in _LOADS:
        try:
            done = subprocess.run([sys.executable, "-P", "-c", "import llama_cpp.llama_cpp"], capture_output=True,
                                  text=True, timeout=300)
            lines = [ln.strip() for ln in done.stderr.splitlines() if ln.strip()]
            _LOADS[sys.executable] = None if done.returncode == 0 else (
                lines[-1] if lines else f"exit code {done.returncode}")
        except subprocess.TimeoutExpired:
            _LOADS[sys.executable] = "its import did not finish in 300 s"
    if _LOADS[sys.executable]:
        raise KVConvertError(f"llama-cpp-python in {sys.executable} is installed but does not load "
                             f"({_LOADS[sys.executable]}); reinstall it: {SETUP_HINT}")


class LlamaCppScorer(WorkerProcess):
    """llama.cpp contexts in one worker process (module docstring). n_ctx: the longest window scored;
    threads: llama.cpp's threads (None: the CPUs this process may use). The worker's log (llama.cpp's
    output) goes to `log_path`, and its tail into any error. timeout: seconds for any one answer."""

    who = "llama.cpp worker"

    def __init__(self, contexts: list[LlamaCppContext], n_ctx: int, threads: int | None = None,
                 log_path: str | os.PathLike | None = None, timeout: float = 1800.0):
        check_installed()
        if not contexts or len({c.name for c in contexts}) != len(contexts):
            raise KVConvertError("llama.cpp scorer: give one or more contexts with distinct names")
        self.shapes = {}
        for spec in contexts:
            self.shapes[spec.name] = gguf_shape(spec.gguf)
            check_context(spec, self.shapes[spec.name])
        if len({s.vocab for s in self.shapes.values()}) > 1:
            raise KVConvertError("llama.cpp scorer: the GGUF files have different vocabularies; logits cannot be "
                                 "compared")
        self.contexts = contexts
        super().__init__({"contexts": [{**asdict(c), "gguf": str(Path(c.gguf).resolve())} for c in contexts],
                          "n_ctx": int(n_ctx), "threads": threads or len(os.sched_getaffinity(0))},
                         "kvconvert-llamacpp-", "llamacpp.log", log_path, timeout)
        self.ready: dict = {}

    def command(self, config_path: Path) -> list[str]:
        # -P: the installed kvconvert, never a checkout that happens to be the current folder
        return [sys.executable, "-P", "-m", "kvconvert.engines.llamacpp_worker", str(config_path)]

    def is_verdict(self, line: str) -> bool:
        """llama.cpp's last words: its assertion or error lines, or the worker's own."""
        return "GGML_ASSERT" in line or "error" in line.lower() or line.startswith("llamacpp_worker:")

    def start(self) -> LlamaCppScorer:
        self.ready = self.start_process()
        if "error" in self.ready:
            tail = self.log_tail()
            self.close()
            raise KVConvertError(f"llama.cpp: {self.ready['error']} {tail}")
        return self

    def request(self, op: str, **fields) -> dict:
        try:
            answer = self.send(op, **fields)
        except KVConvertError:
            self.close()  # a dead or silent worker is not reused
            raise
        if "error" in answer:
            raise KVConvertError(f"llama.cpp ({op}): {answer['error']}")
        return answer

    # ------------------------------------------------------------------ operations

    def info(self) -> dict:
        """llama.cpp's build, CPU features and each context's model, cache and rotation."""
        return self.request("info")

    def score(self, ids, reference: str | None = "reference") -> dict[str, TokenSums]:
        """Each context's sums over the window `ids` (a tensor or a list of ints, at most n_ctx tokens):
        NLL of ids[1:], and against the context named `reference` (None: none) KL(reference || context) and
        top-1 agreement."""
        tokens = [int(t) for t in (ids.tolist() if hasattr(ids, "tolist") else ids)]
        if len(tokens) > self.config["n_ctx"]:
            raise KVConvertError(f"a window of {len(tokens)} tokens exceeds the context of {self.config['n_ctx']}")
        answer = self.request("score", ids=tokens, reference=reference)
        return {name: TokenSums(**sums) for name, sums in answer["sums"].items()}
